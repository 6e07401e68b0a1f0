// The CUDA side of autograd's function table (a CUDA Context gets it from
// <shardkit/cuda.hpp> with the other layers' tables): our kernels, and cuBLAS / cuDNN for the
// library-backed ops (shardkit/autograd/cuda_libraries.hpp).
// The kernels behind it live one concept per file beside this one (common, elementwise, rowwise,
// cross_entropy, pooling, batch_norm_sync, sinkhorn); including this header still brings them all.
// Half types load and store as f16/bf16 and compute in f32; double stays double. Reductions are
// deterministic (one block per row or channel, fixed tree order), so repeated runs give the same
// bits.
#pragma once

#include "kernels/autograd/batch_norm_sync.cuh"
#include "kernels/autograd/common.cuh"
#include "kernels/autograd/cross_entropy.cuh"
#include "kernels/autograd/elementwise.cuh"
#include "kernels/autograd/pooling.cuh"
#include "kernels/autograd/rowwise.cuh"
#include "kernels/autograd/sinkhorn.cuh"
#include "shardkit/autograd/cuda_libraries.hpp"

namespace shardkit::autograd {

namespace cuda_kernels {

// Training-mode batch-norm is the synchronised form's steps for a group of one
// (batch_norm_sync.cuh): each channel's values spread over many blocks, where cuDNN's NCHW
// batch-norm gives a channel one block -- 383 us for the backward of a 64-channel layer of
// 256 x 32² images on an H200, 8x its bytes' copy time, and the largest kernel of the ResNet-18
// step. The statistics are double sums (those of the CPU's loops), the ReLU is applied as y is
// written, and the input gradient is skipped when grad_x is undefined.
inline void batch_norm_train_forward(Context& ctx, const Tensor& x, const Tensor& weight,
                                     const Tensor& bias, const Tensor& running_mean,
                                     const Tensor& running_var, double momentum, double eps,
                                     const Tensor& y, const Tensor& save_mean,
                                     const Tensor& save_invstd, std::int64_t outer,
                                     std::int64_t channels, std::int64_t inner, bool relu) {
  Tensor stats = empty(ctx, {2 * channels}, DType::f64, MemoryCategory::other);
  batch_norm_local_stats(ctx, x, momentum, eps, running_mean, running_var, stats, save_mean,
                         save_invstd, outer, channels, inner);
  batch_norm_apply(ctx, x, weight, bias, stats, y, outer, channels, inner, relu);
}

// grad_y arrives masked by a fused ReLU already (relu_out undefined).
inline void batch_norm_train_backward(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                      const Tensor& weight, const Tensor& save_mean,
                                      const Tensor& save_invstd, double, const Tensor& grad_x,
                                      const Tensor& grad_weight, const Tensor& grad_bias,
                                      std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                      const Tensor& relu_out) {
  check(!relu_out.defined(), "batch_norm_train_backward on the GPU takes the gradient masked by ",
        "a fused ReLU already (relu_out must be undefined)");
  Tensor sums = empty(ctx, {2 * channels}, DType::f64, MemoryCategory::other);
  batch_norm_local_grad_sums(ctx, x, grad_y, save_mean, save_invstd, sums, grad_weight, grad_bias,
                             outer, channels, inner);
  if (grad_x.defined())
    batch_norm_input_grad(ctx, x, grad_y, weight, save_mean, save_invstd, relu_out, sums, Tensor(),
                          grad_x, outer, channels, inner);
}

}  // namespace cuda_kernels

// The CUDA table: constant, so no global mutable state.
inline const AutogradKernels* cuda_kernels_table() {
  namespace k = cuda_kernels;
  static constexpr AutogradKernels kTable{
      .pointwise = &k::pointwise,
      .channel_sum = &k::channel_sum,
      .channel_bias_add = &k::channel_bias_add,
      .channel_scale = &k::channel_scale,
      .softmax_forward = &k::softmax_forward,
      .softmax_backward = &k::softmax_backward,
      .l2_normalize_forward = &k::l2_normalize_forward,
      .l2_normalize_backward = &k::l2_normalize_backward,
      .cross_entropy_forward = &k::cross_entropy_forward,
      .cross_entropy_backward = &k::cross_entropy_backward,
      .adaptive_avg_pool_forward = &k::adaptive_avg_pool_forward,
      .adaptive_avg_pool_backward = &k::adaptive_avg_pool_backward,
      .batch_norm_eval_backward = &k::batch_norm_eval_backward,
      .batch_norm_moments = &k::batch_norm_moments,
      .batch_norm_group_stats = &k::batch_norm_group_stats,
      .batch_norm_apply = &k::batch_norm_apply,
      .batch_norm_grad_sums = &k::batch_norm_grad_sums,
      .batch_norm_input_grad = &k::batch_norm_input_grad,
      .sinkhorn_scale = &k::sinkhorn_scale,
      .sinkhorn_exp = &k::sinkhorn_exp,
      .sinkhorn_column_sums = &k::sinkhorn_column_sums,
      .sinkhorn_scale_rows = &k::sinkhorn_scale_rows,
      .sinkhorn_codes = &k::sinkhorn_codes,
      .gemm = &cuda::gemm,
      .conv2d_forward = &cuda::conv2d_forward,
      .conv2d_backward = &cuda::conv2d_backward,
      .conv2d_output_block = [](Context&, const Tensor&, const ConvGeometry&) -> std::int64_t {
        return 0;  // (no channel blocks on the GPU: cuDNN takes NCHW or NHWC)
      },
      .batch_norm_train_forward = &k::batch_norm_train_forward,
      .batch_norm_eval_forward = &k::batch_norm_eval_apply,  // (batch_norm_sync.cuh)
      .batch_norm_train_backward = &k::batch_norm_train_backward,
      .max_pool_forward = &k::max_pool_forward,
      .max_pool_backward = &k::max_pool_backward,
  };
  return &kTable;
}

}  // namespace shardkit::autograd
