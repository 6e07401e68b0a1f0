// The CUDA side of autograd's function table (a CUDA Context gets it from
// <shardkit/cuda.hpp> with the other layers' tables).
// The kernels behind it live one concept per file beside this one (common, elementwise, rowwise,
// cross_entropy, pooling, batch_norm_sync); including this header still brings them all. Half types
// load and store as f16/bf16 and compute in f32; double stays double. Reductions are deterministic
// (one block per row or channel, fixed tree order), so repeated runs give the same bits.
#pragma once

#include "kernels/autograd/batch_norm_sync.cuh"
#include "kernels/autograd/common.cuh"
#include "kernels/autograd/cross_entropy.cuh"
#include "kernels/autograd/elementwise.cuh"
#include "kernels/autograd/pooling.cuh"
#include "kernels/autograd/rowwise.cuh"

namespace shardkit::autograd {

// The CUDA table: constant, so no global mutable state.
inline const AutogradKernels* cuda_kernels_table() {
  namespace k = cuda_kernels;
  static constexpr AutogradKernels kTable{
      .pointwise = &k::pointwise,
      .channel_sum = &k::channel_sum,
      .channel_bias_add = &k::channel_bias_add,
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
  };
  return &kTable;
}

}  // namespace shardkit::autograd
