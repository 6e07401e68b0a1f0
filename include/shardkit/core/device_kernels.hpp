// The table of device-side tensor kernels a CUDA Context carries. Host headers cannot launch
// kernels (they compile with plain g++), so nvcc-compiled code (kernels/core/tensor_kernels.cuh)
// fills this table and hands it to the Context; host code calls through it.
#pragma once

#include "shardkit/core/philox.hpp"

namespace shardkit {

class Context;
class Tensor;

// Forward declarations only: core carries the tables of upper layers without knowing them.
namespace comm {
struct DeviceCommKernels;
}
namespace autograd {
struct AutogradKernels;
}
namespace ops {
struct FusedOps;
}

struct DeviceKernels {
  // Sets every element of a device tensor (any strides) to `value`, converted to its dtype.
  void (*fill)(Context& ctx, const Tensor& tensor, double value);
  // dst = src for two tensors on the context's device: same shape, any strides, any dtypes
  // (converting like convert_value).
  void (*copy)(Context& ctx, const Tensor& dst, const Tensor& src);
  // dst += src, same shape, any strides; src converted to dst's dtype, the sum formed as
  // add_value (core/dtype.hpp) forms it.
  void (*add)(Context& ctx, const Tensor& dst, const Tensor& src);
  // t /= divisor, any strides; formed in f32 (f64 for f64 tensors) and rounded once.
  void (*divide)(Context& ctx, const Tensor& tensor, double divisor);
  // Fills a floating-point device tensor from the counter-based stream described by `spec`.
  void (*random)(Context& ctx, const Tensor& tensor, const RandomSpec& spec);
};

// Every table of device code a CUDA Context carries, one per layer that launches kernels.
// <shardkit/cuda.hpp> fills them all (sk::cuda_context_options / sk::make_cuda_context):
// the one way to get a CUDA context.
struct CudaKernelTables {
  const DeviceKernels* tensor = nullptr;                // core: fill, copy, add, divide, random
  const comm::DeviceCommKernels* comm = nullptr;        // local collectives over device memory
  const autograd::AutogradKernels* autograd = nullptr;  // autograd's element-wise and row ops
  const ops::FusedOps* ops = nullptr;                   // the fused optimizer ops (ops::Cuda)
};

}  // namespace shardkit
