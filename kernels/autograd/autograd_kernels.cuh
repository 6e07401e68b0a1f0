// CUDA kernels behind autograd's function table (element-wise, per-channel, row-wise and
// adaptive-pool ops), the table itself, and how a CUDA Context gets it. Half types load and
// store as f16/bf16 and compute in f32; double stays double. Reductions are deterministic (one
// block per row or channel, fixed tree order), so repeated runs give the same bits.
#pragma once

#include <memory>

#include "kernels/core/tensor_kernels.cuh"
#include "shardkit/autograd/device_table.hpp"

namespace shardkit::autograd::cuda_kernels {

using shardkit::cuda::grid_for;
using shardkit::cuda::kThreadsPerBlock;

// The compute type of each storage type.
template <class T> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<double> { using type = double; };
template <class T>
using Acc = typename AccumulatorOf<T>::type;

template <class A, class T>
SK_DEVICE SK_INLINE A load(const T* p, std::int64_t i) { return convert_value<A>(p[i]); }
template <class T, class A>
SK_DEVICE SK_INLINE void store(T* p, std::int64_t i, A v) { p[i] = convert_value<T>(v); }

// Sum over the block (blockDim.x == kThreadsPerBlock); every thread gets the result.
template <class A>
SK_DEVICE A block_sum(A value) {
  __shared__ A partial[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < kThreadsPerBlock / 32; ++w) total += partial[w];
  return total;
}

template <class A>
SK_DEVICE A block_max(A value) {
  __shared__ A partial[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    const A other = __shfl_down_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  A best = partial[0];
  for (int w = 1; w < kThreadsPerBlock / 32; ++w) best = partial[w] > best ? partial[w] : best;
  return best;
}

#define SK_GRID_LOOP(i, n)                                                          \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += std::int64_t{gridDim.x} * blockDim.x)

template <class T>
__global__ void pointwise_kernel(Pointwise op, T* out, const T* a, const T* b, std::int64_t n,
                                 Acc<T> alpha, Acc<T> beta) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) {
    const A x = load<A>(a, i);
    A r = 0;
    switch (op) {
      case Pointwise::axpby: r = b == nullptr ? alpha * x : alpha * x + beta * load<A>(b, i); break;
      case Pointwise::mul: r = alpha * x * load<A>(b, i); break;
      case Pointwise::relu: r = x > A(0) ? x : A(0); break;
      case Pointwise::relu_backward: r = load<A>(b, i) > A(0) ? x : A(0); break;
    }
    store(out, i, r);
  }
}

template <class T, class O>
__global__ void channel_sum_kernel(const T* x, O* out, std::int64_t outer, std::int64_t channels,
                                   std::int64_t inner) {
  using A = Acc<T>;
  const std::int64_t c = blockIdx.x;
  A sum = 0;
  for (std::int64_t j = threadIdx.x; j < outer * inner; j += blockDim.x) {
    const std::int64_t o = j / inner, i = j % inner;
    sum += load<A>(x, (o * channels + c) * inner + i);
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) store(out, c, sum);
}

template <class T>
__global__ void channel_bias_add_kernel(T* y, const T* bias, std::int64_t n, std::int64_t channels,
                                        std::int64_t inner) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) { store(y, i, load<A>(y, i) + load<A>(bias, (i / inner) % channels)); }
}

template <class T>
__global__ void softmax_forward_kernel(const T* x, T* y, std::int64_t cols, bool log) {
  using A = Acc<T>;
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  A max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A v = load<A>(xr, c);
    max = v > max ? v : max;
  }
  max = block_max(max);
  A sum = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += exp(load<A>(xr, c) - max);
  sum = block_sum(sum);
  const A log_sum = ::log(sum);
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A shifted = load<A>(xr, c) - max;
    store(yr, c, log ? shifted - log_sum : exp(shifted) / sum);
  }
}

template <class T>
__global__ void softmax_backward_kernel(const T* y, const T* gy, T* gx, std::int64_t cols, bool log) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  A dot = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += log ? load<A>(gy, at + c) : load<A>(gy, at + c) * load<A>(y, at + c);
  dot = block_sum(dot);
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A out = load<A>(y, at + c), g = load<A>(gy, at + c);
    store(gx, at + c, log ? g - exp(out) * dot : out * (g - dot));
  }
}

template <class T>
__global__ void l2_normalize_forward_kernel(const T* x, T* y, Acc<T>* norms, std::int64_t cols,
                                            Acc<T> eps) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  A sq = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A v = load<A>(x, at + c);
    sq += v * v;
  }
  const A norm = sqrt(block_sum(sq));
  if (threadIdx.x == 0) norms[blockIdx.x] = norm;
  const A denom = norm > eps ? norm : eps;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) store(y, at + c, load<A>(x, at + c) / denom);
}

