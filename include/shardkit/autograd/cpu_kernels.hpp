// CPU loops behind the autograd function table (device_table.hpp; the CPU table itself is in
// cpu_kernel_table.hpp): f32 and f64, with sums and statistics accumulated in double; f16/bf16
// tensors compute in f32 (cpu_widen.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "shardkit/autograd/cpu_widen.hpp"
#include "shardkit/autograd/device_table.hpp"
#include "shardkit/autograd/pointwise_math.hpp"
#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/host_scratch.hpp"

namespace shardkit::autograd::cpu {

// Calls fn(T{}) for f32/f64; half types are a GPU compute path.
template <class Fn>
decltype(auto) visit_real(DType dtype, const char* op, Fn&& fn) {
  if (dtype == DType::f32) return fn(float{});
  if (dtype == DType::f64) return fn(double{});
  fail<InvalidArgument>(op, " on the CPU computes in f32 or f64, got ", dtype_name(dtype),
                        "; f16/bf16 compute is a GPU path -- cast to f32 on the CPU");
}

// Element-wise ops, in blocks of kPointwiseBlock elements on the context's thread pool (each
// element is computed alone, so the bits do not depend on the thread count).
constexpr std::int64_t kPointwiseBlock = 16384;

// One block [lo, hi) of an element-wise op. The pointers are this function's own parameters,
// so stores into o[] cannot alias them and GCC vectorises every loop (read through a lambda's
// captures, they were reloaded per element). Each loop loads its operands unconditionally and
// selects: `y[i] > 0 ? x[i] : 0` reads x[i] only on one side, which GCC 12 compiles to a scalar
// loop with a branch per element -- mispredicted half the time on a ReLU's random signs (the
// ReLU backward alone was ~5% of a ResNet-18 step, perf).
template <class T, class Math>
void binary_loop(Math math, T* o, const T* x, const T* y, T al, T be, std::int64_t lo,
                 std::int64_t hi) {
  for (std::int64_t i = lo; i < hi; ++i) o[i] = math(x[i], y[i], al, be);
}
template <class T, class Math>
void unary_loop(Math math, T* o, const T* x, T al, std::int64_t lo, std::int64_t hi) {
  for (std::int64_t i = lo; i < hi; ++i) o[i] = math(x[i], T(0), al, T(0));
}

template <class T>
void pointwise_block(Pointwise op, T* o, const T* x, const T* y, T al, T be, std::int64_t lo,
                     std::int64_t hi) {
  // (y == nullptr: axpby's beta was 0, and y is not read)
  with_pointwise_math(op, y != nullptr, [&](auto math) {
    if constexpr (decltype(math)::kReadsB)
      binary_loop(math, o, x, y, al, be, lo, hi);
    else
      unary_loop(math, o, x, al, lo, hi);
  });
}

inline void pointwise(Context& ctx, Pointwise op, const Tensor& out, const Tensor& a,
                      const Tensor& b, double alpha, double beta) {
  visit_real(out.dtype(), "pointwise op", [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    const T* x = static_cast<const T*>(a.data_ptr());
    const bool reads_b = b.defined() && !(op == Pointwise::axpby && beta == 0);
    const T* y = reads_b ? static_cast<const T*>(b.data_ptr()) : nullptr;
    const std::int64_t n = out.numel();
    const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
    const std::int64_t blocks = (n + kPointwiseBlock - 1) / kPointwiseBlock;
    ctx.cpu_pool().parallel_for(blocks, [=](std::int64_t block) {
      const std::int64_t lo = block * kPointwiseBlock;
      pointwise_block(op, o, x, y, al, be, lo, std::min(n, lo + kPointwiseBlock));
    });
  });
}

inline void channel_sum(Context&, const Tensor& x, const Tensor& out, std::int64_t outer,
                        std::int64_t channels, std::int64_t inner) {
  visit_real(x.dtype(), "channel_sum", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    visit_real(out.dtype(), "channel_sum", [&](auto out_tag) {
      using O = decltype(out_tag);
      O* o = static_cast<O*>(out.data_ptr());
      if (inner == 1) {  // rows of channels (channels-last): the same sums, a row at a time
        HostScratch scratch;
        double* sum = scratch.doubles(static_cast<std::size_t>(channels));
        for (std::int64_t n = 0; n < outer; ++n)
          for (std::int64_t c = 0; c < channels; ++c) sum[c] += in[n * channels + c];
        for (std::int64_t c = 0; c < channels; ++c) o[c] = static_cast<O>(sum[c]);
        return;
      }
      for (std::int64_t c = 0; c < channels; ++c) {
        double sum = 0;
        for (std::int64_t n = 0; n < outer; ++n) {
          const T* row = in + (n * channels + c) * inner;
          for (std::int64_t i = 0; i < inner; ++i) sum += row[i];
        }
        o[c] = static_cast<O>(sum);
      }
    });
  });
}

