// The CPU's autograd function table (device_table.hpp): each entry runs the CPU loops of
// cpu_kernels.hpp and cpu_norm_pool.hpp, or for f32 GEMM and convolution oneDNN when the build
// has it (cpu_dnnl.hpp; Eigen otherwise and for f64), computing f16/bf16 tensors in f32
// (cpu::in_f32) and the others as they are; and kernels_for(), which picks a tensor's table.
#pragma once

#include "shardkit/autograd/device_table.hpp"
#include "shardkit/core/config.hpp"

// Where the table is compiled once, in kernels/shardkit_cpu.cpp (core/config.hpp), it is
// only declared here, and the loops' headers are not read.
#if SK_CPU_TABLES_ELSEWHERE
namespace shardkit::autograd {
inline namespace SK_CPU_KERNELS_ABI {  // (core/config.hpp)
const AutogradKernels& cpu_kernels();
}
}  // namespace shardkit::autograd
#else
#include <vector>

#include "shardkit/autograd/batch_norm_stats.hpp"
#include "shardkit/autograd/cpu_conv.hpp"
#include "shardkit/autograd/cpu_dnnl.hpp"
#include "shardkit/autograd/cpu_kernels.hpp"
#include "shardkit/autograd/cpu_norm_pool.hpp"
#include "shardkit/autograd/cpu_sinkhorn.hpp"

