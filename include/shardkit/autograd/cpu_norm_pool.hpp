// CPU batch-norm (training statistics and evaluation) and max-pooling, f32 and f64, with
// statistics accumulated in double.
#pragma once

#include <algorithm>
#include <bit>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "shardkit/autograd/batch_norm_stats.hpp"
#include "shardkit/autograd/cpu_kernels.hpp"
#include "shardkit/autograd/geometry.hpp"
#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/host_scratch.hpp"
#include "shardkit/core/thread_pool.hpp"

namespace shardkit::autograd::cpu {

// Batch-norm in training mode, in pieces a synchronised batch-norm reuses across ranks: the
// per-channel moments, the per-channel affine map, the gradient sums and the input gradient.
// All statistics are double; x and y are f32 or f64.
//
// Each piece runs on the context's thread pool: the sums give each thread a contiguous block of
// channels, the element-wise passes one (n, c) plane per task. A channel's sums are made by one
// thread in a fixed order (row n = 0, 1, ... of the channel, each row's own lane sum added in
// turn), so the bits do not depend on the thread count. Sums run over eight independent double
// lanes (combined pairwise at the end) so the compiler can vectorise them; a single running sum
// would be one dependent add chain.

// sum over i < n of f(i), in eight lanes of doubles.
template <class F>
inline double lane_sum(std::int64_t n, F&& f) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += f(i + j);
  double tail = 0;
  for (; i < n; ++i) tail += f(i);
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) +
         tail;
}

// Channel blocks (core/channel_blocks.hpp): x seen as [outer, channels, inner] may be held as
// [outer, channels / b, inner, b] -- element (n, c, i) at ((n * channels / b + c / b) * inner
// + i) * b + c % b. The loops below then take each block of b channels together, vectorised
// across them, and make every channel's sums with the very additions, in the very order, that
// lane_sum makes over its row of an NCHW tensor (rows_by_channel_block walks the blocks as its
// channels: each thread a range of blocks, n in order): sums of values are equal bit for bit; a sum
// of products can differ in its last bit where GCC contracts a multiply and an add into an FMA in
// one loop and not in the other (it decides per loop as it vectorises; the NCHW tail loop is
// partly contracted), which f32 results almost never show.

// The channel-block width of x seen as [outer, channels, inner]: b for a 5-D [N, C/b, H, W, b]
// tensor, else 1 (a 5-D [N, C, D, H, W] batch-norm input has x.size(1) == channels).
inline std::int64_t channel_block_of(const Tensor& x, std::int64_t channels) {
  return x.dim() == 5 && x.size(1) * x.size(4) == channels ? x.size(4) : 1;
}

// Calls body(std::integral_constant<int, b>) for a block width b of 8 or 16.
template <class Body>
inline void with_block_width(std::int64_t b, Body&& body) {
  if (b == 8) {
    body(std::integral_constant<int, 8>{});
    return;
  }
  SK_ASSERT(b == 16);
  body(std::integral_constant<int, 16>{});
}

// out[k] = lane_sum(inner, [&](i) { return f(i, k); }) for each channel k < B of one block's
// plane, all B channels in one sweep (lane_sum's lanes, tail and final pairing per channel).
template <int B, class F>
inline void block_lane_sums(std::int64_t inner, F&& f, double* out) {
  double lane[8][B] = {};
  double tail[B] = {};
  std::int64_t i = 0;
  for (; i + 8 <= inner; i += 8)
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < B; ++k) lane[j][k] += f(i + j, k);
  for (; i < inner; ++i)
    for (int k = 0; k < B; ++k) tail[k] += f(i, k);
  for (int k = 0; k < B; ++k)
    out[k] = ((lane[0][k] + lane[4][k]) + (lane[1][k] + lane[5][k])) +
             ((lane[2][k] + lane[6][k]) + (lane[3][k] + lane[7][k])) + tail[k];
}

// Calls row(n, c) for every row (n, c) of an [outer, channels, inner] tensor, each thread of
// the pool taking a contiguous block of channels and walking its rows in memory order (n outer,
// c inner): each channel's rows come in order of n, from one thread, and each thread streams
// through memory instead of striding across it a row per channel at a time.
template <class Row>
inline void rows_by_channel_block(ThreadPool& pool, std::int64_t outer, std::int64_t channels,
                                  Row&& row) {
  const std::int64_t blocks = std::min<std::int64_t>(pool.size(), channels);
  pool.parallel_for(blocks, [&](std::int64_t b) {
    const std::int64_t lo = channels * b / blocks, hi = channels * (b + 1) / blocks;
    for (std::int64_t n = 0; n < outer; ++n)
      for (std::int64_t c = lo; c < hi; ++c) row(n, c);
  });
}

// Tensors with one value per (row, channel) -- inner == 1: a channels-last [N, C, H, W] tensor
// seen as [N*H*W, C, 1], or a [N, C] batch -- run as rows of channels: each thread takes a
// block of channels, as rows_by_channel_block, and sweeps the rows over it, so the loops
// vectorise across the channels. A channel's sums are the same additions in the same order as
// the per-row lane sums above make for inner == 1 (each row's term, rounded, added to the
// running sum), which needs the product in a term rounded before it is added: FMA contraction
// is off in these loops (SK_NO_FP_CONTRACT), as it cannot happen across lane_sum's tail.
template <class Rows>
inline void channel_block_rows(ThreadPool& pool, std::int64_t channels, Rows&& rows) {
  const std::int64_t blocks = std::min<std::int64_t>(pool.size(), channels);
  pool.parallel_for(
      blocks, [&](std::int64_t b) { rows(channels * b / blocks, channels * (b + 1) / blocks); });
}