inline void channel_bias_add(Context&, const Tensor& y, const Tensor& bias, std::int64_t outer,
                             std::int64_t channels, std::int64_t inner) {
  visit_real(y.dtype(), "bias add", [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(y.data_ptr());
    const T* b = static_cast<const T*>(bias.data_ptr());
    for (std::int64_t n = 0; n < outer; ++n)
      for (std::int64_t c = 0; c < channels; ++c) {
        T* row = o + (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) row[i] += b[c];
      }
  });
}

// (rows of `inner` elements on the thread pool, each row's product alone: the bits do not depend
// on the thread count)
inline void channel_scale(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& out,
                          std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  visit_real(x.dtype(), "channel_scale", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* s = static_cast<const T*>(scale.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    const std::int64_t rows = outer * channels;
    if (rows == 0 || inner == 0) return;
    const std::int64_t rows_per_task = std::max<std::int64_t>(1, kPointwiseBlock / inner);
    ctx.cpu_pool().parallel_for((rows + rows_per_task - 1) / rows_per_task, [=](std::int64_t t) {
      for (std::int64_t r = t * rows_per_task; r < std::min(rows, (t + 1) * rows_per_task); ++r)
        unary_loop(ScaleMath{}, o + r * inner, in + r * inner, s[r % channels], 0, inner);
    });
  });
}

inline void softmax_forward(Context&, const Tensor& x, const Tensor& y, std::int64_t rows,
                            std::int64_t cols, bool log) {
  visit_real(x.dtype(), log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = in + r * cols;
      T* yr = out + r * cols;
      const double max = *std::max_element(xr, xr + cols);
      double sum = 0;
      for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(xr[c] - max);
      const double log_sum = std::log(sum);
      for (std::int64_t c = 0; c < cols; ++c)
        yr[c] = static_cast<T>(log ? xr[c] - max - log_sum : std::exp(xr[c] - max) / sum);
    }
  });
}

inline void softmax_backward(Context&, const Tensor& y, const Tensor& grad_y, const Tensor& grad_x,
                             std::int64_t rows, std::int64_t cols, bool log) {
  visit_real(y.dtype(), log ? "log_softmax backward" : "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    const T* out = static_cast<const T*>(y.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t at = r * cols;
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c)
        dot += log ? double(gy[at + c]) : double(gy[at + c]) * out[at + c];
      for (std::int64_t c = 0; c < cols; ++c)
        gx[at + c] = static_cast<T>(log ? gy[at + c] - std::exp(double(out[at + c])) * dot
                                        : out[at + c] * (gy[at + c] - dot));
    }
  });
}

inline void l2_normalize_forward(Context&, const Tensor& x, const Tensor& y, const Tensor& norms,
                                 std::int64_t rows, std::int64_t cols, double eps) {
  visit_real(x.dtype(), "l2_normalize", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    T* nr = static_cast<T*>(norms.data_ptr());
    for (std::int64_t r = 0; r < rows; ++r) {
      double sq = 0;
      for (std::int64_t c = 0; c < cols; ++c) sq += double(in[r * cols + c]) * in[r * cols + c];
      const double norm = std::sqrt(sq);
      nr[r] = static_cast<T>(norm);
      const double denom = std::max(norm, eps);
      for (std::int64_t c = 0; c < cols; ++c)
        out[r * cols + c] = static_cast<T>(in[r * cols + c] / denom);
    }
  });
}