template <class T>
__global__ void l2_normalize_backward_kernel(const T* y, const Acc<T>* norms, const T* gy, T* gx,
                                             std::int64_t cols, Acc<T> eps) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  const A norm = norms[blockIdx.x];
  A dot = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += load<A>(gy, at + c) * load<A>(y, at + c);
  dot = block_sum(dot);
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A g = load<A>(gy, at + c);
    store(gx, at + c, norm <= eps ? g / eps : (g - load<A>(y, at + c) * dot) / norm);
  }
}

// One block per row: log-softmax of the row and the row's loss.
template <class T>
__global__ void cross_entropy_rows_kernel(const T* x, const void* target, bool hard, T* log_probs,
                                          Acc<T>* row_loss, std::int64_t cols) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  A max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A v = load<A>(x, at + c);
    max = v > max ? v : max;
  }
  max = block_max(max);
  A sum = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += exp(load<A>(x, at + c) - max);
  const A log_sum = ::log(block_sum(sum));
  A loss = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A lp = load<A>(x, at + c) - max - log_sum;
    store(log_probs, at + c, lp);
    if (!hard) loss -= load<A>(static_cast<const T*>(target), at + c) * lp;
  }
  loss = block_sum(loss);
  if (threadIdx.x == 0) {
    if (hard) {
      const std::int64_t label = static_cast<const std::int64_t*>(target)[blockIdx.x];
      loss = -(load<A>(x, at + label) - max - log_sum);
    }
    row_loss[blockIdx.x] = loss;
  }
}

// One block: the mean of the row losses, in a fixed order.
template <class A>
__global__ void mean_kernel(const A* values, A* out, std::int64_t n) {
  A sum = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out = sum / A(n);
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* log_probs, const void* target, bool hard,
                                              const Acc<T>* grad_loss, T* gx, std::int64_t rows,
                                              std::int64_t cols) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  const A scale = *grad_loss / A(rows);
  A mass = 1;
  if (!hard) {
    A m = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m += load<A>(static_cast<const T*>(target), at + c);
    mass = block_sum(m);
  }
  const std::int64_t label = hard ? static_cast<const std::int64_t*>(target)[blockIdx.x] : -1;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A p = exp(load<A>(log_probs, at + c));
    const A t = hard ? A(c == label ? 1 : 0) : load<A>(static_cast<const T*>(target), at + c);
    store(gx, at + c, scale * (p * mass - t));
  }
}

SK_DEVICE SK_INLINE std::int64_t window_start(std::int64_t i, std::int64_t in, std::int64_t out) {
  return (i * in) / out;
}
SK_DEVICE SK_INLINE std::int64_t window_end(std::int64_t i, std::int64_t in, std::int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

template <class T>
__global__ void adaptive_avg_pool_forward_kernel(const T* x, T* y, std::int64_t planes,
                                                 std::int64_t H, std::int64_t W, std::int64_t OH,
                                                 std::int64_t OW) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, planes * OH * OW) {
    const std::int64_t ow = i % OW, oh = (i / OW) % OH, p = i / (OH * OW);
    const auto h0 = window_start(oh, H, OH), h1 = window_end(oh, H, OH);
    const auto w0 = window_start(ow, W, OW), w1 = window_end(ow, W, OW);
    A sum = 0;
    for (auto h = h0; h < h1; ++h)
      for (auto w = w0; w < w1; ++w) sum += load<A>(x, (p * H + h) * W + w);
    store(y, i, sum / A((h1 - h0) * (w1 - w0)));
  }
}

// Each input element gathers from the output windows that contain it (no atomics).
template <class T>
__global__ void adaptive_avg_pool_backward_kernel(const T* gy, T* gx, std::int64_t planes,
                                                  std::int64_t H, std::int64_t W, std::int64_t OH,
                                                  std::int64_t OW) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, planes * H * W) {
    const std::int64_t w = i % W, h = (i / W) % H, p = i / (H * W);
    const std::int64_t oh_first = (h * OH) / H, ow_first = (w * OW) / W;
    A sum = 0;
    for (std::int64_t oh = oh_first > 0 ? oh_first - 1 : 0; oh < OH; ++oh) {
      const auto h0 = window_start(oh, H, OH), h1 = window_end(oh, H, OH);
      if (h0 > h) break;
      if (h >= h1) continue;
      for (std::int64_t ow = ow_first > 0 ? ow_first - 1 : 0; ow < OW; ++ow) {
        const auto w0 = window_start(ow, W, OW), w1 = window_end(ow, W, OW);
        if (w0 > w) break;
        if (w >= w1) continue;
        sum += load<A>(gy, (p * OH + oh) * OW + ow) / A((h1 - h0) * (w1 - w0));
      }
    }
    store(gx, i, sum);
  }
}

