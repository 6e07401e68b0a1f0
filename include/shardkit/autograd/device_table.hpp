// The function table behind autograd's element-wise and row-wise kernels. The CPU table lives in
// cpu_kernels.hpp; the CUDA table in kernels/autograd/autograd_kernels.cuh (nvcc only), which a
// CUDA Context carries from its creation (kernels/cuda_context.cuh). Host code calls through the
// table, so the same op runs on either device and host headers never see a kernel launch.
#pragma once

#include <cstdint>
#include <memory>

#include "shardkit/core/context.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::autograd {

enum class Pointwise : std::uint8_t {
  axpby,          // out = alpha*a + beta*b (b may be undefined when beta == 0)
  mul,            // out = alpha*a*b
  relu,           // out = max(a, 0)
  relu_backward,  // out = a * (b > 0)   (a: gradient, b: the relu's output)
};

// Every tensor is contiguous and on the context's device. Shapes are given as explicit extents
// so the kernels stay free of shape logic. "Accumulator" values are f32 for f16/bf16 data.
struct AutogradKernels {
  void (*pointwise)(Context&, Pointwise op, const Tensor& out, const Tensor& a, const Tensor& b,
                    double alpha, double beta);
  // out[c] = sum over (o, i) of x[o, c, i]; out may have another floating dtype than x.
  void (*channel_sum)(Context&, const Tensor& x, const Tensor& out, std::int64_t outer,
                      std::int64_t channels, std::int64_t inner);
  // y[o, c, i] += bias[c]
  void (*channel_bias_add)(Context&, const Tensor& y, const Tensor& bias, std::int64_t outer,
                           std::int64_t channels, std::int64_t inner);
  // Row-wise (log-)softmax of x[rows, cols].
  void (*softmax_forward)(Context&, const Tensor& x, const Tensor& y, std::int64_t rows,
                          std::int64_t cols, bool log);
  void (*softmax_backward)(Context&, const Tensor& y, const Tensor& grad_y, const Tensor& grad_x,
                           std::int64_t rows, std::int64_t cols, bool log);
  // y = x / max(|x|, eps) row-wise; norms[rows] (accumulator dtype) keeps |x| for backward.
  void (*l2_normalize_forward)(Context&, const Tensor& x, const Tensor& y, const Tensor& norms,
                               std::int64_t rows, std::int64_t cols, double eps);
  void (*l2_normalize_backward)(Context&, const Tensor& y, const Tensor& norms,
                                const Tensor& grad_y, const Tensor& grad_x, std::int64_t rows,
                                std::int64_t cols, double eps);
  // log_probs = log_softmax(x); loss (scalar, accumulator dtype) = -mean over rows of
  // sum_c target * log_probs. target: i64 class indices [rows] or probabilities [rows, cols].
  void (*cross_entropy_forward)(Context&, const Tensor& x, const Tensor& target,
                                const Tensor& log_probs, const Tensor& loss, std::int64_t rows,
                                std::int64_t cols);
  // grad_x = grad_loss / rows * (softmax * sum_c target - target); grad_loss is a scalar tensor.
  void (*cross_entropy_backward)(Context&, const Tensor& log_probs, const Tensor& target,
                                 const Tensor& grad_loss, const Tensor& grad_x, std::int64_t rows,
                                 std::int64_t cols);
  // x[N, C, H, W] -> y[N, C, OH, OW], PyTorch's adaptive windows.
  void (*adaptive_avg_pool_forward)(Context&, const Tensor& x, const Tensor& y);
  void (*adaptive_avg_pool_backward)(Context&, const Tensor& grad_y, const Tensor& grad_x);
  // Batch-norm in evaluation mode, backward: grad_x = grad_y * weight * invstd and
  // grad_y_xhat = grad_y * (x - mean) * invstd (channel-summed afterwards for grad_weight).
  void (*batch_norm_eval_backward)(Context&, const Tensor& x, const Tensor& grad_y,
                                   const Tensor& weight, const Tensor& mean, const Tensor& var,
                                   double eps, const Tensor& grad_x, const Tensor& grad_y_xhat,
                                   std::int64_t outer, std::int64_t channels, std::int64_t inner);
};

// The dtype that sums and statistics are kept in: f32 for half types, else the dtype itself.
constexpr DType accumulator_dtype(DType dtype) {
  return (dtype == DType::f16 || dtype == DType::bf16) ? DType::f32 : dtype;
}

}  // namespace shardkit::autograd
