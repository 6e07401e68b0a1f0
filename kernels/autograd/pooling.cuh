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

#undef SK_GRID_LOOP

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

}  // namespace shardkit::autograd::cuda_kernels
