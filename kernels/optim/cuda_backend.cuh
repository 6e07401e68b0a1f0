// CudaOps: the fused ops on the GPU as the compile-time backend policy of the optimizer and the
// data-parallel engine (CpuOps's twin: the same calls, ops::cuda underneath).
#pragma once

#include "kernels/ops/ops.cuh"
#include "shardkit/optim/cpu_backend.hpp"

namespace shardkit::optim {

struct CudaOps {
  static void sgd_step(Context& ctx, const ops::SgdOptions& o, const ops::SgdTensors& t) {
    ops::cuda::sgd_step(ctx, o, t);
  }
  static void sgd_step(Context& ctx, const ops::SgdOptions& o, const ops::SgdTensors& t,
                       const Tensor& coefficients) {
    ops::cuda::sgd_step(ctx, o, t, coefficients);
  }
  static void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                      std::span<const Tensor> second, const Tensor& sums) {
    ops::cuda::segment_sums_of_squares(ctx, first, second, sums);
  }
  static void larc_coefficients(Context& ctx, const ops::LarcOptions& larc, float lr,
                                float inv_grad_scale, const Tensor& sums, const Tensor& coefficients) {
    ops::cuda::larc_coefficients(ctx, larc, lr, inv_grad_scale, sums, coefficients);
  }
  static void adam_step(Context& ctx, const ops::AdamOptions& o, const ops::AdamTensors& t) {
    ops::cuda::adam_step(ctx, o, t);
  }
};

}  // namespace shardkit::optim
