// Cross-entropy with hard (i64 class index) or soft (probability) targets: per-row log-softmax
// and loss, their mean in a fixed order, and the backward.
#pragma once

#include "kernels/autograd/common.cuh"

namespace shardkit::autograd::cuda_kernels {

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

}  // namespace shardkit::autograd::cuda_kernels
