// Training-mode batch-norm on the GPU, in steps (autograd/norm.hpp runs them; SyncBatchNorm
// exchanges between them): per-channel moments, the statistics folded from them (a group's
// members in rank order, or one rank's alone), the affine map, the gradient sums and the input
// gradient. Sums are double, each made in a fixed order, so repeated runs give the same bits;
// the folding and the per-channel statistics are batch_norm_stats.hpp's functions, the CPU's own.
//
// The moments and the gradient sums split each channel's [outer, inner] values into parts of
// about 4096 values (whole rows, or segments of a longer row: batch_norm_parts.hpp), a block
// each: a part's count, mean and squared deviations (two
// passes over the part, the second from cache), or its sums of g and g·(x - mean); a warp per
// channel then folds its parts in a fixed order (Chan's update, or plain sums). One block per
// channel, as these kernels first were, left a 64-channel layer of 256 x 32² images on 64 of an
// H200's 132 SMs; so does cuDNN's NCHW batch-norm, which took 383 us for the backward of that
// layer (67 MB of x, of g and of the input gradient: 50 us of copy). Every pass takes runs of 4
// values of a row a thread (one 128-bit load for aligned f32), the parts' row and place
// advanced without a division per value; the element-wise maps find a run's channel once.
// Rows of channels (inner == 1: channels-last activations as [N·H·W, C], [N, C] inputs), whose
// channel's values lie a row apart, take tiles of 32 channels over parts of rows instead, a
// warp reading 32 channels of a row at once (batch_norm_parts.hpp's RowParts); their partials
// fold the same way, and the element-wise maps take runs of 4 channels of a row.
// A group of one (plain batch-norm) folds its parts straight into the statistics and writes its
// weight and bias gradients in the gradient sums' fold: 3 launches each way.
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/batch_norm_parts.hpp"
#include "shardkit/autograd/batch_norm_stats.hpp"
#include "shardkit/core/channels_last.hpp"