// Element-wise passes over rows of channels: blocks of rows per task. (Their expressions are
// the plane loops' own, element for element, so FMA contraction treats both alike.)
template <class Row>
inline void row_blocks(ThreadPool& pool, std::int64_t rows, Row&& row) {
  constexpr std::int64_t kRowsPerTask = 256;
  pool.parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](std::int64_t t) {
    const std::int64_t hi = std::min(rows, (t + 1) * kRowsPerTask);
    for (std::int64_t n = t * kRowsPerTask; n < hi; ++n) row(n);
  });
}

#if defined(__clang__)
#define SK_NO_FP_CONTRACT _Pragma("clang fp contract(off)")
#define SK_NO_FP_CONTRACT_FN
#elif defined(__GNUC__)
#define SK_NO_FP_CONTRACT
#define SK_NO_FP_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#else
#define SK_NO_FP_CONTRACT
#define SK_NO_FP_CONTRACT_FN
#endif

template <class T>
SK_NO_FP_CONTRACT_FN void row_channel_sums(const T* in, std::int64_t outer, std::int64_t channels,
                                           std::int64_t lo, std::int64_t hi, double* sum) {
  SK_NO_FP_CONTRACT
  for (std::int64_t n = 0; n < outer; ++n) {
    const T* row = in + n * channels;
    for (std::int64_t c = lo; c < hi; ++c) sum[c] += double(row[c]);
  }
}

template <class T>
SK_NO_FP_CONTRACT_FN void row_channel_squares(const T* in, std::int64_t outer,
                                              std::int64_t channels, std::int64_t lo,
                                              std::int64_t hi, const double* mean, double* m2) {
  SK_NO_FP_CONTRACT
  for (std::int64_t n = 0; n < outer; ++n) {
    const T* row = in + n * channels;
    for (std::int64_t c = lo; c < hi; ++c) {
      const double d = double(row[c]) - mean[c];
      m2[c] += d * d;
    }
  }
}

// mean[c] and m2[c] (the sum of squared deviations from the mean) of each channel over
// (outer, inner), in two passes.
inline void channel_moments(ThreadPool& pool, const Tensor& x, std::int64_t outer,
                            std::int64_t channels, std::int64_t inner, double* mean, double* m2) {
  visit_real(x.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const double count = double(outer * inner);
    std::fill(mean, mean + channels, 0.0);
    std::fill(m2, m2 + channels, 0.0);
    if (const std::int64_t b = channel_block_of(x, channels); b > 1) {
      with_block_width(b, [&](auto width) {
        constexpr int B = decltype(width)::value;
        const std::int64_t blocks = channels / B;
        rows_by_channel_block(pool, outer, blocks, [&](std::int64_t n, std::int64_t cb) {
          const T* plane = in + (n * blocks + cb) * inner * B;
          double sum[B];
          block_lane_sums<B>(
              inner, [&](std::int64_t i, int k) { return double(plane[i * B + k]); }, sum);
          for (int k = 0; k < B; ++k) mean[cb * B + k] += sum[k];
        });
        for (std::int64_t c = 0; c < channels; ++c) mean[c] /= count;
        rows_by_channel_block(pool, outer, blocks, [&](std::int64_t n, std::int64_t cb) {
          const T* plane = in + (n * blocks + cb) * inner * B;
          const double* mu = mean + cb * B;
          double sum[B];
          block_lane_sums<B>(
              inner,
              [&](std::int64_t i, int k) {
                const double d = double(plane[i * B + k]) - mu[k];
                return d * d;
              },
              sum);
          for (int k = 0; k < B; ++k) m2[cb * B + k] += sum[k];
        });
      });
      return;
    }
    if (inner == 1) {
      channel_block_rows(pool, channels, [&](std::int64_t lo, std::int64_t hi) {
        row_channel_sums(in, outer, channels, lo, hi, mean);
      });
      for (std::int64_t c = 0; c < channels; ++c) mean[c] /= count;
      channel_block_rows(pool, channels, [&](std::int64_t lo, std::int64_t hi) {
        row_channel_squares(in, outer, channels, lo, hi, mean, m2);
      });
      return;
    }
    rows_by_channel_block(pool, outer, channels, [&](std::int64_t n, std::int64_t c) {
      const T* row = in + (n * channels + c) * inner;
      mean[c] += lane_sum(inner, [row](std::int64_t i) { return double(row[i]); });
    });
    for (std::int64_t c = 0; c < channels; ++c) mean[c] /= count;
    rows_by_channel_block(pool, outer, channels, [&](std::int64_t n, std::int64_t c) {
      const T* row = in + (n * channels + c) * inner;
      const double mu = mean[c];
      m2[c] += lane_sum(inner, [row, mu](std::int64_t i) {
        const double d = double(row[i]) - mu;
        return d * d;
      });
    });
  });
}

