// The function table behind every autograd kernel: the element-wise and row-wise ones, and the
// library-backed ones (GEMM, convolution, batch-norm, max-pool: oneDNN or Eigen on the CPU,
// cuBLAS and cuDNN on the GPU). The CPU table lives in cpu_kernel_table.hpp; the CUDA table in
// kernels/autograd/autograd_kernels.cuh (nvcc only), which a CUDA Context carries from its
// creation (<shardkit/cuda.hpp>). Host code calls through the table -- kernels_for(ctx, tensor)
// -- so the same op runs on either device, with no `#if` on the build and no kernel launch in a
// host header: the one CPU/GPU idiom of the project (docs/design.md).
#pragma once

#include <cstdint>
#include <memory>

#include "shardkit/autograd/geometry.hpp"
#include "shardkit/autograd/pointwise_math.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::autograd {

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
  // out[o, c, i] = x[o, c, i] * scale[c] (a squeeze-and-excitation gate: x viewed as
  // [1, N * C, H * W] and scale as [N * C]); x, scale and out have one dtype.
  void (*channel_scale)(Context&, const Tensor& x, const Tensor& scale, const Tensor& out,
                        std::int64_t outer, std::int64_t channels, std::int64_t inner);
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
  // x[N, C, H, W] -> y[N, C, OH, OW], PyTorch's adaptive windows. The CPU's also take x, y
  // (and grad_y, grad_x) all channels-last (core/channels_last.hpp); the GPU's take NCHW.
  void (*adaptive_avg_pool_forward)(Context&, const Tensor& x, const Tensor& y);
  void (*adaptive_avg_pool_backward)(Context&, const Tensor& grad_y, const Tensor& grad_x);
  // Batch-norm in evaluation mode, backward: grad_x = grad_y * weight * invstd and
  // grad_y_xhat = grad_y * (x - mean) * invstd (channel-summed afterwards for grad_weight).
  void (*batch_norm_eval_backward)(Context&, const Tensor& x, const Tensor& grad_y,
                                   const Tensor& weight, const Tensor& mean, const Tensor& var,
                                   double eps, const Tensor& grad_x, const Tensor& grad_y_xhat,
                                   std::int64_t outer, std::int64_t channels, std::int64_t inner);

  // Synchronised batch-norm in training mode (SyncBatchNorm, autograd/norm.hpp), the steps
  // around its two exchanges. Per-channel sums and statistics are f64 tensors on the context's
  // device; weight, bias, saved and running statistics have the accumulator dtype.
  // moments[1 + 2C] = {outer * inner, mean[C], m2[C]} of x[outer, C, inner] (m2: the sum of
  // squared deviations from the mean).
  void (*batch_norm_moments)(Context&, const Tensor& x, const Tensor& moments, std::int64_t outer,
                             std::int64_t channels, std::int64_t inner);
  // Folds `members` ranks' moments (gathered rank-major, [members * (1 + 2C)]) in rank order
  // (fold_moments), then per channel store_batch_stats: stats[2C] = {mean, invstd} (f64),
  // save_mean / save_invstd, and the running statistics when running_mean is defined;
  // count[1] (f64) gets the group's values per channel.
  void (*batch_norm_group_stats)(Context&, const Tensor& gathered, int members,
                                 std::int64_t channels, double momentum, double eps,
                                 const Tensor& running_mean, const Tensor& running_var,
                                 const Tensor& stats, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& count);
  // y = (x - mean) * invstd * weight + bias with stats = {mean, invstd} (f64); with `relu`,
  // then max(y, 0).
  void (*batch_norm_apply)(Context&, const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& stats, const Tensor& y, std::int64_t outer,
                           std::int64_t channels, std::int64_t inner, bool relu);
  // sums[2C] = {sum(g), sum(g * (x - mean)) * invstd} (f64) with the saved statistics. With
  // relu_out (a fused ReLU's output), g is first masked as the ReLU's backward would; the CUDA
  // kernels take g masked already (relu_out undefined).
  void (*batch_norm_grad_sums)(Context&, const Tensor& x, const Tensor& grad_y,
                               const Tensor& save_mean, const Tensor& save_invstd,
                               const Tensor& relu_out, const Tensor& sums, std::int64_t outer,
                               std::int64_t channels, std::int64_t inner);
  // grad_x = w * invstd / count * (count * g - sum_g - xhat * sum_gxhat) with the group's sums
  // (as batch_norm_grad_sums lays them out, summed over the members) and count[1] (f64).
  void (*batch_norm_input_grad)(Context&, const Tensor& x, const Tensor& grad_y,
                                const Tensor& weight, const Tensor& save_mean,
                                const Tensor& save_invstd, const Tensor& relu_out,
                                const Tensor& sums, const Tensor& count, const Tensor& grad_x,
                                std::int64_t outer, std::int64_t channels, std::int64_t inner);

  // Sinkhorn-Knopp's passes over q[rows, cols] (SwAV's codes: samples/swav/sinkhorn.hpp runs
  // them between its all-reduces over the ranks). q, u, u_again, v and the one-element scalars
  // (largest, shift, total, divisor) share q's dtype, f32 or f64; scores and codes are f32.
  // Every scalar stays on the device, so a step that computes codes reads nothing back.
  // q = scores / epsilon (in q's dtype); largest[0] = max(q).
  void (*sinkhorn_scale)(Context&, const Tensor& scores, const Tensor& q, const Tensor& largest,
                         double epsilon);
  // q = exp(q - shift[0]); total[0] = sum(q). (With shift the maximum over every rank, each
  // exponent is <= 0: no entry can become infinite.)
  void (*sinkhorn_exp)(Context&, const Tensor& q, const Tensor& shift, const Tensor& total);
  // u[j] = sum over the rows of q[., j], after q /= divisor[0] where divisor is defined. With
  // zero_in defined (VISSL's guard against an empty prototype): when some zero_in[j] == 0,
  // q += 1e-12 first; otherwise q is left alone and u = 0.
  void (*sinkhorn_column_sums)(Context&, const Tensor& q, const Tensor& divisor,
                               const Tensor& zero_in, const Tensor& u, std::int64_t rows,
                               std::int64_t cols);
  // v[j] = (1 / cols) / w[j] with w = u_again where some u[j] == 0, else u; infinite v replaced
  // by the largest finite one; then every row of q is scaled by v and to sum to
  // 1 / global_rows.
  void (*sinkhorn_scale_rows)(Context&, const Tensor& q, const Tensor& u, const Tensor& u_again,
                              const Tensor& v, std::int64_t rows, std::int64_t cols,
                              std::int64_t global_rows);
  // codes[r] = q[r] / sum(q[r]) in f32 for the first code_rows rows; `hard`: then one-hot at
  // the row's first largest code.
  void (*sinkhorn_codes)(Context&, const Tensor& q, const Tensor& codes, std::int64_t code_rows,
                         std::int64_t cols, bool hard);

  // The library-backed ops. Any floating dtype: the CPU computes f16/bf16 in f32.
  // c = alpha * op(a) op(b) + beta * c for 2-D row-major a, b, c (op: transposed or not).
  void (*gemm)(Context&, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
               const Tensor& c, double alpha, double beta);
  // y = conv2d(x, w) (NCHW, OIHW); backward writes grad_x and grad_w where defined.
  void (*conv2d_forward)(Context&, const Tensor& x, const Tensor& w, const Tensor& y,
                         const ConvGeometry& g);
  void (*conv2d_backward)(Context&, const Tensor& x, const Tensor& w, const Tensor& grad_y,
                          const Tensor& grad_x, const Tensor& grad_w, const ConvGeometry& g);
  // The channel-block width (8 or 16, core/channel_blocks.hpp) in which conv2d_forward can
  // write the output of x with this geometry, or 0 where it writes [N, C, H, W] only: the GPU,
  // and the CPU's dtypes and builds without oneDNN.
  std::int64_t (*conv2d_output_block)(Context&, const Tensor& x, const ConvGeometry& g);
  // Batch-norm of x[outer, C, inner] with the batch's statistics: y, the saved mean and invstd,
  // the running statistics updated where defined; with `relu`, y = max(y, 0).
  void (*batch_norm_train_forward)(Context&, const Tensor& x, const Tensor& weight,
                                   const Tensor& bias, const Tensor& running_mean,
                                   const Tensor& running_var, double momentum, double eps,
                                   const Tensor& y, const Tensor& save_mean,
                                   const Tensor& save_invstd, std::int64_t outer,
                                   std::int64_t channels, std::int64_t inner, bool relu);
  // Batch-norm with the given (running) statistics; with `relu`, y = max(y, 0).
  void (*batch_norm_eval_forward)(Context&, const Tensor& x, const Tensor& weight,
                                  const Tensor& bias, const Tensor& mean, const Tensor& var,
                                  double eps, const Tensor& y, std::int64_t outer,
                                  std::int64_t channels, std::int64_t inner, bool relu);
  // The training-mode backward: grad_x (always written), grad_weight and grad_bias. relu_out as
  // in batch_norm_grad_sums: the CPU loops mask grad_y with it as they read it; the CUDA entry
  // takes grad_y masked already (relu_out undefined).
  void (*batch_norm_train_backward)(Context&, const Tensor& x, const Tensor& grad_y,
                                    const Tensor& weight, const Tensor& save_mean,
                                    const Tensor& save_invstd, double eps, const Tensor& grad_x,
                                    const Tensor& grad_weight, const Tensor& grad_bias,
                                    std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                    const Tensor& relu_out);
  // Max-pool of x[N, C, H, W] into y, recording where each output's maximum lies in argmax (y's
  // shape; its dtype is the device's, pool.hpp's max_pool_argmax_dtype; the GPU's may be
  // undefined where no gradient is wanted); the backward reads only that.
  void (*max_pool_forward)(Context&, const Tensor& x, const Tensor& y, const Tensor& argmax,
                           const cpu::PoolGeometry& p);
  void (*max_pool_backward)(Context&, const Tensor& argmax, const Tensor& grad_y,
                            const Tensor& grad_x, const cpu::PoolGeometry& p);
};

// The values of a batch-norm step's f64 statistics tensor (device_table's sums, moments, stats
// and count): contiguous, `n` of them, on the GPU when `on_cuda`, else on the host.
inline double* statistics_data(const Tensor& t, std::int64_t n, bool on_cuda, const char* op) {
  check(t.defined() && t.dtype() == DType::f64 && t.numel() == n && t.is_contiguous() &&
            t.device().is_cuda() == on_cuda,
        op, ": expects a contiguous f64 tensor of ", n, " values on the ", on_cuda ? "GPU" : "CPU");
  return static_cast<double*>(t.data_ptr());
}

// The dtype that sums and statistics are kept in: f32 for half types, else the dtype itself.
constexpr DType accumulator_dtype(DType dtype) {
  return (dtype == DType::f16 || dtype == DType::bf16) ? DType::f32 : dtype;
}

}  // namespace shardkit::autograd