namespace shardkit::autograd::cuda_kernels {

namespace batch_norm_sync {

// Per values of a row a thread takes at once: 4 where they stay in one row and, for f32, every
// operand is 16-byte aligned (one 128-bit load); else 1.
template <class T>
int run_length(std::int64_t inner, std::initializer_list<const void*> operands) {
  if (inner % 4 != 0) return 1;
  if constexpr (std::is_same_v<T, float>)
    for (const void* p : operands)
      if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return 1;
  return 4;
}

// Per consecutive values at p + offset, as A (one 128-bit load for 4 f32).
template <class A, int Per, class T>
SK_DEVICE SK_INLINE void load_run(const T* p, std::int64_t offset, A (&v)[Per]) {
  if constexpr (Per == 4 && std::is_same_v<T, float>) {
    const float4 q = *reinterpret_cast<const float4*>(p + offset);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    SK_UNROLL
    for (int k = 0; k < Per; ++k) v[k] = load<A>(p, offset + k);
  }
}
template <class A, int Per, class T>
SK_DEVICE SK_INLINE void store_run(T* p, std::int64_t offset, const A (&v)[Per]) {
  if constexpr (Per == 4 && std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p + offset) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    SK_UNROLL
    for (int k = 0; k < Per; ++k) store(p, offset + k, v[k]);
  }
}

// This thread's runs of its block's part (batch_norm_parts.hpp: the walk the CPU tests check).
template <int Per, class Fn>
SK_DEVICE SK_INLINE std::int64_t for_part_runs(std::int64_t c, std::int64_t part,
                                               const ChannelParts& parts, std::int64_t outer,
                                               std::int64_t channels, std::int64_t inner, Fn&& fn) {
  return autograd::for_part_runs<Per>(threadIdx.x, blockDim.x, c, part, parts, outer, channels,
                                      inner, static_cast<Fn&&>(fn));
}

// Per part: {count, mean, sum of squared deviations from that mean}, at partials[3·block].
template <class T, int Per>
__global__ void moments_parts_kernel(const T* x, double* partials, ChannelParts parts,
                                     std::int64_t outer, std::int64_t channels,
                                     std::int64_t inner) {
  using A = Acc<T>;
  const std::int64_t c = blockIdx.x / parts.parts, part = blockIdx.x % parts.parts;
  double sum = 0;
  const std::int64_t n =
      for_part_runs<Per>(c, part, parts, outer, channels, inner, [&](std::int64_t offset) {
        A v[Per];
        load_run(x, offset, v);
        SK_UNROLL
        for (int k = 0; k < Per; ++k) sum += double(v[k]);
      });
  const double mean = block_sum(sum) / double(n);
  double m2 = 0;  // (the part again: from cache)
  for_part_runs<Per>(c, part, parts, outer, channels, inner, [&](std::int64_t offset) {
    A v[Per];
    load_run(x, offset, v);
    SK_UNROLL
    for (int k = 0; k < Per; ++k) {
      const double d = double(v[k]) - mean;
      m2 += d * d;
    }
  });
  m2 = block_sum(m2);
  if (threadIdx.x == 0) {
    double* out = partials + 3 * std::int64_t{blockIdx.x};
    out[0] = double(n);
    out[1] = mean;
    out[2] = m2;
  }
}

// Rows of channels: the block's tile and part (blockIdx.x = part · tiles + tile, so neighbouring
// blocks read the same rows), the thread's channel lane and row lane.
static_assert(kThreadsPerBlock == kTileChannels * kRowLanes, "a block is a tile's row lanes");
struct RowThread {
  std::int64_t part, c;
  int row_lane;
  bool active;  // c < channels (the last tile may be short)
};
SK_DEVICE SK_INLINE RowThread row_thread(const RowParts& parts, std::int64_t channels) {
  RowThread t;
  t.part = blockIdx.x / parts.tiles;
  t.c = blockIdx.x % parts.tiles * kTileChannels + threadIdx.x % kTileChannels;
  t.row_lane = static_cast<int>(threadIdx.x / kTileChannels);
  t.active = t.c < channels;
  return t;
}

// A channel's sum over the block's row lanes, in row-lane order; every thread gets its
// channel's. (A template, as block_sum: a header's device function with its own shared array.)
template <int = 0>
SK_DEVICE double row_lanes_sum(double value) {
  __shared__ double lanes[kRowLanes][kTileChannels];
  const int lane = threadIdx.x % kTileChannels, row_lane = threadIdx.x / kTileChannels;
  __syncthreads();  // (a previous call's reads)
  lanes[row_lane][lane] = value;
  __syncthreads();
  double total = 0;
  for (int r = 0; r < kRowLanes; ++r) total += lanes[r][lane];
  return total;
}

// moments_parts_kernel's partials for rows of channels: partials[3 · (c · parts + part)].
template <class T>
__global__ void moments_rows_kernel(const T* x, double* partials, RowParts parts, std::int64_t rows,
                                    std::int64_t channels) {
  using A = Acc<T>;
  const RowThread t = row_thread(parts, channels);
  const std::int64_t n = part_rows_of(t.part, parts, rows);
  double sum = 0;
  if (t.active)
    for_part_rows(t.row_lane, t.c, t.part, parts, rows, channels,
                  [&](std::int64_t offset) { sum += double(load<A>(x, offset)); });
  const double total = row_lanes_sum(sum);  // (every thread calls it: it synchronises)
  const double mean = n > 0 ? total / double(n) : 0.0;
  double m2 = 0;  // (the part again: from cache)
  if (t.active)
    for_part_rows(t.row_lane, t.c, t.part, parts, rows, channels, [&](std::int64_t offset) {
      const double d = double(load<A>(x, offset)) - mean;
      m2 += d * d;
    });
  m2 = row_lanes_sum(m2);
  if (t.active && t.row_lane == 0) {
    double* out = partials + 3 * (t.c * parts.parts + t.part);
    out[0] = double(n);
    out[1] = mean;
    out[2] = m2;
  }
}

// Channel c's parts folded by one warp (warp-collective; the result in lane 0): lane l folds
// parts l, l + 32, ... in order, then the lanes' moments pair up by halving distances -- a fixed
// order, so the same bits every run. (A thread per channel folding 64 parts one after another,
// a division each, took 34 us of the 64-channel layers.)
SK_DEVICE SK_INLINE ChannelMoments fold_parts(const double* partials, std::int64_t parts,
                                              std::int64_t c, int lane) {
  ChannelMoments m;
  for (std::int64_t p = lane; p < parts; p += 32) {
    const double* part = partials + 3 * (c * parts + p);
    fold_moments(m, part[0], part[1], part[2]);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const double n = __shfl_down_sync(0xffffffffu, m.count, offset);
    const double mean = __shfl_down_sync(0xffffffffu, m.mean, offset);
    const double m2 = __shfl_down_sync(0xffffffffu, m.m2, offset);
    if (lane < offset) fold_moments(m, n, mean, m2);
  }
  return m;
}

// A warp per channel, the warps striding over the channels (whole warps: the loop's condition
// is the same for a warp's lanes).
template <class Fn>
SK_DEVICE SK_INLINE void for_channel_warps(std::int64_t channels, Fn&& fn) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = std::int64_t{gridDim.x} * blockDim.x / 32;
  for (std::int64_t c = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; c < channels;
       c += warps)
    fn(c, lane);
}
inline unsigned channel_warps_grid(std::int64_t channels) { return grid_for(channels * 32); }