// y[o, c, i] = x[o, c, i] * scale[c] + shift[c]; with `relu`, then max(y, 0) in the same pass
// (the ReLU's own rule: y <= 0 ? 0 : y, on the rounded value; a NaN stays).
inline void channel_affine(ThreadPool& pool, const Tensor& x, const Tensor& y, const double* scale,
                           const double* shift, std::int64_t outer, std::int64_t channels,
                           std::int64_t inner, bool relu = false) {
  visit_real(x.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    if (const std::int64_t block = channel_block_of(x, channels); block > 1) {
      with_block_width(block, [&](auto width) {  // (each element's expression as below)
        constexpr int B = decltype(width)::value;
        const std::int64_t blocks = channels / B;
        pool.parallel_for(outer * blocks, [&](std::int64_t plane) {
          const std::int64_t c0 = plane % blocks * B, at = plane * inner * B;
          const double* a = scale + c0;
          const double* b = shift + c0;
          const T* src = in + at;
          T* dst = out + at;
          if (relu) {
            for (std::int64_t i = 0; i < inner * B; i += B)
              for (int k = 0; k < B; ++k) {
                const T v = static_cast<T>(src[i + k] * a[k] + b[k]);
                dst[i + k] = v <= T(0) ? T(0) : v;
              }
          } else {
            for (std::int64_t i = 0; i < inner * B; i += B)
              for (int k = 0; k < B; ++k) dst[i + k] = static_cast<T>(src[i + k] * a[k] + b[k]);
          }
        });
      });
      return;
    }
    if (inner == 1) {
      row_blocks(pool, outer, [&](std::int64_t n) {
        const T* src = in + n * channels;
        T* dst = out + n * channels;
        if (relu) {
          for (std::int64_t c = 0; c < channels; ++c) {
            const T v = static_cast<T>(src[c] * scale[c] + shift[c]);
            dst[c] = v <= T(0) ? T(0) : v;
          }
        } else {
          for (std::int64_t c = 0; c < channels; ++c)
            dst[c] = static_cast<T>(src[c] * scale[c] + shift[c]);
        }
      });
      return;
    }
    pool.parallel_for(outer * channels, [&](std::int64_t plane) {
      const std::int64_t c = plane % channels, at = plane * inner;
      const double a = scale[c], b = shift[c];
      const T* src = in + at;
      T* dst = out + at;
      if (relu) {
        for (std::int64_t i = 0; i < inner; ++i) {
          const T v = static_cast<T>(src[i] * a + b);
          dst[i] = v <= T(0) ? T(0) : v;
        }
      } else {
        for (std::int64_t i = 0; i < inner; ++i) dst[i] = static_cast<T>(src[i] * a + b);
      }
    });
  });
}

// y = (x - mean) * invstd * weight + bias per channel, from stats = {mean[C], invstd[C]}
// (double); with `relu`, then max(y, 0) in the same pass.
inline void batch_norm_affine(ThreadPool& pool, const Tensor& x, const Tensor& weight,
                              const Tensor& bias, const double* stats, const Tensor& y,
                              std::int64_t outer, std::int64_t channels, std::int64_t inner,
                              bool relu = false) {
  HostScratch scratch;
  double* scale = scratch.doubles(static_cast<std::size_t>(channels));
  double* shift = scratch.doubles(static_cast<std::size_t>(channels));
  visit_real(weight.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* b = static_cast<const T*>(bias.data_ptr());
    for (std::int64_t c = 0; c < channels; ++c) {
      const auto at = static_cast<std::size_t>(c);
      scale[at] = w[c] * stats[channels + c];
      shift[at] = b[c] - stats[c] * scale[at];
    }
  });
  channel_affine(pool, x, y, scale, shift, outer, channels, inner, relu);
}

// Normalises x with the given statistics of each channel (count values per channel), saves mean
// and 1/sqrt(var + eps) in the statistics dtype, and (when running_mean is defined) folds them
// into the running statistics (store_batch_stats).
inline void batch_norm_normalize(ThreadPool& pool, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps,
                                 const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, std::int64_t outer,
                                 std::int64_t channels, std::int64_t inner, double count,
                                 const double* mean, const double* m2, bool relu = false) {
  HostScratch scratch;
  double* stats = scratch.doubles(2 * static_cast<std::size_t>(channels));
  visit_real(save_mean.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    T* rm = running_mean.defined() ? static_cast<T*>(running_mean.data_ptr()) : nullptr;
    T* rv = running_mean.defined() ? static_cast<T*>(running_var.data_ptr()) : nullptr;
    for (std::int64_t c = 0; c < channels; ++c)
      store_batch_stats(ChannelMoments{count, mean[c], m2[c]}, momentum, eps, c, channels, stats,
                        static_cast<T*>(save_mean.data_ptr()),
                        static_cast<T*>(save_invstd.data_ptr()), rm, rv);
  });
  batch_norm_affine(pool, x, weight, bias, stats, y, outer, channels, inner, relu);
}

// Training: normalises with the batch statistics of each channel over (outer, inner).
inline void batch_norm_train_forward(ThreadPool& pool, const Tensor& x, const Tensor& weight,
                                     const Tensor& bias, const Tensor& running_mean,
                                     const Tensor& running_var, double momentum, double eps,
                                     const Tensor& y, const Tensor& save_mean,
                                     const Tensor& save_invstd, std::int64_t outer,
                                     std::int64_t channels, std::int64_t inner, bool relu = false) {
  HostScratch scratch;
  double* mean = scratch.doubles(static_cast<std::size_t>(channels));
  double* m2 = scratch.doubles(static_cast<std::size_t>(channels));
  channel_moments(pool, x, outer, channels, inner, mean, m2);
  batch_norm_normalize(pool, x, weight, bias, running_mean, running_var, momentum, eps, y,
                       save_mean, save_invstd, outer, channels, inner, double(outer * inner), mean,
                       m2, relu);
}