inline void l2_normalize_backward(Context&, const Tensor& y, const Tensor& norms,
                                  const Tensor& grad_y, const Tensor& grad_x, std::int64_t rows,
                                  std::int64_t cols, double eps) {
  visit_real(y.dtype(), "l2_normalize backward", [&](auto tag) {
    using T = decltype(tag);
    const T* out = static_cast<const T*>(y.data_ptr());
    const T* nr = static_cast<const T*>(norms.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t at = r * cols;
      const double norm = nr[r];
      if (norm <= eps) {  // y = x / eps: a plain scaling
        for (std::int64_t c = 0; c < cols; ++c) gx[at + c] = static_cast<T>(gy[at + c] / eps);
        continue;
      }
      double dot = 0;
      for (std::int64_t c = 0; c < cols; ++c) dot += double(gy[at + c]) * out[at + c];
      for (std::int64_t c = 0; c < cols; ++c)
        gx[at + c] = static_cast<T>((gy[at + c] - out[at + c] * dot) / norm);
    }
  });
}

inline void cross_entropy_forward(Context& ctx, const Tensor& x, const Tensor& target,
                                  const Tensor& log_probs, const Tensor& loss, std::int64_t rows,
                                  std::int64_t cols) {
  softmax_forward(ctx, x, log_probs, rows, cols, true);
  visit_real(x.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    const T* lp = static_cast<const T*>(log_probs.data_ptr());
    double total = 0;
    if (target.dtype() == DType::i64) {
      const auto* labels = static_cast<const std::int64_t*>(target.data_ptr());
      for (std::int64_t r = 0; r < rows; ++r) total -= lp[r * cols + labels[r]];
    } else {
      const T* t = static_cast<const T*>(target.data_ptr());
      for (std::int64_t i = 0; i < rows * cols; ++i) total -= double(t[i]) * lp[i];
    }
    *static_cast<T*>(loss.data_ptr()) = static_cast<T>(total / static_cast<double>(rows));
  });
}

inline void cross_entropy_backward(Context&, const Tensor& log_probs, const Tensor& target,
                                   const Tensor& grad_loss, const Tensor& grad_x, std::int64_t rows,
                                   std::int64_t cols) {
  visit_real(log_probs.dtype(), "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    const T* lp = static_cast<const T*>(log_probs.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    const double scale = double(*static_cast<const T*>(grad_loss.data_ptr())) / double(rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t at = r * cols;
      if (target.dtype() == DType::i64) {
        const std::int64_t label = static_cast<const std::int64_t*>(target.data_ptr())[r];
        for (std::int64_t c = 0; c < cols; ++c)
          gx[at + c] =
              static_cast<T>(scale * (std::exp(double(lp[at + c])) - (c == label ? 1.0 : 0.0)));
      } else {
        const T* t = static_cast<const T*>(target.data_ptr()) + at;
        double mass = 0;
        for (std::int64_t c = 0; c < cols; ++c) mass += t[c];
        for (std::int64_t c = 0; c < cols; ++c)
          gx[at + c] = static_cast<T>(scale * (std::exp(double(lp[at + c])) * mass - t[c]));
      }
    }
  });
}

// PyTorch's adaptive pooling window of output index i: [floor(i*in/out), ceil((i+1)*in/out)).
inline std::int64_t adaptive_start(std::int64_t i, std::int64_t in, std::int64_t out) {
  return (i * in) / out;
}
inline std::int64_t adaptive_end(std::int64_t i, std::int64_t in, std::int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

// A channels-last x gives a channels-last y (and a channels-last grad_y a channels-last
// grad_x): an output's C windows are summed side by side, an image per task, each channel's
// values in the order of the NCHW loops below, so the same bits.
inline void adaptive_avg_pool_forward(Context& ctx, const Tensor& x, const Tensor& y) {
  visit_real(x.dtype(), "adaptive_avg_pool2d", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t planes = x.size(0) * x.size(1), H = x.size(2), W = x.size(3);
    const std::int64_t OH = y.size(2), OW = y.size(3);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    if (keeps_channels_last(x)) {
      SK_ASSERT(is_channels_last(y));
      const std::int64_t C = x.size(1);
      ctx.cpu_pool().parallel_for(x.size(0), [&](std::int64_t n) {
        std::vector<double> sums(static_cast<std::size_t>(C));
        for (std::int64_t oh = 0; oh < OH; ++oh)
          for (std::int64_t ow = 0; ow < OW; ++ow) {
            const auto h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
            const auto w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
            std::fill(sums.begin(), sums.end(), 0.0);
            for (auto h = h0; h < h1; ++h)
              for (auto w = w0; w < w1; ++w) {
                const T* at = in + ((n * H + h) * W + w) * C;
                for (std::int64_t c = 0; c < C; ++c) sums[static_cast<std::size_t>(c)] += at[c];
              }
            T* to = out + ((n * OH + oh) * OW + ow) * C;
            const double count = double((h1 - h0) * (w1 - w0));
            for (std::int64_t c = 0; c < C; ++c)
              to[c] = static_cast<T>(sums[static_cast<std::size_t>(c)] / count);
          }
      });
      return;
    }
    for (std::int64_t p = 0; p < planes; ++p)
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          const auto h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
          const auto w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
          double sum = 0;
          for (auto h = h0; h < h1; ++h)
            for (auto w = w0; w < w1; ++w) sum += in[(p * H + h) * W + w];
          out[(p * OH + oh) * OW + ow] = static_cast<T>(sum / double((h1 - h0) * (w1 - w0)));
        }
  });
}