// The parts folded into moments = {count, means, m2s} (what a group's members exchange).
template <int = 0>
__global__ void moments_fold_kernel(const double* partials, std::int64_t parts,
                                    std::int64_t channels, double count, double* moments) {
  for_channel_warps(channels, [&](std::int64_t c, int lane) {
    const ChannelMoments m = fold_parts(partials, parts, c, lane);
    if (lane == 0) {
      moments[1 + c] = m.mean;
      moments[1 + channels + c] = m.m2;
      if (c == 0) moments[0] = count;
    }
  });
}

// A group of one: the parts folded straight into the statistics (group_stats_kernel's
// store_batch_stats, without the moments between).
template <class S>
__global__ void local_stats_kernel(const double* partials, std::int64_t parts,
                                   std::int64_t channels, double momentum, double eps,
                                   S* running_mean, S* running_var, double* stats, S* save_mean,
                                   S* save_invstd) {
  for_channel_warps(channels, [&](std::int64_t c, int lane) {
    const ChannelMoments m = fold_parts(partials, parts, c, lane);
    if (lane == 0)
      store_batch_stats(m, momentum, eps, c, channels, stats, save_mean, save_invstd, running_mean,
                        running_var);
  });
}

template <class S>
__global__ void group_stats_kernel(const double* gathered, int members, std::int64_t channels,
                                   double momentum, double eps, S* running_mean, S* running_var,
                                   double* stats, S* save_mean, S* save_invstd, double* count) {
  const std::int64_t stride = 1 + 2 * channels;
  for (std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; c < channels;
       c += std::int64_t{gridDim.x} * blockDim.x) {
    ChannelMoments m;
    for (int r = 0; r < members; ++r) {
      const double* theirs = gathered + r * stride;
      fold_moments(m, theirs[0], theirs[1 + c], theirs[1 + channels + c]);
    }
    store_batch_stats(m, momentum, eps, c, channels, stats, save_mean, save_invstd, running_mean,
                      running_var);
    if (c == 0) *count = m.count;
  }
}

// Calls fn(i, c) for each run of Per consecutive elements i.. of one row (Per divides inner; or
// inner == 1 and Per divides channels, c then the run's first channel), a thread each, c their
// channel: found once a run, by 32-bit division where the sizes allow.
template <int Per, class Fn>
SK_DEVICE SK_INLINE void for_row_runs(std::int64_t n, std::int64_t channels, std::int64_t inner,
                                      Fn&& fn) {
  const std::int64_t runs = n / Per;
  const bool narrow = n < (std::int64_t{1} << 32);
  for (std::int64_t r = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; r < runs;
       r += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t i = r * Per;
    const std::int64_t c = narrow ? static_cast<std::int64_t>(static_cast<std::uint32_t>(i) /
                                                              static_cast<std::uint32_t>(inner) %
                                                              static_cast<std::uint32_t>(channels))
                                  : (i / inner) % channels;
    fn(i, c);
  }
}