inline void batch_norm_eval_forward(ThreadPool& pool, const Tensor& x, const Tensor& weight,
                                    const Tensor& bias, const Tensor& mean, const Tensor& var,
                                    double eps, const Tensor& y, std::int64_t outer,
                                    std::int64_t channels, std::int64_t inner, bool relu = false) {
  HostScratch scratch;
  double* scale = scratch.doubles(static_cast<std::size_t>(channels));
  double* shift = scratch.doubles(static_cast<std::size_t>(channels));
  visit_real(x.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* b = static_cast<const T*>(bias.data_ptr());
    const T* m = static_cast<const T*>(mean.data_ptr());
    const T* v = static_cast<const T*>(var.data_ptr());
    for (std::int64_t c = 0; c < channels; ++c) {
      scale[static_cast<std::size_t>(c)] = w[c] / std::sqrt(double(v[c]) + eps);
      shift[static_cast<std::size_t>(c)] = b[c] - m[c] * scale[static_cast<std::size_t>(c)];
    }
  });
  channel_affine(pool, x, y, scale, shift, outer, channels, inner, relu);
}

// The gradient a fused ReLU passes back, element i of a plane: +0 where the ReLU's output y is
// <= 0, else g -- a NaN y passes it, as PyTorch's threshold_backward does (the ReLU backward's
// own rule, also for an infinite or NaN g). A select by
// bit mask, not `?:`: GCC 12 at -O3 -march=x86-64-v3 vectorised the conditional form wrongly
// in batch_norm_grad_sums' f64 lane sums (per-channel sums off by up to 85%; right at -O1 or
// without -march), which the fused-ReLU tests caught.
template <class T>
inline double relu_masked(const T* g, const T* y, std::int64_t i) {
  const std::uint64_t keep = y[i] <= T(0) ? std::uint64_t{0} : ~std::uint64_t{0};
  return std::bit_cast<double>(std::bit_cast<std::uint64_t>(double(g[i])) & keep);
}

// batch_norm_grad_sums' unscaled sums over rows of channels (inner == 1; see
// channel_block_rows): g masked by a fused ReLU's output `y` when given.
template <class T>
SK_NO_FP_CONTRACT_FN void row_grad_sums(const T* in, const T* gy, const T* out, const T* sm,
                                        std::int64_t outer, std::int64_t channels, std::int64_t lo,
                                        std::int64_t hi, double* sum_g, double* sum_gx) {
  SK_NO_FP_CONTRACT
  for (std::int64_t n = 0; n < outer; ++n) {
    const std::int64_t at = n * channels;
    const T* g = gy + at;
    const T* v = in + at;
    if (out == nullptr) {
      for (std::int64_t c = lo; c < hi; ++c) {
        sum_g[c] += double(g[c]);
        sum_gx[c] += double(g[c]) * (double(v[c]) - double(sm[c]));
      }
    } else {
      const T* y = out + at;
      for (std::int64_t c = lo; c < hi; ++c) {
        const double masked = relu_masked(g, y, c);
        sum_g[c] += masked;
        sum_gx[c] += masked * (double(v[c]) - double(sm[c]));
      }
    }
  }
}

// The sums training-mode backward needs, per channel: sum_g = sum(g) and
// sum_gxhat = sum(g * (x - mean)) * invstd, with the saved statistics. With `relu_out` (the
// output of a fused ReLU), g is first masked as the ReLU's backward would.
inline void batch_norm_grad_sums(ThreadPool& pool, const Tensor& x, const Tensor& grad_y,
                                 const Tensor& save_mean, const Tensor& save_invstd,
                                 std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                 double* sum_g, double* sum_gxhat, const Tensor& relu_out = {}) {
  visit_real(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const T* out = relu_out.defined() ? static_cast<const T*>(relu_out.data_ptr()) : nullptr;
    const T* sm = static_cast<const T*>(save_mean.data_ptr());
    const T* si = static_cast<const T*>(save_invstd.data_ptr());
    std::fill(sum_g, sum_g + channels, 0.0);
    std::fill(sum_gxhat, sum_gxhat + channels, 0.0);  // sum(g * (x - mean)) until scaled below
    if (const std::int64_t b = channel_block_of(x, channels); b > 1) {
      with_block_width(b, [&](auto width) {
        constexpr int B = decltype(width)::value;
        const std::int64_t blocks = channels / B;
        rows_by_channel_block(pool, outer, blocks, [&](std::int64_t n, std::int64_t cb) {
          const std::int64_t at = (n * blocks + cb) * inner * B;
          const T* g = gy + at;
          const T* v = in + at;
          const T* y = out != nullptr ? out + at : nullptr;
          double mean[B];
          for (int k = 0; k < B; ++k) mean[k] = sm[cb * B + k];
          double sg[B], sgx[B];
          if (y == nullptr) {
            block_lane_sums<B>(
                inner, [&](std::int64_t i, int k) { return double(g[i * B + k]); }, sg);
            block_lane_sums<B>(
                inner,
                [&](std::int64_t i, int k) {
                  return double(g[i * B + k]) * (double(v[i * B + k]) - mean[k]);
                },
                sgx);
          } else {
            block_lane_sums<B>(
                inner, [&](std::int64_t i, int k) { return relu_masked(g, y, i * B + k); }, sg);
            block_lane_sums<B>(
                inner,
                [&](std::int64_t i, int k) {
                  return relu_masked(g, y, i * B + k) * (double(v[i * B + k]) - mean[k]);
                },
                sgx);
          }
          for (int k = 0; k < B; ++k) {
            sum_g[cb * B + k] += sg[k];
            sum_gxhat[cb * B + k] += sgx[k];
          }
        });
      });
      for (std::int64_t c = 0; c < channels; ++c) sum_gxhat[c] *= double(si[c]);
      return;
    }
    if (inner == 1) {
      channel_block_rows(pool, channels, [&](std::int64_t lo, std::int64_t hi) {
        row_grad_sums(in, gy, out, sm, outer, channels, lo, hi, sum_g, sum_gxhat);
      });
      for (std::int64_t c = 0; c < channels; ++c) sum_gxhat[c] *= double(si[c]);
      return;
    }
    rows_by_channel_block(pool, outer, channels, [&](std::int64_t n, std::int64_t c) {
      const std::int64_t at = (n * channels + c) * inner;
      const double mean = sm[c];
      const T* g = gy + at;
      const T* v = in + at;
      double sg, sgx;
      if (out == nullptr) {
        sg = lane_sum(inner, [g](std::int64_t i) { return double(g[i]); });
        sgx = lane_sum(
            inner, [g, v, mean](std::int64_t i) { return double(g[i]) * (double(v[i]) - mean); });
      } else {
        const T* y = out + at;
        sg = lane_sum(inner, [g, y](std::int64_t i) { return relu_masked(g, y, i); });
        sgx = lane_sum(inner, [g, y, v, mean](std::int64_t i) {
          return relu_masked(g, y, i) * (double(v[i]) - mean);
        });
      }
      sum_g[c] += sg;
      sum_gxhat[c] += sgx;
    });
    for (std::int64_t c = 0; c < channels; ++c) sum_gxhat[c] *= double(si[c]);
  });
}