template <class T, class S>
__global__ void batch_norm_eval_backward_kernel(const T* x, const T* gy, const S* weight,
                                                const S* mean, const S* var, Acc<T> eps, T* gx,
                                                T* gy_xhat, std::int64_t n, std::int64_t channels,
                                                std::int64_t inner) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) {
    const std::int64_t c = (i / inner) % channels;
    const A invstd = A(1) / sqrt(load<A>(var, c) + eps);
    const A g = load<A>(gy, i);
    if (gx != nullptr) store(gx, i, g * load<A>(weight, c) * invstd);
    store(gy_xhat, i, g * (load<A>(x, i) - load<A>(mean, c)) * invstd);
  }
}

#undef SK_GRID_LOOP

// Calls fn(T{}) for the floating dtypes the kernels take.
template <class Fn>
void visit_floating(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case DType::f32: return fn(float{});
    case DType::f64: return fn(double{});
    case DType::f16: return fn(Half{});
    case DType::bf16: return fn(BFloat16{});
    default: break;
  }
  fail<InvalidArgument>(op, " on the GPU takes f32, f64, f16 or bf16, got ", dtype_name(dtype));
}

inline unsigned row_grid(std::int64_t rows) {
  check(rows < (std::int64_t{1} << 31), "row-wise kernel: ", rows, " rows exceed the grid limit");
  return static_cast<unsigned>(rows);
}

inline void pointwise(Context& ctx, Pointwise op, const Tensor& out, const Tensor& a,
                      const Tensor& b, double alpha, double beta) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(out.dtype(), "pointwise op", [&](auto tag) {
    using T = decltype(tag);
    const T* bp = b.defined() && !(op == Pointwise::axpby && beta == 0) ? static_cast<const T*>(b.data_ptr()) : nullptr;
    pointwise_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        op, static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()), bp, n,
        Acc<T>(alpha), Acc<T>(beta));
    SK_CUDA_CHECK_LAUNCH("pointwise_kernel");
  });
}

inline void channel_sum(Context& ctx, const Tensor& x, const Tensor& out, std::int64_t outer,
                        std::int64_t channels, std::int64_t inner) {
  if (channels == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "channel_sum", [&](auto tag) {
    using T = decltype(tag);
    visit_floating(out.dtype(), "channel_sum", [&](auto out_tag) {
      using O = decltype(out_tag);
      channel_sum_kernel<T, O><<<row_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<O*>(out.data_ptr()), outer, channels, inner);
      SK_CUDA_CHECK_LAUNCH("channel_sum_kernel");
    });
  });
}

inline void channel_bias_add(Context& ctx, const Tensor& y, const Tensor& bias, std::int64_t outer,
                             std::int64_t channels, std::int64_t inner) {
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(y.dtype(), "bias add", [&](auto tag) {
    using T = decltype(tag);
    channel_bias_add_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<T*>(y.data_ptr()), static_cast<const T*>(bias.data_ptr()), n, channels, inner);
    SK_CUDA_CHECK_LAUNCH("channel_bias_add_kernel");
  });
}

inline void softmax_forward(Context& ctx, const Tensor& x, const Tensor& y, std::int64_t rows,
                            std::int64_t cols, bool log) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    softmax_forward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()), cols, log);
    SK_CUDA_CHECK_LAUNCH("softmax_forward_kernel");
  });
}

inline void softmax_backward(Context& ctx, const Tensor& y, const Tensor& grad_y,
                             const Tensor& grad_x, std::int64_t rows, std::int64_t cols, bool log) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(y.dtype(), "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(y.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
        static_cast<T*>(grad_x.data_ptr()), cols, log);
    SK_CUDA_CHECK_LAUNCH("softmax_backward_kernel");
  });
}

inline void l2_normalize_forward(Context& ctx, const Tensor& x, const Tensor& y, const Tensor& norms,
                                 std::int64_t rows, std::int64_t cols, double eps) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "l2_normalize", [&](auto tag) {
    using T = decltype(tag);
    l2_normalize_forward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()),
        static_cast<Acc<T>*>(norms.data_ptr()), cols, Acc<T>(eps));
    SK_CUDA_CHECK_LAUNCH("l2_normalize_forward_kernel");
  });
}

inline void l2_normalize_backward(Context& ctx, const Tensor& y, const Tensor& norms,
                                  const Tensor& grad_y, const Tensor& grad_x, std::int64_t rows,
                                  std::int64_t cols, double eps) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(y.dtype(), "l2_normalize backward", [&](auto tag) {
    using T = decltype(tag);
    l2_normalize_backward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(y.data_ptr()), static_cast<const Acc<T>*>(norms.data_ptr()),
        static_cast<const T*>(grad_y.data_ptr()), static_cast<T*>(grad_x.data_ptr()), cols,
        Acc<T>(eps));
    SK_CUDA_CHECK_LAUNCH("l2_normalize_backward_kernel");
  });
}