// Across: rows of channels (inner == 1), whose runs are Per channels of one row (channels % Per
// == 0), value k of a run channel c + k; else a run's values share channel c.
template <class T, class S, int Per, bool Across>
__global__ void apply_kernel(const T* x, const S* weight, const S* bias, const double* stats, T* y,
                             std::int64_t n, std::int64_t channels, std::int64_t inner, bool relu) {
  using A = Acc<T>;
  for_row_runs<Per>(n, channels, inner, [&](std::int64_t i, std::int64_t c) {
    A v[Per];
    load_run(x, i, v);
    SK_UNROLL
    for (int k = 0; k < Per; ++k) {
      const std::int64_t ck = Across ? c + k : c;
      // In double, rounded once, as the CPU's affine map (a float shift would lose the mean's
      // low bits when |mean| is large against the spread).
      const double scale = double(weight[ck]) * stats[channels + ck];
      const double shift = double(bias[ck]) - stats[ck] * scale;
      const A out = A(double(v[k]) * scale + shift);
      v[k] = relu && out <= A(0) ? A(0) : out;  // (the ReLU's rule: a NaN stays)
    }
    store_run(y, i, v);
  });
}

// Evaluation mode's statistics for apply_kernel: {running mean, 1 / sqrt(running var + eps)}
// in double, a thread a channel.
template <class S>
__global__ void eval_stats_kernel(const S* running_mean, const S* running_var, double eps,
                                  double* stats, std::int64_t channels) {
  for (std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; c < channels;
       c += std::int64_t{gridDim.x} * blockDim.x) {
    stats[c] = double(running_mean[c]);
    stats[channels + c] = 1.0 / sqrt(double(running_var[c]) + eps);
  }
}

// Per part: {sum of g, sum of g·(x - mean)}, at partials[2·block].
template <class T, class S, int Per>
__global__ void grad_sums_parts_kernel(const T* x, const T* grad_y, const S* save_mean,
                                       double* partials, ChannelParts parts, std::int64_t outer,
                                       std::int64_t channels, std::int64_t inner) {
  using A = Acc<T>;
  const std::int64_t c = blockIdx.x / parts.parts, part = blockIdx.x % parts.parts;
  const double mean = double(save_mean[c]);
  double sum_g = 0, sum_gx = 0;
  for_part_runs<Per>(c, part, parts, outer, channels, inner, [&](std::int64_t offset) {
    A g[Per], v[Per];
    load_run(grad_y, offset, g);
    load_run(x, offset, v);
    SK_UNROLL
    for (int k = 0; k < Per; ++k) {
      sum_g += double(g[k]);
      sum_gx += double(g[k]) * (double(v[k]) - mean);
    }
  });
  sum_g = block_sum(sum_g);
  sum_gx = block_sum(sum_gx);
  if (threadIdx.x == 0) {
    partials[2 * std::int64_t{blockIdx.x}] = sum_g;
    partials[2 * std::int64_t{blockIdx.x} + 1] = sum_gx;
  }
}

// grad_sums_parts_kernel's partials for rows of channels: partials[2 · (c · parts + part)].
template <class T, class S>
__global__ void grad_sums_rows_kernel(const T* x, const T* grad_y, const S* save_mean,
                                      double* partials, RowParts parts, std::int64_t rows,
                                      std::int64_t channels) {
  using A = Acc<T>;
  const RowThread t = row_thread(parts, channels);
  double sum_g = 0, sum_gx = 0;
  if (t.active) {
    const double mean = double(save_mean[t.c]);
    for_part_rows(t.row_lane, t.c, t.part, parts, rows, channels, [&](std::int64_t offset) {
      const double g = double(load<A>(grad_y, offset));
      sum_g += g;
      sum_gx += g * (double(load<A>(x, offset)) - mean);
    });
  }
  sum_g = row_lanes_sum(sum_g);
  sum_gx = row_lanes_sum(sum_gx);
  if (t.active && t.row_lane == 0) {
    partials[2 * (t.c * parts.parts + t.part)] = sum_g;
    partials[2 * (t.c * parts.parts + t.part) + 1] = sum_gx;
  }
}