namespace shardkit::autograd {

inline namespace SK_CPU_KERNELS_ABI {

// Each entry computes f16/bf16 tensors in f32 (cpu::in_f32), the others as they are.
SK_CPU_KERNELS_LINKAGE const AutogradKernels& cpu_kernels() {
  using cpu::in_f32;
  static constexpr AutogradKernels kTable{
      .pointwise =
          [](Context& c, Pointwise op, const Tensor& out, const Tensor& a, const Tensor& b,
             double alpha, double beta) {
            in_f32(
                c,
                [&](const auto& o, const auto& x, const auto& y) {
                  cpu::pointwise(c, op, o, x, y, alpha, beta);
                },
                out, a, b);
          },
      .channel_sum =
          [](Context& c, const Tensor& x, const Tensor& out, std::int64_t outer,
             std::int64_t channels, std::int64_t inner) {
            in_f32(
                c,
                [&](const auto& a, const auto& o) {
                  cpu::channel_sum(c, a, o, outer, channels, inner);
                },
                x, out);
          },
      .channel_bias_add =
          [](Context& c, const Tensor& y, const Tensor& bias, std::int64_t outer,
             std::int64_t channels, std::int64_t inner) {
            in_f32(
                c,
                [&](const auto& a, const auto& b) {
                  cpu::channel_bias_add(c, a, b, outer, channels, inner);
                },
                y, bias);
          },
      .channel_scale =
          [](Context& c, const Tensor& x, const Tensor& scale, const Tensor& out,
             std::int64_t outer, std::int64_t channels, std::int64_t inner) {
            in_f32(
                c,
                [&](const auto& a, const auto& s, const auto& o) {
                  cpu::channel_scale(c, a, s, o, outer, channels, inner);
                },
                x, scale, out);
          },
      .softmax_forward =
          [](Context& c, const Tensor& x, const Tensor& y, std::int64_t rows, std::int64_t cols,
             bool log) {
            in_f32(
                c,
                [&](const auto& a, const auto& b) {
                  cpu::softmax_forward(c, a, b, rows, cols, log);
                },
                x, y);
          },
      .softmax_backward =
          [](Context& c, const Tensor& y, const Tensor& gy, const Tensor& gx, std::int64_t rows,
             std::int64_t cols, bool log) {
            in_f32(
                c,
                [&](const auto& a, const auto& b, const auto& d) {
                  cpu::softmax_backward(c, a, b, d, rows, cols, log);
                },
                y, gy, gx);
          },
      .l2_normalize_forward =
          [](Context& c, const Tensor& x, const Tensor& y, const Tensor& norms, std::int64_t rows,
             std::int64_t cols, double eps) {
            in_f32(
                c,
                [&](const auto& a, const auto& b, const auto& n) {
                  cpu::l2_normalize_forward(c, a, b, n, rows, cols, eps);
                },
                x, y, norms);
          },
      .l2_normalize_backward =
          [](Context& c, const Tensor& y, const Tensor& norms, const Tensor& gy, const Tensor& gx,
             std::int64_t rows, std::int64_t cols, double eps) {
            in_f32(
                c,
                [&](const auto& a, const auto& n, const auto& b, const auto& d) {
                  cpu::l2_normalize_backward(c, a, n, b, d, rows, cols, eps);
                },
                y, norms, gy, gx);
          },
      .cross_entropy_forward =
          [](Context& c, const Tensor& x, const Tensor& target, const Tensor& log_probs,
             const Tensor& loss, std::int64_t rows, std::int64_t cols) {
            in_f32(
                c,
                [&](const auto& a, const auto& t, const auto& l, const auto& s) {
                  cpu::cross_entropy_forward(c, a, t, l, s, rows, cols);
                },
                x, target, log_probs, loss);
          },
      .cross_entropy_backward =
          [](Context& c, const Tensor& log_probs, const Tensor& target, const Tensor& grad_loss,
             const Tensor& gx, std::int64_t rows, std::int64_t cols) {
            in_f32(
                c,
                [&](const auto& l, const auto& t, const auto& g, const auto& d) {
                  cpu::cross_entropy_backward(c, l, t, g, d, rows, cols);
                },
                log_probs, target, grad_loss, gx);
          },
      .adaptive_avg_pool_forward =
          [](Context& c, const Tensor& x, const Tensor& y) {
            in_f32(
                c, [&](const auto& a, const auto& b) { cpu::adaptive_avg_pool_forward(c, a, b); },
                x, y);
          },
      .adaptive_avg_pool_backward =
          [](Context& c, const Tensor& gy, const Tensor& gx) {
            in_f32(
                c, [&](const auto& a, const auto& b) { cpu::adaptive_avg_pool_backward(c, a, b); },
                gy, gx);
          },
      .batch_norm_eval_backward =
          [](Context& c, const Tensor& x, const Tensor& gy, const Tensor& weight,
             const Tensor& mean, const Tensor& var, double eps, const Tensor& gx,
             const Tensor& g_xhat, std::int64_t outer, std::int64_t channels, std::int64_t inner) {
            in_f32(
                c,
                [&](const auto& a, const auto& b, const auto& w, const auto& m, const auto& v,
                    const auto& d, const auto& h) {
                  cpu::batch_norm_eval_backward(c, a, b, w, m, v, eps, d, h, outer, channels,
                                                inner);
                },
                x, gy, weight, mean, var, gx, g_xhat);
          },
      .batch_norm_moments =
          [](Context& c, const Tensor& x, const Tensor& moments, std::int64_t outer,
             std::int64_t channels, std::int64_t inner) {
            double* m = statistics_data(moments, 1 + 2 * channels, false, "batch_norm_moments");
            m[0] = double(outer * inner);
            in_f32(
                c,
                [&](const auto& a) {
                  cpu::channel_moments(c.cpu_pool(), a, outer, channels, inner, m + 1,
                                       m + 1 + channels);
                },
                x);
          },
      .batch_norm_group_stats =
          [](Context&, const Tensor& gathered, int members, std::int64_t channels, double momentum,
             double eps, const Tensor& running_mean, const Tensor& running_var, const Tensor& stats,
             const Tensor& save_mean, const Tensor& save_invstd, const Tensor& count) {
            const std::int64_t stride = 1 + 2 * channels;
            const double* all =
                statistics_data(gathered, members * stride, false, "batch_norm_group_stats");
            double* out = statistics_data(stats, 2 * channels, false, "batch_norm_group_stats");
            cpu::visit_real(save_mean.dtype(), "batch_norm", [&](auto tag) {
              using S = decltype(tag);
              S* rm = running_mean.defined() ? static_cast<S*>(running_mean.data_ptr()) : nullptr;
              S* rv = running_mean.defined() ? static_cast<S*>(running_var.data_ptr()) : nullptr;
              for (std::int64_t ch = 0; ch < channels; ++ch) {
                ChannelMoments m;
                for (int r = 0; r < members; ++r) {
                  const double* theirs = all + r * stride;
                  fold_moments(m, theirs[0], theirs[1 + ch], theirs[1 + channels + ch]);
                }
                store_batch_stats(m, momentum, eps, ch, channels, out,
                                  static_cast<S*>(save_mean.data_ptr()),
                                  static_cast<S*>(save_invstd.data_ptr()), rm, rv);
                if (ch == 0) *statistics_data(count, 1, false, "batch_norm_group_stats") = m.count;
              }
            });
          },
      .batch_norm_apply =
          [](Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias,
             const Tensor& stats, const Tensor& y, std::int64_t outer, std::int64_t channels,
             std::int64_t inner, bool relu) {
            const double* s = statistics_data(stats, 2 * channels, false, "batch_norm_apply");
            in_f32(
                c,
                [&](const auto& a, const auto& b) {
                  cpu::batch_norm_affine(c.cpu_pool(), a, weight, bias, s, b, outer, channels,
                                         inner, relu);
                },
                x, y);
          },
      .batch_norm_grad_sums =
          [](Context& c, const Tensor& x, const Tensor& gy, const Tensor& save_mean,
             const Tensor& save_invstd, const Tensor& relu_out, const Tensor& sums,
             std::int64_t outer, std::int64_t channels, std::int64_t inner) {
            double* s = statistics_data(sums, 2 * channels, false, "batch_norm_grad_sums");
            in_f32(
                c,
                [&](const auto& a, const auto& b, const auto& r) {
                  cpu::batch_norm_grad_sums(c.cpu_pool(), a, b, save_mean, save_invstd, outer,
                                            channels, inner, s, s + channels, r);
                },
                x, gy, relu_out);
          },
      .batch_norm_input_grad =
          [](Context& c, const Tensor& x, const Tensor& gy, const Tensor& weight,
             const Tensor& save_mean, const Tensor& save_invstd, const Tensor& relu_out,
             const Tensor& sums, const Tensor& count, const Tensor& gx, std::int64_t outer,
             std::int64_t channels, std::int64_t inner) {
            const double* s = statistics_data(sums, 2 * channels, false, "batch_norm_input_grad");
            const double n = *statistics_data(count, 1, false, "batch_norm_input_grad");
            in_f32(
                c,
                [&](const auto& a, const auto& b, const auto& r, const auto& d) {
                  cpu::batch_norm_input_grad(c.cpu_pool(), a, b, weight, save_mean, save_invstd, d,
                                             outer, channels, inner, n, s, s + channels, r);
                },
                x, gy, relu_out, gx);
          },
      .sinkhorn_scale = [](Context&, const Tensor& scores, const Tensor& q, const Tensor& largest,
                           double epsilon) { cpu::sinkhorn_scale(scores, q, largest, epsilon); },
      .sinkhorn_exp = [](Context&, const Tensor& q, const Tensor& shift,
                         const Tensor& total) { cpu::sinkhorn_exp(q, shift, total); },
      .sinkhorn_column_sums =
          [](Context&, const Tensor& q, const Tensor& divisor, const Tensor& zero_in,
             const Tensor& u, std::int64_t rows,
             std::int64_t cols) { cpu::sinkhorn_column_sums(q, divisor, zero_in, u, rows, cols); },
      .sinkhorn_scale_rows =
          [](Context&, const Tensor& q, const Tensor& u, const Tensor& u_again, const Tensor& v,
             std::int64_t rows, std::int64_t cols, std::int64_t global_rows) {
            cpu::sinkhorn_scale_rows(q, u, u_again, v, rows, cols, global_rows);
          },
      .sinkhorn_codes = [](Context&, const Tensor& q, const Tensor& codes, std::int64_t code_rows,
                           std::int64_t cols,
                           bool hard) { cpu::sinkhorn_codes(q, codes, code_rows, cols, hard); },
      .gemm =
          [](Context& c, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
             const Tensor& out, double alpha, double beta) {
            in_f32(
                c,
                [&](const Tensor& x, const Tensor& y, const Tensor& z) {
#if SK_WITH_DNNL
                  if (z.dtype() == DType::f32)
                    return cpu::dnnl::sgemm(c, x, transpose_a, y, transpose_b, z, alpha, beta);
#endif
                  cpu::gemm(x, transpose_a, y, transpose_b, z, alpha, beta);
                },
                a, b, out);
          },
      .conv2d_forward =
          [](Context& c, const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeometry& g) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b, const Tensor& d) {
#if SK_WITH_DNNL
                  if (a.dtype() == DType::f32)
                    return cpu::dnnl::convolutions(c).forward(c, a, b, d, g);
#endif
                  cpu::conv2d_forward_any_layout(c, a, b, d, g);
                },
                x, w, y);
          },
      .conv2d_backward =
          [](Context& c, const Tensor& x, const Tensor& w, const Tensor& gy, const Tensor& gx,
             const Tensor& gw, const ConvGeometry& g) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& e,
                    const Tensor& f) {
#if SK_WITH_DNNL
                  if (a.dtype() == DType::f32)
                    return cpu::dnnl::convolutions(c).backward(c, a, b, d, e, f, g);
#endif
                  cpu::conv2d_backward_any_layout(c, a, b, d, e, f, g);
                },
                x, w, gy, gx, gw);
          },
      .conv2d_output_block = [](Context& c, const Tensor& x,
                                const ConvGeometry& g) -> std::int64_t {
#if SK_WITH_DNNL
        if (x.dtype() == DType::f32) return cpu::dnnl::convolutions(c).output_block(c, x, g);
#endif
        (void)c, (void)x, (void)g;
        return 0;
      },
      .batch_norm_train_forward =
          [](Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias,
             const Tensor& running_mean, const Tensor& running_var, double momentum, double eps,
             const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
             std::int64_t outer, std::int64_t channels, std::int64_t inner, bool relu) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b) {
                  cpu::batch_norm_train_forward(c.cpu_pool(), a, weight, bias, running_mean,
                                                running_var, momentum, eps, b, save_mean,
                                                save_invstd, outer, channels, inner, relu);
                },
                x, y);
          },
      .batch_norm_eval_forward =
          [](Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias,
             const Tensor& mean, const Tensor& var, double eps, const Tensor& y, std::int64_t outer,
             std::int64_t channels, std::int64_t inner, bool relu) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b) {
                  cpu::batch_norm_eval_forward(c.cpu_pool(), a, weight, bias, mean, var, eps, b,
                                               outer, channels, inner, relu);
                },
                x, y);
          },
      .batch_norm_train_backward =
          [](Context& c, const Tensor& x, const Tensor& gy,
             const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd, double,
             const Tensor& gx, const Tensor& gw, const Tensor& gb, std::int64_t outer,
             std::int64_t channels, std::int64_t inner, const Tensor& relu_out) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& r) {
                  cpu::batch_norm_train_backward(c.cpu_pool(), a, b, weight, save_mean, save_invstd,
                                                 d, gw, gb, outer, channels, inner, r);
                },
                x, gy, gx, relu_out);
          },
      .max_pool_forward =
          [](Context& c, const Tensor& x, const Tensor& y, const Tensor& argmax,
             const cpu::PoolGeometry& p) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b) {
                  cpu::max_pool_forward(c.cpu_pool(), a, b, argmax, p);
                },
                x, y);
          },
      .max_pool_backward =
          [](Context& c, const Tensor& argmax, const Tensor& gy, const Tensor& gx,
             const cpu::PoolGeometry&) {
            in_f32(
                c,
                [&](const Tensor& a, const Tensor& b) {
                  cpu::max_pool_backward(c.cpu_pool(), a, argmax, b);
                },
                gy, gx);
          }};
  return kTable;
}

}  // namespace SK_CPU_KERNELS_ABI
}  // namespace shardkit::autograd
#endif

namespace shardkit::autograd {

inline const AutogradKernels& kernels_for(Context& ctx, const Tensor& t) {
  if (t.device().is_cpu()) return cpu_kernels();
  const AutogradKernels* table = ctx.kernel_tables().autograd;
  check<NotAvailable>(table != nullptr, "autograd on ", t.device(),
                      " needs its CUDA kernels: create the context with sk::make_cuda_context "
                      "(or sk::cuda_context_options) from <shardkit/cuda.hpp>");
  return *table;
}

}  // namespace shardkit::autograd
