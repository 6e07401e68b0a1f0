// Training-mode batch-norm on the GPU, in steps (autograd/norm.hpp runs them; SyncBatchNorm
// exchanges between them): per-channel moments, the statistics folded from them (a group's
// members in rank order, or one rank's alone), the affine map, the gradient sums and the input
// gradient. Sums are double, each made in a fixed order, so repeated runs give the same bits;
// the folding and the per-channel statistics are batch_norm_stats.hpp's functions, the CPU's own.
//
// The moments and the gradient sums split each channel's [outer, inner] values into parts of
// whole rows (about 4096 values), a block each: a part's count, mean and squared deviations (two
// passes over the part, the second from cache), or its sums of g and g·(x - mean); a second
// kernel folds the parts in order (Chan's update, or plain sums). One block per channel, as
// these kernels first were, left a 64-channel layer of 256 x 32² images on 64 of an H200's 132
// SMs; so does cuDNN's NCHW batch-norm, which took 383 us for the backward of that layer (67 MB
// of x, of g and of the input gradient: 50 us of copy) and set the pace of the ResNet-18 step.
// The element-wise maps take four values of a row a thread, their channel found once.
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/batch_norm_stats.hpp"

namespace shardkit::autograd::cuda_kernels {

namespace batch_norm_sync {

// Channel c's values split into parts of whole rows: part p is rows [p·rows, (p + 1)·rows) of
// its [outer, inner] values (the last part may be short).
struct ChannelParts {
  std::int64_t rows = 1, parts = 1;
};
inline ChannelParts channel_parts(std::int64_t outer, std::int64_t inner) {
  constexpr std::int64_t kPartValues = 4096;  // 16 a thread: enough in flight, many blocks
  ChannelParts p;
  p.rows = inner >= kPartValues ? 1 : std::min<std::int64_t>(outer, kPartValues / inner);
  if (p.rows < 1) p.rows = 1;
  p.parts = outer > 0 ? (outer + p.rows - 1) / p.rows : 1;
  return p;
}

// Calls fn(k, offset) for this thread's values of block `part` of channel c (k: the value's
// index within the part, offset: its element offset in x), threads striding over the part.
template <class Fn>
SK_DEVICE SK_INLINE std::int64_t for_part_values(std::int64_t c, std::int64_t part,
                                                 const ChannelParts& parts, std::int64_t outer,
                                                 std::int64_t channels, std::int64_t inner,
                                                 Fn&& fn) {
  const std::int64_t row0 = part * parts.rows;
  const std::int64_t rows = row0 + parts.rows <= outer ? parts.rows : outer - row0;
  const std::int64_t count = rows * inner;
  if (count < (std::int64_t{1} << 31) && inner < (std::int64_t{1} << 31)) {
    const auto in = static_cast<std::uint32_t>(inner);  // (32-bit division is the cheap one)
    for (std::uint32_t k = threadIdx.x; k < static_cast<std::uint32_t>(count); k += blockDim.x) {
      const std::uint32_t r = k / in;
      fn(((row0 + r) * channels + c) * inner + (k - r * in));
    }
  } else {
    for (std::int64_t k = threadIdx.x; k < count; k += blockDim.x)
      fn(((row0 + k / inner) * channels + c) * inner + k % inner);
  }
  return count;
}

// Per part: {count, mean, sum of squared deviations from that mean}, at partials[3·block].
template <class T>
__global__ void moments_parts_kernel(const T* x, double* partials, ChannelParts parts,
                                     std::int64_t outer, std::int64_t channels,
                                     std::int64_t inner) {
  const std::int64_t c = blockIdx.x / parts.parts, part = blockIdx.x % parts.parts;
  double sum = 0;
  const std::int64_t n =
      for_part_values(c, part, parts, outer, channels, inner,
                      [&](std::int64_t i) { sum += double(load<Acc<T>>(x, i)); });
  const double mean = block_sum(sum) / double(n);
  double m2 = 0;
  for_part_values(c, part, parts, outer, channels, inner, [&](std::int64_t i) {
    const double d = double(load<Acc<T>>(x, i)) - mean;
    m2 += d * d;
  });
  m2 = block_sum(m2);
  if (threadIdx.x == 0) {
    partials[3 * blockIdx.x] = double(n);
    partials[3 * blockIdx.x + 1] = mean;
    partials[3 * blockIdx.x + 2] = m2;
  }
}

// One thread per channel: its parts folded in order into moments = {count, means, m2s}.
template <int = 0>
__global__ void moments_fold_kernel(const double* partials, std::int64_t parts,
                                    std::int64_t channels, double count, double* moments) {
  for (std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; c < channels;
       c += std::int64_t{gridDim.x} * blockDim.x) {
    ChannelMoments m;
    for (std::int64_t p = 0; p < parts; ++p) {
      const double* part = partials + 3 * (c * parts + p);
      fold_moments(m, part[0], part[1], part[2]);
    }
    moments[1 + c] = m.mean;
    moments[1 + channels + c] = m.m2;
    if (c == 0) moments[0] = count;
  }
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

// Calls fn(i, c) for each run of Per consecutive elements i.. of one row (Per divides inner),
// a thread each, c their channel: found once a run, by 32-bit division where the sizes allow.
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

template <class T, class S, int Per>
__global__ void apply_kernel(const T* x, const S* weight, const S* bias, const double* stats, T* y,
                             std::int64_t n, std::int64_t channels, std::int64_t inner, bool relu) {
  using A = Acc<T>;
  for_row_runs<Per>(n, channels, inner, [&](std::int64_t i, std::int64_t c) {
    // In double, rounded once, as the CPU's affine map (a float shift would lose the mean's
    // low bits when |mean| is large against the spread).
    const double scale = double(weight[c]) * stats[channels + c];
    const double shift = double(bias[c]) - stats[c] * scale;
    A v[Per];
    SK_UNROLL
    for (int k = 0; k < Per; ++k) v[k] = load<A>(x, i + k);
    SK_UNROLL
    for (int k = 0; k < Per; ++k) {
      const A out = A(double(v[k]) * scale + shift);
      store(y, i + k, relu && !(out > A(0)) ? A(0) : out);
    }
  });
}

// Per part: {sum of g, sum of g·(x - mean)}, at partials[2·block].
template <class T, class S>
__global__ void grad_sums_parts_kernel(const T* x, const T* grad_y, const S* save_mean,
                                       double* partials, ChannelParts parts, std::int64_t outer,
                                       std::int64_t channels, std::int64_t inner) {
  const std::int64_t c = blockIdx.x / parts.parts, part = blockIdx.x % parts.parts;
  const double mean = double(save_mean[c]);
  double sum_g = 0, sum_gx = 0;
  for_part_values(c, part, parts, outer, channels, inner, [&](std::int64_t i) {
    const double g = double(load<Acc<T>>(grad_y, i));
    sum_g += g;
    sum_gx += g * (double(load<Acc<T>>(x, i)) - mean);
  });
  sum_g = block_sum(sum_g);
  sum_gx = block_sum(sum_gx);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = sum_g;
    partials[2 * blockIdx.x + 1] = sum_gx;
  }
}

// One thread per channel: its parts' sums added in order; sums = {sum g, sum g·xhat}.
template <class S>
__global__ void grad_sums_fold_kernel(const double* partials, std::int64_t parts,
                                      const S* save_invstd, std::int64_t channels, double* sums) {
  for (std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; c < channels;
       c += std::int64_t{gridDim.x} * blockDim.x) {
    double sum_g = 0, sum_gx = 0;
    for (std::int64_t p = 0; p < parts; ++p) {
      sum_g += partials[2 * (c * parts + p)];
      sum_gx += partials[2 * (c * parts + p) + 1];
    }
    sums[c] = sum_g;
    sums[channels + c] = sum_gx * double(save_invstd[c]);
  }
}

template <class T, class S, int Per>
__global__ void input_grad_kernel(const T* x, const T* grad_y, const S* weight, const S* save_mean,
                                  const S* save_invstd, const double* sums, const double* count,
                                  T* grad_x, std::int64_t n, std::int64_t channels,
                                  std::int64_t inner) {
  using A = Acc<T>;
  const double total = count != nullptr ? *count : double(n / channels);  // (null: this batch's)
  for_row_runs<Per>(n, channels, inner, [&](std::int64_t i, std::int64_t c) {
    const double mean = double(save_mean[c]), invstd = double(save_invstd[c]);
    const double k = double(weight[c]) * invstd / total;
    A xs[Per], gs[Per];
    SK_UNROLL
    for (int j = 0; j < Per; ++j) xs[j] = load<A>(x, i + j), gs[j] = load<A>(grad_y, i + j);
    SK_UNROLL
    for (int j = 0; j < Per; ++j) {
      const double xhat = (double(xs[j]) - mean) * invstd;
      store(grad_x, i + j, A(k * (total * double(gs[j]) - sums[c] - xhat * sums[channels + c])));
    }
  });
}

// Calls fn(S{}) for the statistics dtypes (f32, f64).
template <class Fn>
void visit_stat(DType dtype, const char* op, Fn&& fn) {
  if (dtype == DType::f32) return fn(float{});
  if (dtype == DType::f64) return fn(double{});
  fail<InvalidArgument>(op, ": batch-norm statistics are f32 or f64, got ", dtype_name(dtype));
}

// The element-wise operands of a step: contiguous, on the GPU, of x's dtype.
inline void check_like_x(const Tensor& x, const Tensor& t, const char* what, const char* op) {
  check(t.defined() && t.dtype() == x.dtype() && t.numel() == x.numel() && t.is_contiguous() &&
            t.device().is_cuda() && x.is_contiguous() && x.device().is_cuda(),
        op, ": ", what, " must be a contiguous GPU tensor of x's dtype and size, like x");
}

template <class S>
S* stat_data(const Tensor& t) {
  return t.defined() ? static_cast<S*>(t.data_ptr()) : nullptr;
}

}  // namespace batch_norm_sync

inline void batch_norm_moments(Context& ctx, const Tensor& x, const Tensor& moments,
                               std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  namespace b = batch_norm_sync;
  double* out = statistics_data(moments, 1 + 2 * channels, true, "batch_norm_moments");
  if (channels == 0) return;
  const b::ChannelParts parts = b::channel_parts(outer, inner);
  // (Stream-ordered scratch, freed after the fold reads it.)
  Tensor partials = empty(ctx, {3 * channels * parts.parts}, DType::f64, MemoryCategory::other);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_moments", [&](auto tag) {
    using T = decltype(tag);
    b::moments_parts_kernel<T>
        <<<row_grid(channels * parts.parts), kThreadsPerBlock, 0, ctx.stream()>>>(
            static_cast<const T*>(x.data_ptr()), partials.data<double>(), parts, outer, channels,
            inner);
    SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_parts_kernel");
  });
  b::moments_fold_kernel<><<<grid_for(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
      partials.data<double>(), parts.parts, channels, double(outer * inner), out);
  SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_fold_kernel");
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
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_apply", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_apply", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      auto launch = [&]<int Per>() {
        b::apply_kernel<T, S, Per><<<grid_for(n / Per), kThreadsPerBlock, 0, ctx.stream()>>>(
            static_cast<const T*>(x.data_ptr()), b::stat_data<S>(weight), b::stat_data<S>(bias), s,
            static_cast<T*>(y.data_ptr()), n, channels, inner, relu);
      };
      inner % 4 == 0 ? launch.template operator()<4>() : launch.template operator()<1>();
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::apply_kernel");
    });
  });
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
  const b::ChannelParts parts = b::channel_parts(outer, inner);
  Tensor partials = empty(ctx, {2 * channels * parts.parts}, DType::f64, MemoryCategory::other);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_grad_sums", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(save_mean.dtype(), "batch_norm_grad_sums", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      b::grad_sums_parts_kernel<T, S>
          <<<row_grid(channels * parts.parts), kThreadsPerBlock, 0, ctx.stream()>>>(
              static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
              b::stat_data<S>(save_mean), partials.data<double>(), parts, outer, channels, inner);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_parts_kernel");
      b::grad_sums_fold_kernel<S><<<grid_for(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          partials.data<double>(), parts.parts, b::stat_data<S>(save_invstd), channels, out);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_fold_kernel");
    });
  });
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
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_input_grad", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_input_grad", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      auto launch = [&]<int Per>() {
        b::input_grad_kernel<T, S, Per><<<grid_for(n / Per), kThreadsPerBlock, 0, ctx.stream()>>>(
            static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
            b::stat_data<S>(weight), b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd), s,
            total, static_cast<T*>(grad_x.data_ptr()), n, channels, inner);
      };
      inner % 4 == 0 ? launch.template operator()<4>() : launch.template operator()<1>();
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::input_grad_kernel");
    });
  });
}

}  // namespace shardkit::autograd::cuda_kernels