// A warp per channel: its parts' sums added (lane l parts l, l + 32, ..., then the lanes by
// halving distances: a fixed order); sums = {sum g, sum g·xhat}, and where given this rank's
// weight and bias gradients (sum g·xhat, sum g) in the statistics dtype.
template <class S>
__global__ void grad_sums_fold_kernel(const double* partials, std::int64_t parts,
                                      const S* save_invstd, std::int64_t channels, double* sums,
                                      S* grad_weight, S* grad_bias) {
  for_channel_warps(channels, [&](std::int64_t c, int lane) {
    double sum_g = 0, sum_gx = 0;
    for (std::int64_t p = lane; p < parts; p += 32) {
      sum_g += partials[2 * (c * parts + p)];
      sum_gx += partials[2 * (c * parts + p) + 1];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      sum_g += __shfl_down_sync(0xffffffffu, sum_g, offset);
      sum_gx += __shfl_down_sync(0xffffffffu, sum_gx, offset);
    }
    if (lane == 0) {
      const double g_xhat = sum_gx * double(save_invstd[c]);
      sums[c] = sum_g;
      sums[channels + c] = g_xhat;
      if (grad_weight != nullptr) {
        grad_weight[c] = static_cast<S>(g_xhat);
        grad_bias[c] = static_cast<S>(sum_g);
      }
    }
  });
}

template <class T, class S, int Per, bool Across>
__global__ void input_grad_kernel(const T* x, const T* grad_y, const S* weight, const S* save_mean,
                                  const S* save_invstd, const double* sums, const double* count,
                                  T* grad_x, std::int64_t n, std::int64_t channels,
                                  std::int64_t inner) {
  using A = Acc<T>;
  const double total = count != nullptr ? *count : double(n / channels);  // (null: this batch's)
  for_row_runs<Per>(n, channels, inner, [&](std::int64_t i, std::int64_t c) {
    A xs[Per], gs[Per];
    load_run(x, i, xs);
    load_run(grad_y, i, gs);
    SK_UNROLL
    for (int j = 0; j < Per; ++j) {
      const std::int64_t cj = Across ? c + j : c;
      const double mean = double(save_mean[cj]), invstd = double(save_invstd[cj]);
      const double k = double(weight[cj]) * invstd / total;
      const double xhat = (double(xs[j]) - mean) * invstd;
      xs[j] = A(k * (total * double(gs[j]) - sums[cj] - xhat * sums[channels + cj]));
    }
    store_run(grad_x, i, xs);
  });
}

// Calls fn(S{}) for the statistics dtypes (f32, f64).
template <class Fn>
void visit_stat(DType dtype, const char* op, Fn&& fn) {
  if (dtype == DType::f32) return fn(float{});
  if (dtype == DType::f64) return fn(double{});
  fail<InvalidArgument>(op, ": batch-norm statistics are f32 or f64, got ", dtype_name(dtype));
}

// The element-wise operands of a step: on the GPU, of x's dtype, shape and dense layout
// (contiguous, or channels-last -- core/channels_last.hpp -- which the steps read as rows of
// channels).
inline void check_like_x(const Tensor& x, const Tensor& t, const char* what, const char* op) {
  const bool same_layout =
      t.defined() && ((x.is_contiguous() && t.is_contiguous()) ||
                      (is_channels_last(x) && is_channels_last(t) && t.shape() == x.shape()));
  check(same_layout && t.dtype() == x.dtype() && t.numel() == x.numel() && t.device().is_cuda() &&
            x.device().is_cuda(),
        op, ": ", what, " must be a GPU tensor of x's dtype, shape and layout (contiguous or ",
        "channels-last), like x");
}

// x's layout and the shape the steps are given agree: a channels-last x (core/channels_last.hpp)
// is read as rows of channels, [N·H·W, C, 1], so inner must be 1 (norm.hpp passes it so).
inline void check_layout(const Tensor& x, std::int64_t inner, const char* op) {
  check(x.is_contiguous() || (is_channels_last(x) && inner == 1), op, ": x ", shape_text(x.shape()),
        " must be contiguous, or channels-last and seen as rows of ", "channels (inner 1, got ",
        inner, ")");
}

template <class S>
S* stat_data(const Tensor& t) {
  return t.defined() ? static_cast<S*>(t.data_ptr()) : nullptr;
}

// Calls fn.template operator()<Per>() with the run length run_length chose.
template <class Fn>
void with_run_length(int per, Fn&& fn) {
  if (per == 4) return fn.template operator()<4>();
  fn.template operator()<1>();
}

