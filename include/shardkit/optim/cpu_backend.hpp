// CpuOps: the fused ops of the CPU as a compile-time backend policy. The optimizer and the
// data-parallel engine are templates over it; kernels/optim/cuda_backend.cuh gives CudaOps,
// the same calls on the GPU.
#pragma once

#include "shardkit/ops/cpu_ops.hpp"

namespace shardkit::optim {

struct CpuOps {
  static void sgd_step(Context& ctx, const ops::SgdOptions& o, const ops::SgdTensors& t) {
    ops::cpu::sgd_step(ctx, o, t);
  }
  static void sgd_step(Context& ctx, const ops::SgdOptions& o, const ops::SgdTensors& t,
                       const Tensor& coefficients) {
    ops::cpu::sgd_step(ctx, o, t, coefficients);
  }
  static void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                      std::span<const Tensor> second, const Tensor& sums) {
    ops::cpu::segment_sums_of_squares(ctx, first, second, sums);
  }
  static void larc_coefficients(Context& ctx, const ops::LarcOptions& larc, float lr,
                                float inv_grad_scale, const Tensor& sums, const Tensor& coefficients) {
    ops::cpu::larc_coefficients(ctx, larc, lr, inv_grad_scale, sums, coefficients);
  }
  static void adam_step(Context& ctx, const ops::AdamOptions& o, const ops::AdamTensors& t) {
    ops::cpu::adam_step(ctx, o, t);
  }
};

}  // namespace shardkit::optim
