// Synchronised batch-norm on the GPU (SyncBatchNorm; autograd/norm.hpp runs these steps
// around its two exchanges): per-channel moments, the group's statistics folded in rank order,
// the affine map, the gradient sums and the input gradient. Sums are double, made by one block
// per channel in a fixed tree order, so repeated runs give the same bits; the folding and the
// per-channel statistics are batch_norm_stats.hpp's functions, the CPU's own. One block per
// channel reads that channel's [outer, inner] values, a row of `inner` at a time: simple, but a
// layer with few channels fills few of the GPU's SMs; splitting each channel's rows over several
// blocks (partial moments folded in a fixed order) is the step to take if a profile of a
// SyncBatchNorm run shows these passes. Their results are tested on a GPU (an H200 at 8cdb2b7);
// their speed is not yet measured.
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/batch_norm_stats.hpp"

namespace shardkit::autograd::cuda_kernels {

namespace batch_norm_sync {

// The j-th value of channel c (j over (o, i)) of x[outer, channels, inner], in double.
template <class T>
SK_DEVICE SK_INLINE double channel_value(const T* x, std::int64_t j, std::int64_t c,
                                         std::int64_t channels, std::int64_t inner) {
  const std::int64_t o = j / inner, i = j % inner;
  return double(load<Acc<T>>(x, (o * channels + c) * inner + i));
}

template <class T>
__global__ void moments_kernel(const T* x, double* moments, std::int64_t outer,
                               std::int64_t channels, std::int64_t inner) {
  const std::int64_t c = blockIdx.x, n = outer * inner;
  double sum = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x)
    sum += channel_value(x, j, c, channels, inner);
  const double mean = block_sum(sum) / double(n);
  double m2 = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const double d = channel_value(x, j, c, channels, inner) - mean;
    m2 += d * d;
  }
  m2 = block_sum(m2);
  if (threadIdx.x == 0) {
    moments[1 + c] = mean;
    moments[1 + channels + c] = m2;
    if (c == 0) moments[0] = double(n);
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

template <class T, class S>
__global__ void apply_kernel(const T* x, const S* weight, const S* bias, const double* stats, T* y,
                             std::int64_t n, std::int64_t channels, std::int64_t inner, bool relu) {
  using A = Acc<T>;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t c = (i / inner) % channels;
    // In double, rounded once, as the CPU's affine map (a float shift would lose the mean's
    // low bits when |mean| is large against the spread).
    const double scale = double(weight[c]) * stats[channels + c];
    const double shift = double(bias[c]) - stats[c] * scale;
    const A v = A(double(load<A>(x, i)) * scale + shift);
    store(y, i, relu && !(v > A(0)) ? A(0) : v);
  }
}

template <class T, class S>
__global__ void grad_sums_kernel(const T* x, const T* grad_y, const S* save_mean,
                                 const S* save_invstd, double* sums, std::int64_t outer,
                                 std::int64_t channels, std::int64_t inner) {
  const std::int64_t c = blockIdx.x, n = outer * inner;
  const double mean = double(save_mean[c]);
  double sum_g = 0, sum_gx = 0;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const double g = channel_value(grad_y, j, c, channels, inner);
    sum_g += g;
    sum_gx += g * (channel_value(x, j, c, channels, inner) - mean);
  }
  sum_g = block_sum(sum_g);
  sum_gx = block_sum(sum_gx);
  if (threadIdx.x == 0) {
    sums[c] = sum_g;
    sums[channels + c] = sum_gx * double(save_invstd[c]);
  }
}

template <class T, class S>
__global__ void input_grad_kernel(const T* x, const T* grad_y, const S* weight, const S* save_mean,
                                  const S* save_invstd, const double* sums, const double* count,
                                  T* grad_x, std::int64_t n, std::int64_t channels,
                                  std::int64_t inner) {
  using A = Acc<T>;
  const double total = *count;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t c = (i / inner) % channels;
    const double mean = double(save_mean[c]), invstd = double(save_invstd[c]);
    const double k = double(weight[c]) * invstd / total;
    const double xhat = (double(load<A>(x, i)) - mean) * invstd;
    const double g = double(load<A>(grad_y, i));
    store(grad_x, i, A(k * (total * g - sums[c] - xhat * sums[channels + c])));
  }
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
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_moments", [&](auto tag) {
    using T = decltype(tag);
    b::moments_kernel<T><<<row_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), out, outer, channels, inner);
    SK_CUDA_CHECK_LAUNCH("batch_norm_sync::moments_kernel");
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
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_apply", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_apply", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      b::apply_kernel<T, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), b::stat_data<S>(weight), b::stat_data<S>(bias), s,
          static_cast<T*>(y.data_ptr()), n, channels, inner, relu);
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
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_grad_sums", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(save_mean.dtype(), "batch_norm_grad_sums", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      b::grad_sums_kernel<T, S><<<row_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
          b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd), out, outer, channels, inner);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::grad_sums_kernel");
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
  const double* total = statistics_data(count, 1, true, "batch_norm_input_grad");
  b::check_like_x(x, grad_y, "grad_y", "batch_norm_input_grad");
  b::check_like_x(x, grad_x, "grad_x", "batch_norm_input_grad");
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm_input_grad", [&](auto tag) {
    using T = decltype(tag);
    b::visit_stat(weight.dtype(), "batch_norm_input_grad", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      b::input_grad_kernel<T, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
          b::stat_data<S>(weight), b::stat_data<S>(save_mean), b::stat_data<S>(save_invstd), s,
          total, static_cast<T*>(grad_x.data_ptr()), n, channels, inner);
      SK_CUDA_CHECK_LAUNCH("batch_norm_sync::input_grad_kernel");
    });
  });
}

}  // namespace shardkit::autograd::cuda_kernels