// Training-mode input gradient through the batch statistics of `count` values per channel:
//   grad_x = w * invstd / count * (count * g - sum_g - xhat * sum_gxhat).
inline void batch_norm_input_grad(ThreadPool& pool, const Tensor& x, const Tensor& grad_y,
                                  const Tensor& weight, const Tensor& save_mean,
                                  const Tensor& save_invstd, const Tensor& grad_x,
                                  std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                  double count, const double* sum_g, const double* sum_gxhat,
                                  const Tensor& relu_out = {}) {
  visit_real(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* sm = static_cast<const T*>(save_mean.data_ptr());
    const T* si = static_cast<const T*>(save_invstd.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    const T* relu_y = relu_out.defined() ? static_cast<const T*>(relu_out.data_ptr()) : nullptr;
    // Channel blocks and rows of channels: each channel's factors once (the plane loop's, in
    // the same expressions), then the planes or rows.
    const std::int64_t block = channel_block_of(x, channels);
    HostScratch scratch;
    double *k = nullptr, *mean = nullptr, *invstd = nullptr;
    if (block > 1 || inner == 1) {
      k = scratch.doubles(static_cast<std::size_t>(channels));
      mean = scratch.doubles(static_cast<std::size_t>(channels));
      invstd = scratch.doubles(static_cast<std::size_t>(channels));
      for (std::int64_t c = 0; c < channels; ++c) {
        mean[c] = sm[c];
        invstd[c] = si[c];
        k[c] = w[c] * invstd[c] / count;
      }
    }
    if (block > 1) {
      with_block_width(block, [&](auto width) {
        constexpr int B = decltype(width)::value;
        const std::int64_t blocks = channels / B;
        pool.parallel_for(outer * blocks, [&](std::int64_t plane) {
          const std::int64_t c0 = plane % blocks * B, at = plane * inner * B;
          const double *kc = k + c0, *mc = mean + c0, *ic = invstd + c0;
          const double *sg = sum_g + c0, *sgx = sum_gxhat + c0;
          const T* v = in + at;
          const T* g = gy + at;
          T* o = gx + at;
          if (relu_y == nullptr) {
            for (std::int64_t i = 0; i < inner * B; i += B)
              for (int j = 0; j < B; ++j) {
                const double xhat = (v[i + j] - mc[j]) * ic[j];
                o[i + j] = static_cast<T>(kc[j] * (count * g[i + j] - sg[j] - xhat * sgx[j]));
              }
          } else {
            const T* y = relu_y + at;
            for (std::int64_t i = 0; i < inner * B; i += B)
              for (int j = 0; j < B; ++j) {
                const double xhat = (v[i + j] - mc[j]) * ic[j];
                o[i + j] = static_cast<T>(
                    kc[j] * (count * relu_masked(g, y, i + j) - sg[j] - xhat * sgx[j]));
              }
          }
        });
      });
      return;
    }
    if (inner == 1) {
      row_blocks(pool, outer, [&](std::int64_t n) {
        const std::int64_t at = n * channels;
        const T* v = in + at;
        const T* g = gy + at;
        T* out = gx + at;
        if (relu_y == nullptr) {
          for (std::int64_t c = 0; c < channels; ++c) {
            const double xhat = (v[c] - mean[c]) * invstd[c];
            out[c] = static_cast<T>(k[c] * (count * g[c] - sum_g[c] - xhat * sum_gxhat[c]));
          }
        } else {
          const T* y = relu_y + at;
          for (std::int64_t c = 0; c < channels; ++c) {
            const double xhat = (v[c] - mean[c]) * invstd[c];
            out[c] = static_cast<T>(
                k[c] * (count * relu_masked(g, y, c) - sum_g[c] - xhat * sum_gxhat[c]));
          }
        }
      });
      return;
    }
    pool.parallel_for(outer * channels, [&](std::int64_t plane) {
      const std::int64_t c = plane % channels, at = plane * inner;
      const double mean = sm[c], invstd = si[c];
      const double k = w[c] * invstd / count, sg = sum_g[c], sgx = sum_gxhat[c];
      const T* v = in + at;
      const T* g = gy + at;
      T* out = gx + at;
      if (relu_y == nullptr) {
        for (std::int64_t i = 0; i < inner; ++i) {
          const double xhat = (v[i] - mean) * invstd;
          out[i] = static_cast<T>(k * (count * g[i] - sg - xhat * sgx));
        }
      } else {
        const T* y = relu_y + at;
        for (std::int64_t i = 0; i < inner; ++i) {
          const double xhat = (v[i] - mean) * invstd;
          out[i] = static_cast<T>(k * (count * relu_masked(g, y, i) - sg - xhat * sgx));
        }
      }
    });
  });
}