// The element-wise maps' runs: Per values of a row of one channel, or for rows of channels
// (inner == 1) Per channels of a row; calls fn.template operator()<Per, Across>().
template <class T, class Fn>
void with_map_runs(std::int64_t channels, std::int64_t inner,
                   std::initializer_list<const void*> operands, Fn&& fn) {
  const bool across = inner == 1;
  if (run_length<T>(across ? channels : inner, operands) == 1)
    return fn.template operator()<1, false>();
  if (across) return fn.template operator()<4, true>();
  fn.template operator()<4, false>();
}

// A channel's values split for the moments and gradient sums: the parts' form, or rows of
// channels (inner == 1, and an empty x: no rows, every part's count 0); `parts` of them a
// channel, whose partials the folds read.
struct Split {
  bool by_rows = false;
  std::int64_t rows = 0;  // (by_rows: x's rows, outer · inner)
  ChannelParts channel;
  RowParts row;
  std::int64_t parts = 1;
  unsigned blocks = 1;
};
inline Split split(std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  Split s;
  s.by_rows = inner == 1 || outer * inner == 0;
  if (s.by_rows) {
    s.rows = outer * inner;
    s.row = row_parts(s.rows, channels);
    s.parts = s.row.parts;
    s.blocks = row_grid(s.row.tiles * s.row.parts);
  } else {
    s.channel = channel_parts(outer, inner);
    s.parts = s.channel.parts;
    s.blocks = row_grid(channels * s.channel.parts);
  }
  return s;
}

// The parts' moments of x (f64 [3 · channels · parts], stream-ordered scratch).
inline Tensor moments_parts(Context& ctx, const Tensor& x, const Split& sp, std::int64_t outer,
                            std::int64_t channels, std::int64_t inner) {
  check_layout(x, inner, "batch-norm moments");
  Tensor partials = empty(ctx, {3 * channels * sp.parts}, DType::f64, MemoryCategory::other);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_moments", [&](auto tag) {
    using T = decltype(tag);
    if (sp.by_rows) {
      moments_rows_kernel<T><<<sp.blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), partials.data<double>(), sp.row, sp.rows, channels);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_rows_kernel");
      return;
    }
    with_run_length(run_length<T>(inner, {x.data_ptr()}), [&]<int Per>() {
      moments_parts_kernel<T, Per><<<sp.blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), partials.data<double>(), sp.channel, outer, channels,
          inner);
    });
    SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_parts_kernel");
  });
  return partials;
}

// The parts' gradient sums folded into sums (f64 [2 · channels]) and, where defined, this
// rank's weight and bias gradients.
inline void grad_sums(Context& ctx, const Tensor& x, const Tensor& grad_y, const Tensor& save_mean,
                      const Tensor& save_invstd, double* sums, const Tensor& grad_weight,
                      const Tensor& grad_bias, std::int64_t outer, std::int64_t channels,
                      std::int64_t inner) {
  check_layout(x, inner, "batch-norm gradient sums");
  const Split sp = split(outer, channels, inner);
  Tensor partials = empty(ctx, {2 * channels * sp.parts}, DType::f64, MemoryCategory::other);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_grad_sums", [&](auto tag) {
    using T = decltype(tag);
    visit_stat(save_mean.dtype(), "batch_norm_grad_sums", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      const auto* xp = static_cast<const T*>(x.data_ptr());
      const auto* gp = static_cast<const T*>(grad_y.data_ptr());
      if (sp.by_rows) {
        grad_sums_rows_kernel<T, S><<<sp.blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
            xp, gp, stat_data<S>(save_mean), partials.data<double>(), sp.row, sp.rows, channels);
        SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_rows_kernel");
      } else {
        with_run_length(run_length<T>(inner, {x.data_ptr(), grad_y.data_ptr()}), [&]<int Per>() {
          grad_sums_parts_kernel<T, S, Per><<<sp.blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
              xp, gp, stat_data<S>(save_mean), partials.data<double>(), sp.channel, outer, channels,
              inner);
        });
        SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_parts_kernel");
      }
      grad_sums_fold_kernel<S><<<channel_warps_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          partials.data<double>(), sp.parts, stat_data<S>(save_invstd), channels, sums,
          stat_data<S>(grad_weight), stat_data<S>(grad_bias));
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_fold_kernel");
    });
  });
}

}  // namespace batch_norm_sync