inline void adaptive_avg_pool_backward(Context& ctx, const Tensor& grad_y, const Tensor& grad_x) {
  visit_real(grad_y.dtype(), "adaptive_avg_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t planes = grad_x.size(0) * grad_x.size(1), H = grad_x.size(2),
                       W = grad_x.size(3);
    const std::int64_t OH = grad_y.size(2), OW = grad_y.size(3);
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    std::fill(gx, gx + grad_x.numel(), T(0));
    if (keeps_channels_last(grad_x)) {
      SK_ASSERT(is_channels_last(grad_y));
      const std::int64_t C = grad_x.size(1);
      ctx.cpu_pool().parallel_for(grad_x.size(0), [&](std::int64_t n) {
        std::vector<T> g(static_cast<std::size_t>(C));
        for (std::int64_t oh = 0; oh < OH; ++oh)
          for (std::int64_t ow = 0; ow < OW; ++ow) {
            const auto h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
            const auto w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
            const T* from = gy + ((n * OH + oh) * OW + ow) * C;
            const double count = double((h1 - h0) * (w1 - w0));
            for (std::int64_t c = 0; c < C; ++c)
              g[static_cast<std::size_t>(c)] = static_cast<T>(from[c] / count);
            for (auto h = h0; h < h1; ++h)
              for (auto w = w0; w < w1; ++w) {
                T* at = gx + ((n * H + h) * W + w) * C;
                for (std::int64_t c = 0; c < C; ++c) at[c] += g[static_cast<std::size_t>(c)];
              }
          }
      });
      return;
    }
    for (std::int64_t p = 0; p < planes; ++p)
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          const auto h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
          const auto w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
          const T g = static_cast<T>(gy[(p * OH + oh) * OW + ow] / double((h1 - h0) * (w1 - w0)));
          for (auto h = h0; h < h1; ++h)
            for (auto w = w0; w < w1; ++w) gx[(p * H + h) * W + w] += g;
        }
  });
}

inline void batch_norm_eval_backward(Context&, const Tensor& x, const Tensor& grad_y,
                                     const Tensor& weight, const Tensor& mean, const Tensor& var,
                                     double eps, const Tensor& grad_x, const Tensor& grad_y_xhat,
                                     std::int64_t outer, std::int64_t channels,
                                     std::int64_t inner) {
  visit_real(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* m = static_cast<const T*>(mean.data_ptr());
    const T* v = static_cast<const T*>(var.data_ptr());
    T* gx = grad_x.defined() ? static_cast<T*>(grad_x.data_ptr()) : nullptr;
    T* gxh = static_cast<T*>(grad_y_xhat.data_ptr());
    for (std::int64_t n = 0; n < outer; ++n)
      for (std::int64_t c = 0; c < channels; ++c) {
        const double invstd = 1.0 / std::sqrt(double(v[c]) + eps);
        const std::int64_t at = (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) {
          if (gx) gx[at + i] = static_cast<T>(gy[at + i] * w[c] * invstd);
          gxh[at + i] = static_cast<T>(gy[at + i] * (in[at + i] - m[c]) * invstd);
        }
      }
  });
}

}  // namespace shardkit::autograd::cpu