inline void cross_entropy_forward(Context& ctx, const Tensor& x, const Tensor& target,
                                  const Tensor& log_probs, const Tensor& loss, std::int64_t rows,
                                  std::int64_t cols) {
  CudaDeviceGuard guard(ctx.device().index);
  const bool hard = target.dtype() == DType::i64;
  visit_floating(x.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    Tensor row_loss = empty(ctx, {rows}, dtype_of<A>, MemoryCategory::activations);
    cross_entropy_rows_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), target.data_ptr(), hard,
        static_cast<T*>(log_probs.data_ptr()), static_cast<A*>(row_loss.data_ptr()), cols);
    SK_CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel");
    mean_kernel<A><<<1, kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const A*>(row_loss.data_ptr()), static_cast<A*>(loss.data_ptr()), rows);
    SK_CUDA_CHECK_LAUNCH("mean_kernel");
  });
}

inline void cross_entropy_backward(Context& ctx, const Tensor& log_probs, const Tensor& target,
                                   const Tensor& grad_loss, const Tensor& grad_x, std::int64_t rows,
                                   std::int64_t cols) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  const bool hard = target.dtype() == DType::i64;
  visit_floating(log_probs.dtype(), "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const Tensor g = grad_loss.dtype() == dtype_of<A> ? grad_loss : cast(ctx, grad_loss, dtype_of<A>);
    cross_entropy_backward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(log_probs.data_ptr()), target.data_ptr(), hard,
        static_cast<const A*>(g.data_ptr()), static_cast<T*>(grad_x.data_ptr()), rows, cols);
    SK_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
  });
}

inline void adaptive_avg_pool_forward(Context& ctx, const Tensor& x, const Tensor& y) {
  const std::int64_t n = y.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "adaptive_avg_pool2d", [&](auto tag) {
    using T = decltype(tag);
    adaptive_avg_pool_forward_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()), x.size(0) * x.size(1),
        x.size(2), x.size(3), y.size(2), y.size(3));
    SK_CUDA_CHECK_LAUNCH("adaptive_avg_pool_forward_kernel");
  });
}

inline void adaptive_avg_pool_backward(Context& ctx, const Tensor& grad_y, const Tensor& grad_x) {
  const std::int64_t n = grad_x.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(grad_y.dtype(), "adaptive_avg_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    adaptive_avg_pool_backward_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(grad_y.data_ptr()), static_cast<T*>(grad_x.data_ptr()),
        grad_x.size(0) * grad_x.size(1), grad_x.size(2), grad_x.size(3), grad_y.size(2),
        grad_y.size(3));
    SK_CUDA_CHECK_LAUNCH("adaptive_avg_pool_backward_kernel");
  });
}

inline void batch_norm_eval_backward(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                     const Tensor& weight, const Tensor& mean, const Tensor& var,
                                     double eps, const Tensor& grad_x, const Tensor& grad_y_xhat,
                                     std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    visit_floating(weight.dtype(), "batch_norm backward", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      batch_norm_eval_backward_kernel<T, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
          static_cast<const S*>(weight.data_ptr()), static_cast<const S*>(mean.data_ptr()),
          static_cast<const S*>(var.data_ptr()), Acc<T>(eps),
          grad_x.defined() ? static_cast<T*>(grad_x.data_ptr()) : nullptr,
          static_cast<T*>(grad_y_xhat.data_ptr()), n, channels, inner);
      SK_CUDA_CHECK_LAUNCH("batch_norm_eval_backward_kernel");
    });
  });
}

}  // namespace shardkit::autograd::cuda_kernels

namespace shardkit::autograd {

// The CUDA table: constant, so no global mutable state.
inline const AutogradKernels* cuda_kernels_table() {
  namespace k = cuda_kernels;
  static constexpr AutogradKernels kTable{
      &k::pointwise,           &k::channel_sum,           &k::channel_bias_add,
      &k::softmax_forward,     &k::softmax_backward,      &k::l2_normalize_forward,
      &k::l2_normalize_backward, &k::cross_entropy_forward, &k::cross_entropy_backward,
      &k::adaptive_avg_pool_forward, &k::adaptive_avg_pool_backward,
      &k::batch_norm_eval_backward,
  };
  return &kTable;
}

// Gives a CUDA context its autograd kernels (call once, from a .cu file).
inline void install_cuda_kernels(Context& ctx) { cuda_kernel_slot(ctx).table = cuda_kernels_table(); }

// A CUDA context ready for autograd: sk::make_cuda_context plus install_cuda_kernels.
inline std::unique_ptr<Context> make_cuda_context(int device, int rank = 0, std::uint64_t seed = 0) {
  auto ctx = shardkit::make_cuda_context(device, rank, seed);
  install_cuda_kernels(*ctx);
  return ctx;
}

}  // namespace shardkit::autograd
