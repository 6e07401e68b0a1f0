// Adaptive average pooling (PyTorch's window boundaries), forward and a gather-only backward.
#pragma once

#include "kernels/autograd/common.cuh"

namespace shardkit::autograd::cuda_kernels {

#define SK_GRID_LOOP(i, n)                                                            \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += std::int64_t{gridDim.x} * blockDim.x)

SK_DEVICE SK_INLINE std::int64_t window_start(std::int64_t i, std::int64_t in, std::int64_t out) {
  return (i * in) / out;
}
SK_DEVICE SK_INLINE std::int64_t window_end(std::int64_t i, std::int64_t in, std::int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

// A pooling's sizes: planes (batch x channels) of H x W in, OH x OW out.
struct PoolShape {
  std::int64_t planes, H, W, OH, OW;
};

inline PoolShape pool_shape(const Tensor& in, const Tensor& out) {
  return {in.size(0) * in.size(1), in.size(2), in.size(3), out.size(2), out.size(3)};
}

template <class T>
__global__ void adaptive_avg_pool_forward_kernel(const T* x, T* y, PoolShape s) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, s.planes * s.OH * s.OW) {
    const std::int64_t ow = i % s.OW, oh = (i / s.OW) % s.OH, p = i / (s.OH * s.OW);
    const auto h0 = window_start(oh, s.H, s.OH), h1 = window_end(oh, s.H, s.OH);
    const auto w0 = window_start(ow, s.W, s.OW), w1 = window_end(ow, s.W, s.OW);
    A sum = 0;
    for (auto h = h0; h < h1; ++h)
      for (auto w = w0; w < w1; ++w) sum += load<A>(x, (p * s.H + h) * s.W + w);
    store(y, i, sum / A((h1 - h0) * (w1 - w0)));
  }
}

// Each input element gathers from the output windows that contain it (no atomics).
template <class T>
__global__ void adaptive_avg_pool_backward_kernel(const T* gy, T* gx, PoolShape s) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, s.planes * s.H * s.W) {
    const std::int64_t w = i % s.W, h = (i / s.W) % s.H, p = i / (s.H * s.W);
    const std::int64_t oh_first = (h * s.OH) / s.H, ow_first = (w * s.OW) / s.W;
    A sum = 0;
    for (std::int64_t oh = oh_first > 0 ? oh_first - 1 : 0; oh < s.OH; ++oh) {
      const auto h0 = window_start(oh, s.H, s.OH), h1 = window_end(oh, s.H, s.OH);
      if (h0 > h) break;
      if (h >= h1) continue;
      for (std::int64_t ow = ow_first > 0 ? ow_first - 1 : 0; ow < s.OW; ++ow) {
        const auto w0 = window_start(ow, s.W, s.OW), w1 = window_end(ow, s.W, s.OW);
        if (w0 > w) break;
        if (w >= w1) continue;
        sum += load<A>(gy, (p * s.OH + oh) * s.OW + ow) / A((h1 - h0) * (w1 - w0));
      }
    }
    store(gx, i, sum);
  }
}

#undef SK_GRID_LOOP

// Launches the kernel kernel_for(T{}) returns (forward or backward: the same operands) for the
// floating dtype T of `in`, with a thread for each element of `out`.
template <class KernelFor>
void launch_pool(Context& ctx, const Tensor& in, const Tensor& out, PoolShape shape, const char* op,
                 KernelFor kernel_for) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    kernel_for(tag)<<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(in.data_ptr()), static_cast<T*>(out.data_ptr()), shape);
    ::shardkit::detail::cuda_check(cudaGetLastError(), op, __FILE__, __LINE__);
  });
}

inline void adaptive_avg_pool_forward(Context& ctx, const Tensor& x, const Tensor& y) {
  launch_pool(ctx, x, y, pool_shape(x, y), "adaptive_avg_pool2d",
              [](auto tag) { return &adaptive_avg_pool_forward_kernel<decltype(tag)>; });
}

inline void adaptive_avg_pool_backward(Context& ctx, const Tensor& grad_y, const Tensor& grad_x) {
  launch_pool(ctx, grad_y, grad_x, pool_shape(grad_x, grad_y), "adaptive_avg_pool2d backward",
              [](auto tag) { return &adaptive_avg_pool_backward_kernel<decltype(tag)>; });
}

}  // namespace shardkit::autograd::cuda_kernels
