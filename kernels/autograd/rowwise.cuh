// Row-wise autograd kernels over the last dimension: softmax / log-softmax and L2 normalisation,
// forward and backward, one block per row.
#pragma once

#include "kernels/autograd/common.cuh"

namespace shardkit::autograd::cuda_kernels {

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
__global__ void softmax_backward_kernel(const T* y, const T* gy, T* gx, std::int64_t cols,
                                        bool log) {
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

// In double, as the host's kernel (cpu_kernels.hpp): squares of f32 values above ~1.8e19 would
// overflow an f32 sum, and the quotient rounds once to T from the exact double.
template <class T>
__global__ void l2_normalize_forward_kernel(const T* x, T* y, Acc<T>* norms, std::int64_t cols,
                                            double eps) {
  const std::int64_t at = blockIdx.x * cols;
  double sq = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const double v = load<double>(x, at + c);
    sq += v * v;
  }
  const double norm = sqrt(block_sum(sq));
  if (threadIdx.x == 0) norms[blockIdx.x] = static_cast<Acc<T>>(norm);
  // std::max(norm, eps) as the host's: a NaN norm stays NaN and so does its row (PyTorch's
  // clamp_min too), where `norm > eps ? norm : eps` divided it by eps.
  const double denom = norm < eps ? eps : norm;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    store(y, at + c, load<double>(x, at + c) / denom);
}

template <class T>
__global__ void l2_normalize_backward_kernel(const T* y, const Acc<T>* norms, const T* gy, T* gx,
                                             std::int64_t cols, double eps) {
  const std::int64_t at = blockIdx.x * cols;
  const double norm = norms[blockIdx.x];
  double dot = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += load<double>(gy, at + c) * load<double>(y, at + c);
  dot = block_sum(dot);
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const double g = load<double>(gy, at + c);
    store(gx, at + c, norm <= eps ? g / eps : (g - load<double>(y, at + c) * dot) / norm);
  }
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

inline void l2_normalize_forward(Context& ctx, const Tensor& x, const Tensor& y,
                                 const Tensor& norms, std::int64_t rows, std::int64_t cols,
                                 double eps) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "l2_normalize", [&](auto tag) {
    using T = decltype(tag);
    l2_normalize_forward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()),
        static_cast<Acc<T>*>(norms.data_ptr()), cols, eps);
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
        static_cast<const T*>(grad_y.data_ptr()), static_cast<T*>(grad_x.data_ptr()), cols, eps);
    SK_CUDA_CHECK_LAUNCH("l2_normalize_backward_kernel");
  });
}

}  // namespace shardkit::autograd::cuda_kernels