// grad_weight[c] = sum_gxhat[c], grad_bias[c] = sum_g[c] (either may be undefined).
inline void store_channel_grads(const double* sum_g, const double* sum_gxhat,
                                const Tensor& grad_weight, const Tensor& grad_bias,
                                std::int64_t channels) {
  visit_real(grad_weight.defined() ? grad_weight.dtype() : grad_bias.dtype(), "batch_norm backward",
             [&](auto tag) {
               using T = decltype(tag);
               for (std::int64_t c = 0; c < channels; ++c) {
                 if (grad_weight.defined())
                   static_cast<T*>(grad_weight.data_ptr())[c] = static_cast<T>(sum_gxhat[c]);
                 if (grad_bias.defined())
                   static_cast<T*>(grad_bias.data_ptr())[c] = static_cast<T>(sum_g[c]);
               }
             });
}

// Training-mode backward of one rank's batch: grad_weight = sum(g * xhat), grad_bias = sum(g).
inline void batch_norm_train_backward(ThreadPool& pool, const Tensor& x, const Tensor& grad_y,
                                      const Tensor& weight, const Tensor& save_mean,
                                      const Tensor& save_invstd, const Tensor& grad_x,
                                      const Tensor& grad_weight, const Tensor& grad_bias,
                                      std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                      const Tensor& relu_out = {}) {
  HostScratch scratch;
  double* sum_g = scratch.doubles(static_cast<std::size_t>(channels));
  double* sum_gxhat = scratch.doubles(static_cast<std::size_t>(channels));
  batch_norm_grad_sums(pool, x, grad_y, save_mean, save_invstd, outer, channels, inner, sum_g,
                       sum_gxhat, relu_out);
  store_channel_grads(sum_g, sum_gxhat, grad_weight, grad_bias, channels);
  if (grad_x.defined())
    batch_norm_input_grad(pool, x, grad_y, weight, save_mean, save_invstd, grad_x, outer, channels,
                          inner, double(outer * inner), sum_g, sum_gxhat, relu_out);
}