inline void batch_norm_moments(Context& ctx, const Tensor& x, const Tensor& moments,
                               std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  double* out = statistics_data(moments, 1 + 2 * channels, true, "batch_norm_moments");
  if (channels == 0) return;
  const b::Split sp = b::split(outer, channels, inner);
  const Tensor partials = b::moments_parts(ctx, x, sp, outer, channels, inner);
  b::moments_fold_kernel<><<<b::channel_warps_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
      partials.data<double>(), sp.parts, channels, double(outer * inner), out);
  SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_fold_kernel");
}

// A group of one's statistics from its own batch: batch_norm_moments then
// batch_norm_group_stats with one member, in two launches instead of three.
inline void batch_norm_local_stats(Context& ctx, const Tensor& x, double momentum, double eps,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   const Tensor& stats, const Tensor& save_mean,
                                   const Tensor& save_invstd, std::int64_t outer,
                                   std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  double* out = statistics_data(stats, 2 * channels, true, "batch_norm_local_stats");
  if (channels == 0) return;
  const b::Split sp = b::split(outer, channels, inner);
  const Tensor partials = b::moments_parts(ctx, x, sp, outer, channels, inner);
  b::visit_stat(save_mean.dtype(), "batch_norm_local_stats", [&](auto tag) {
    using S = decltype(tag);
    b::local_stats_kernel<S>
        <<<b::channel_warps_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
            partials.data<double>(), sp.parts, channels, momentum, eps,
            b::stat_data<S>(running_mean),
            running_mean.defined() ? b::stat_data<S>(running_var) : nullptr, out,
            b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd));
    SK_CUDA_CHECK_LAUNCH("batch_norm_sync::local_stats_kernel");
  });
}

inline void batch_norm_group_stats(Context& ctx, const Tensor& gathered, int members,
                                   std::int64_t channels, double momentum, double eps,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   const Tensor& stats, const Tensor& save_mean,
                                   const Tensor& save_invstd, const Tensor& count) {
  namespace b = batch_norm_sync;
  const double* all =
      statistics_data(gathered, members * (1 + 2 * channels), true, "batch_norm_group_stats");
  double* out = statistics_data(stats, 2 * channels, true, "batch_norm_group_stats");
  double* total = statistics_data(count, 1, true, "batch_norm_group_stats");
  if (channels == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  b::visit_stat(save_mean.dtype(), "batch_norm_group_stats", [&](auto tag) {
    using S = decltype(tag);
    b::group_stats_kernel<S><<<grid_for(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
        all, members, channels, momentum, eps, b::stat_data<S>(running_mean),
        running_mean.defined() ? b::stat_data<S>(running_var) : nullptr, out,
        b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd), total);
    SK_CUDA_CHECK_LAUNCH("batch_norm_sync::group_stats_kernel");
  });
}

inline void batch_norm_apply(Context& ctx, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& stats, const Tensor& y,
                             std::int64_t outer, std::int64_t channels, std::int64_t inner,
                             bool relu) {
  namespace b = batch_norm_sync;
  const double* s = statistics_data(stats, 2 * channels, true, "batch_norm_apply");
  b::check_like_x(x, y, "y", "batch_norm_apply");
  b::check_layout(x, inner, "batch_norm_apply");
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_apply", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_apply", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      b::with_map_runs<T>(channels, inner, {x.data_ptr(), y.data_ptr()},
                          [&]<int Per, bool Across>() {
                            b::apply_kernel<T, S, Per, Across>
                                <<<grid_for(n / Per), kThreadsPerBlock, 0, ctx.stream()>>>(
                                    static_cast<const T*>(x.data_ptr()), b::stat_data<S>(weight),
                                    b::stat_data<S>(bias), s, static_cast<T*>(y.data_ptr()), n,
                                    channels, inner, relu);
                          });
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::apply_kernel");
    });
  });
}

