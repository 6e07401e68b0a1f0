// The table of device-side tensor kernels a CUDA Context carries. Host headers cannot launch
// kernels (they compile with plain g++), so nvcc-compiled code (kernels/core/tensor_kernels.cuh)
// fills this table and hands it to the Context; host code calls through it.
#pragma once

#include "shardkit/core/philox.hpp"

namespace shardkit {

class Context;
class Tensor;

struct DeviceKernels {
  // Sets every element of a device tensor (any strides) to `value`, converted to its dtype.
  void (*fill)(Context& ctx, const Tensor& tensor, double value);
  // dst = src for two tensors on the context's device: same shape, any strides, any dtypes
  // (converting like convert_value).
  void (*copy)(Context& ctx, const Tensor& dst, const Tensor& src);
  // Fills a floating-point device tensor from the counter-based stream described by `spec`.
  void (*random)(Context& ctx, const Tensor& tensor, const RandomSpec& spec);
};

}  // namespace shardkit