namespace detail {

template <class T>
using PoolBits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;

// A window's running maximum (its bits) and where it lies: v at `at` replaces it when larger or
// a NaN. Taken by bit masks: on random data a new maximum turns up unpredictably, and as
// branches (GCC 12 turns `take ? v : best` back into one) they mispredicted often enough to
// make the window loop 5% of a ResNet-18 step.
template <class T, class Index>
inline void take_larger(T v, Index at, PoolBits<T>& best, Index& best_at) {
  using Bits = PoolBits<T>;
  const bool take = (v > std::bit_cast<T>(best)) | (v != v);  // (v != v: a NaN)
  const Bits keep = Bits{0} - static_cast<Bits>(take);        // all ones to take
  const Index keep_at = -static_cast<Index>(take);
  best = (std::bit_cast<Bits>(v) & keep) | (best & ~keep);
  best_at = (at & keep_at) | (best_at & ~keep_at);
}

// One max-pool window: the maximum of plane[ih * W + iw] over rows [h0, h1) and columns
// [w0, w1) and where it lies, into *out and *at: the window's first value, then each later one
// by take_larger. With B > 1 the plane holds B channels side by side at each position, `step`
// values apart from one position to the next (channel blocks [H, W, B]: step B; B channels of a
// channels-last image [H, W, C]: step C), and the B windows are taken side by side, each
// channel's values in that same order (the same maxima and indices as its own plane's), into
// out[0, B) and at[0, B).
template <class T, int B = 1>
void max_window(const T* plane, std::int64_t W, std::int64_t h0, std::int64_t h1, std::int64_t w0,
                std::int64_t w1, T* out, std::int64_t* at, std::int64_t step = B) {
  PoolBits<T> best[B];
  std::int64_t best_at[B];
  for (int k = 0; k < B; ++k) {
    best[k] = std::bit_cast<PoolBits<T>>(plane[(h0 * W + w0) * step + k]);
    best_at[k] = h0 * W + w0;
  }
  for (std::int64_t ih = h0; ih < h1; ++ih)
    for (std::int64_t iw = ih == h0 ? w0 + 1 : w0; iw < w1; ++iw)
      for (int k = 0; k < B; ++k)
        take_larger(plane[(ih * W + iw) * step + k], ih * W + iw, best[k], best_at[k]);
  for (int k = 0; k < B; ++k) {
    out[k] = std::bit_cast<T>(best[k]);
    at[k] = best_at[k];
  }
}

// Outputs [lo, hi) of one output row whose K x K windows (stride S) lie wholly inside the
// plane, from row `top` and the column `left` of output 0's window: max_window's values in
// max_window's order, with the kernel known at compile time so that GCC vectorises across the
// outputs (8 f32 windows at a time, the index carried as a lane-wide offset; docs/performance.md
// has bench_autograd's step before and after).
template <class T, int K, int S>
void max_pool_row_inside(const T* plane, std::int64_t W, std::int64_t top, std::int64_t left,
                         std::int64_t lo, std::int64_t hi, T* out, std::int64_t* at) {
  using Offset = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int64_t>;
  const T* row = plane + top * W + left;
  const std::int64_t first = top * W + left;
  for (std::int64_t o = lo; o < hi; ++o) {
    const T* window = row + o * S;
    PoolBits<T> best = std::bit_cast<PoolBits<T>>(window[0]);
    Offset best_offset = 0;
    for (int kh = 0; kh < K; ++kh)
      for (int kw = 0; kw < K; ++kw) {
        // (Skipped here, not by starting kw at 1 when kh is 0: GCC then leaves the loop scalar.)
        if (kh == 0 && kw == 0) continue;
        take_larger(window[kh * W + kw], static_cast<Offset>(kh * W + kw), best, best_offset);
      }
    out[o] = std::bit_cast<T>(best);
    at[o] = first + o * S + best_offset;
  }
}

// B channels' planes of a max-pool held side by side: x's [H, W] positions into y's and
// argmax's [OH, OW], `step` values from one position to the next in all three (channel blocks:
// B; B channels of a channels-last image: its C), window by window (max_window with the B
// channels side by side, which GCC vectorises across them).
template <class T, int B>
void max_pool_blocked_plane(const T* plane, std::int64_t H, std::int64_t W, std::int64_t OH,
                            std::int64_t OW, const PoolGeometry& p, T* out, std::int64_t* at,
                            std::int64_t step = B) {
  for (std::int64_t oh = 0; oh < OH; ++oh) {
    const std::int64_t top = oh * p.stride_h - p.pad_h;
    const std::int64_t h0 = std::max<std::int64_t>(top, 0), h1 = std::min(top + p.kernel_h, H);
    for (std::int64_t ow = 0; ow < OW; ++ow) {
      const std::int64_t left = ow * p.stride_w - p.pad_w;
      const std::int64_t w0 = std::max<std::int64_t>(left, 0), w1 = std::min(left + p.kernel_w, W);
      max_window<T, B>(plane, W, h0, h1, w0, w1, out + (oh * OW + ow) * step,
                       at + (oh * OW + ow) * step, step);
    }
  }
}

// The gradient of B channels' planes of a max-pool ([H*W] positions, `step` values apart as in
// max_pool_blocked_plane: B = 1 and step 1 for NCHW): zero, then each channel's outputs added
// where their maxima were, in order.
template <class T, int B>
void max_pool_backward_plane(const T* g, const std::int64_t* at, std::int64_t OHW, std::int64_t HW,
                             T* plane, std::int64_t step = B) {
  if (step == B)
    std::fill(plane, plane + HW * B, T(0));
  else
    for (std::int64_t i = 0; i < HW; ++i) std::fill(plane + i * step, plane + i * step + B, T(0));
  for (std::int64_t o = 0; o < OHW * step; o += step)
    for (int k = 0; k < B; ++k)
      if (at[o + k] >= 0) plane[at[o + k] * step + k] += g[o + k];
}

// Channels-last pooling walks an image's C channels in groups of kPoolLanes side by side (the
// plane functions above with step C), then the remaining C % kPoolLanes one at a time: a task
// per (image, group) where the C % kPoolLanes singles belong to the last group of their image.
inline constexpr int kPoolLanes = 16;

template <class Group>
inline void channels_last_groups(ThreadPool& pool, std::int64_t images, std::int64_t channels,
                                 Group&& group) {
  const std::int64_t full = channels / kPoolLanes;
  const std::int64_t per_image = std::max<std::int64_t>(full, 1);
  pool.parallel_for(images * per_image, [&](std::int64_t task) {
    const std::int64_t n = task / per_image, k = task % per_image;
    if (k < full) group(n, k * kPoolLanes, std::integral_constant<int, kPoolLanes>{});
    if (k == per_image - 1)
      for (std::int64_t c = full * kPoolLanes; c < channels; ++c)
        group(n, c, std::integral_constant<int, 1>{});
  });
}

}  // namespace detail