// Evaluation mode: x normalised with the running statistics (any eps > 0, as PyTorch's own
// kernels take; cuDNN's refuses eps below 1e-5), the ReLU applied as y is written.
inline void batch_norm_eval_apply(Context& ctx, const Tensor& x, const Tensor& weight,
                                  const Tensor& bias, const Tensor& running_mean,
                                  const Tensor& running_var, double eps, const Tensor& y,
                                  std::int64_t outer, std::int64_t channels, std::int64_t inner,
                                  bool relu) {
  namespace b = batch_norm_sync;
  if (channels == 0) return;
  Tensor stats = empty(ctx, {2 * channels}, DType::f64, MemoryCategory::other);
  {
    CudaDeviceGuard guard(ctx.device().index);
    b::visit_stat(running_mean.dtype(), "batch_norm_eval_apply", [&](auto tag) {
      using S = decltype(tag);
      b::eval_stats_kernel<S><<<grid_for(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          b::stat_data<S>(running_mean), b::stat_data<S>(running_var), eps, stats.data<double>(),
          channels);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::eval_stats_kernel");
    });
  }
  batch_norm_apply(ctx, x, weight, bias, stats, y, outer, channels, inner, relu);
}

inline void batch_norm_grad_sums(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                 const Tensor& save_mean, const Tensor& save_invstd,
                                 const Tensor& relu_out, const Tensor& sums, std::int64_t outer,
                                 std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  check(!relu_out.defined(), "batch_norm_grad_sums on the GPU takes the gradient masked by a ",
        "fused ReLU already (relu_out must be undefined)");
  double* out = statistics_data(sums, 2 * channels, true, "batch_norm_grad_sums");
  b::check_like_x(x, grad_y, "grad_y", "batch_norm_grad_sums");
  if (channels == 0) return;
  b::grad_sums(ctx, x, grad_y, save_mean, save_invstd, out, Tensor(), Tensor(), outer, channels,
               inner);
}

// A group of one's gradient sums, with its weight and bias gradients written by the same fold.
inline void batch_norm_local_grad_sums(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                       const Tensor& save_mean, const Tensor& save_invstd,
                                       const Tensor& sums, const Tensor& grad_weight,
                                       const Tensor& grad_bias, std::int64_t outer,
                                       std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  double* out = statistics_data(sums, 2 * channels, true, "batch_norm_local_grad_sums");
  b::check_like_x(x, grad_y, "grad_y", "batch_norm_local_grad_sums");
  check(grad_weight.defined() && grad_bias.defined() && grad_weight.is_contiguous() &&
            grad_bias.is_contiguous() && grad_weight.dtype() == save_mean.dtype() &&
            grad_bias.dtype() == save_mean.dtype() && grad_weight.numel() == channels &&
            grad_bias.numel() == channels,
        "batch_norm_local_grad_sums: grad_weight and grad_bias must be contiguous [", channels,
        "] tensors of the statistics' dtype");
  if (channels == 0) return;
  b::grad_sums(ctx, x, grad_y, save_mean, save_invstd, out, grad_weight, grad_bias, outer, channels,
               inner);
}

inline void batch_norm_input_grad(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                  const Tensor& weight, const Tensor& save_mean,
                                  const Tensor& save_invstd, const Tensor& relu_out,
                                  const Tensor& sums, const Tensor& count, const Tensor& grad_x,
                                  std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  check(!relu_out.defined(), "batch_norm_input_grad on the GPU takes the gradient masked by a ",
        "fused ReLU already (relu_out must be undefined)");
  const double* s = statistics_data(sums, 2 * channels, true, "batch_norm_input_grad");
  // (count undefined: the values per channel are this batch's own, outer · inner)
  const double* total =
      count.defined() ? statistics_data(count, 1, true, "batch_norm_input_grad") : nullptr;
  b::check_like_x(x, grad_y, "grad_y", "batch_norm_input_grad");
  b::check_like_x(x, grad_x, "grad_x", "batch_norm_input_grad");
  b::check_layout(x, inner, "batch_norm_input_grad");
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_input_grad", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_input_grad", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      const std::initializer_list<const void*> operands = {x.data_ptr(), grad_y.data_ptr(),
                                                           grad_x.data_ptr()};
      b::with_map_runs<T>(channels, inner, operands, [&]<int Per, bool Across>() {
        b::input_grad_kernel<T, S, Per, Across>
            <<<grid_for(n / Per), kThreadsPerBlock, 0, ctx.stream()>>>(
                static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
                b::stat_data<S>(weight), b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd),
                s, total, static_cast<T*>(grad_x.data_ptr()), n, channels, inner);
      });
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::input_grad_kernel");
    });
  });
}

}  // namespace shardkit::autograd::cuda_kernels