// Max-pool x[N, C, H, W] -> y[N, C, OH, OW]; argmax[N, C, OH, OW] (i64) holds the index into
// each H*W plane for backward. Padding never wins (it is -inf, as in PyTorch); a NaN does (the
// last one in the window). No window is empty: max_pool2d checks that padding <= kernel / 2.
// One (n, c) plane per task: each output is one thread's, so the result is the same on any
// thread count. The square 3 x 3 / 2 and 2 x 2 / 2 pools take the windows wholly inside a
// plane by max_pool_row_inside, the rest (the padded border, other kernels) window by window.
// In channel blocks (x [N, C/b, H, W, b], core/channel_blocks.hpp) y and argmax are blocked as
// x is, one plane of b channels per task (max_pool_blocked_plane): the same values. A
// channels-last x (core/channels_last.hpp) gives a channels-last y and argmax, kPoolLanes
// channels of an image per task, side by side as channel blocks are: the same values again.
inline void max_pool_forward(ThreadPool& pool, const Tensor& x, const Tensor& y,
                             const Tensor& argmax, const PoolGeometry& p) {
  visit_real(x.dtype(), "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    if (x.dim() == 5) {
      with_block_width(x.size(4), [&](auto width) {
        constexpr int B = decltype(width)::value;
        const std::int64_t H = x.size(2), W = x.size(3), OH = y.size(2), OW = y.size(3);
        const T* in = static_cast<const T*>(x.data_ptr());
        T* out = static_cast<T*>(y.data_ptr());
        auto* arg = static_cast<std::int64_t*>(argmax.data_ptr());
        pool.parallel_for(x.size(0) * x.size(1), [&](std::int64_t q) {
          detail::max_pool_blocked_plane<T, B>(in + q * H * W * B, H, W, OH, OW, p,
                                               out + q * OH * OW * B, arg + q * OH * OW * B);
        });
      });
      return;
    }
    const std::int64_t planes = x.size(0) * x.size(1), H = x.size(2), W = x.size(3);
    const std::int64_t OH = y.size(2), OW = y.size(3);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    auto* arg = static_cast<std::int64_t*>(argmax.data_ptr());
    if (keeps_channels_last(x)) {
      SK_ASSERT(is_channels_last(y) && is_channels_last(argmax));
      const std::int64_t C = x.size(1);
      detail::channels_last_groups(pool, x.size(0), C, [&](std::int64_t n, std::int64_t c, auto b) {
        detail::max_pool_blocked_plane<T, decltype(b)::value>(in + n * H * W * C + c, H, W, OH, OW,
                                                              p, out + n * OH * OW * C + c,
                                                              arg + n * OH * OW * C + c, C);
      });
      return;
    }
    using Row = void (*)(const T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, T*, std::int64_t*);
    Row inside_row = nullptr;
    const bool square = p.kernel_h == p.kernel_w && p.stride_h == p.stride_w;
    if (square && p.kernel_h == 3 && p.stride_h == 2)
      inside_row = detail::max_pool_row_inside<T, 3, 2>;
    if (square && p.kernel_h == 2 && p.stride_h == 2)
      inside_row = detail::max_pool_row_inside<T, 2, 2>;
    // The outputs whose windows lie wholly inside the plane's columns: [inside_lo, inside_hi).
    const std::int64_t inside_lo = (p.pad_w + p.stride_w - 1) / p.stride_w;
    const std::int64_t inside_hi =
        std::max(inside_lo, std::min(OW, (W + p.pad_w - p.kernel_w) / p.stride_w + 1));
    pool.parallel_for(planes, [&](std::int64_t q) {
      const T* plane = in + q * H * W;
      T* plane_out = out + q * OH * OW;
      std::int64_t* plane_arg = arg + q * OH * OW;
      for (std::int64_t oh = 0; oh < OH; ++oh) {
        // The window's rows and columns inside the image (the padding is skipped, not read).
        const std::int64_t top = oh * p.stride_h - p.pad_h;
        const std::int64_t h0 = std::max<std::int64_t>(top, 0), h1 = std::min(top + p.kernel_h, H);
        T* row_out = plane_out + oh * OW;
        std::int64_t* row_arg = plane_arg + oh * OW;
        const bool rows_inside = inside_row != nullptr && top >= 0 && top + p.kernel_h <= H;
        const std::int64_t lo = rows_inside ? inside_lo : OW, hi = rows_inside ? inside_hi : OW;
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          if (ow == lo && lo < hi) {
            inside_row(plane, W, top, -p.pad_w, lo, hi, row_out, row_arg);
            ow = hi - 1;
            continue;
          }
          const std::int64_t left = ow * p.stride_w - p.pad_w;
          const std::int64_t w0 = std::max<std::int64_t>(left, 0),
                             w1 = std::min(left + p.kernel_w, W);
          detail::max_window(plane, W, h0, h1, w0, w1, row_out + ow, row_arg + ow);
        }
      }
    });
  });
}

// One (n, c) plane per task, as forward: a plane's gradient sums only its own outputs, in order.
// In channel blocks, one plane of b channels per task, each channel's outputs in that order;
// channels-last (grad_y, argmax and grad_x all so), kPoolLanes channels of an image per task.
inline void max_pool_backward(ThreadPool& pool, const Tensor& grad_y, const Tensor& argmax,
                              const Tensor& grad_x) {
  visit_real(grad_y.dtype(), "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    const auto planes = [&](auto width) {
      constexpr int B = decltype(width)::value;
      const std::int64_t HW = grad_x.size(2) * grad_x.size(3);
      const std::int64_t OHW = grad_y.size(2) * grad_y.size(3);
      const T* gy = static_cast<const T*>(grad_y.data_ptr());
      const auto* arg = static_cast<const std::int64_t*>(argmax.data_ptr());
      T* gx = static_cast<T*>(grad_x.data_ptr());
      pool.parallel_for(grad_x.size(0) * grad_x.size(1), [&](std::int64_t q) {
        detail::max_pool_backward_plane<T, B>(gy + q * OHW * B, arg + q * OHW * B, OHW, HW,
                                              gx + q * HW * B);
      });
    };
    if (grad_x.dim() == 5) return with_block_width(grad_x.size(4), planes);
    if (!keeps_channels_last(grad_x)) return planes(std::integral_constant<int, 1>{});
    SK_ASSERT(is_channels_last(grad_y) && is_channels_last(argmax));
    const std::int64_t C = grad_x.size(1), HW = grad_x.size(2) * grad_x.size(3);
    const std::int64_t OHW = grad_y.size(2) * grad_y.size(3);
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const auto* arg = static_cast<const std::int64_t*>(argmax.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    detail::channels_last_groups(
        pool, grad_x.size(0), C, [&](std::int64_t n, std::int64_t c, auto b) {
          detail::max_pool_backward_plane<T, decltype(b)::value>(
              gy + n * OHW * C + c, arg + n * OHW * C + c, OHW, HW, gx + n * HW * C + c, C);
        });
  });
}

}  // namespace shardkit::autograd::cpu
