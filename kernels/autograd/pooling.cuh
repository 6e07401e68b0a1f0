// Pooling: max-pooling with a recorded maximum per window, and adaptive average pooling
// (PyTorch's window boundaries); each backward gathers into an input from the windows holding
// it (no atomics: the same bits every run).
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/max_pool_windows.hpp"
#include "shardkit/core/channels_last.hpp"

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

// A 2-D grid over (positions of a plane, planes), each a grid-stride loop.
#define SK_PLANE_LOOP(q, j, per_plane, planes)                                             \
  for (std::int64_t q = blockIdx.y; q < (planes); q += gridDim.y)                          \
    for (int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); j < (per_plane); \
         j += static_cast<int>(gridDim.x * blockDim.x))

// A thread per output: its window's maximum as the CPU takes it, and where it lies as an offset
// in the window (max_pool_windows.hpp; u8 up to 256 values a window, else i32) unless `at` is
// null (no gradient wanted).
template <class T, class O, bool ChannelsLast>
__global__ void max_pool_forward_kernel(const T* x, T* y, O* at, MaxPoolShape s) {
  const int per_plane = s.OH * s.OW * s.channels;
  SK_PLANE_LOOP(q, j, per_plane, s.planes) {
    const PlanePosition o = plane_position<ChannelsLast>(j, s.OW, s.channels);
    const WindowMax<Acc<T>> m = window_max<Acc<T>>(
        x + q * (std::int64_t{s.H} * s.W * s.channels) + o.channel, s, o.row, o.column);
    store(y, q * per_plane + j, m.value);
    if (at != nullptr) at[q * per_plane + j] = static_cast<O>(m.at);
  }
}

// A thread per input: the gradients of the windows whose maximum it was, added in the CPU's
// order (max_pool_windows.hpp), so f32 and f64 give the CPU's bits and the half types its f32
// sums rounded once.
template <class T, class O, bool ChannelsLast>
__global__ void max_pool_backward_kernel(const T* gy, const O* at, T* gx, MaxPoolShape s) {
  const int per_plane = s.H * s.W * s.channels;
  SK_PLANE_LOOP(q, j, per_plane, s.planes) {
    const PlanePosition i = plane_position<ChannelsLast>(j, s.W, s.channels);
    const std::int64_t outputs = q * (std::int64_t{s.OH} * s.OW * s.channels) + i.channel;
    store(gx, q * per_plane + j,
          gathered_gradient<Acc<T>>(gy + outputs, at + outputs, s, i.row, i.column));
  }
}

#undef SK_PLANE_LOOP
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

// Whether a max-pool's tensors are channels-last (x, y, argmax and the gradients alike, as the
// autograd op allocates them) or contiguous NCHW; refused otherwise. (A tensor whose two
// layouts are the same memory -- one channel, or 1 x 1 planes -- is read alike either way.)
// Undefined tensors (no argmax without a gradient) are skipped.
inline bool max_pool_channels_last(const char* op, std::initializer_list<const Tensor*> tensors) {
  const bool channels_last = !(*tensors.begin())->is_contiguous();
  for (const Tensor* t : tensors)
    check(!t->defined() ||
              (t->dim() == 4 && (channels_last ? is_channels_last(*t) : t->is_contiguous())),
          op, ": tensor ", shape_text(t->shape()), " is not ",
          channels_last ? "channels-last like the input" : "contiguous like the input",
          "; a max-pool's tensors share one dense layout");
  return channels_last;
}

inline MaxPoolShape max_pool_shape(const Tensor& in, const Tensor& out, const cpu::PoolGeometry& p,
                                   bool channels_last, const char* op) {
  check(out.dtype() == in.dtype(), op, ": ", dtype_name(out.dtype()), " against ",
        dtype_name(in.dtype()), "; the input, the output and their gradients share one dtype");
  const std::int64_t C = in.size(1), H = in.size(2), W = in.size(3);
  const std::int64_t OH = out.size(2), OW = out.size(3);
  const std::int64_t lanes = channels_last ? C : 1;
  // (autograd's max_pool2d pools a channels-last image of more values plane by plane)
  check(H * W * lanes <= kMaxPoolPlaneValues && OH * OW * lanes <= kMaxPoolPlaneValues, op, ": ",
        channels_last ? "an image" : "a plane", " of ", shape_text(in.shape()), " has over ",
        kMaxPoolPlaneValues, " values; the GPU's max-pool takes at most that many a plane");
  return {in.size(0) * (channels_last ? 1 : C),
          int(H),
          int(W),
          int(OH),
          int(OW),
          int(lanes),
          int(p.kernel_h),
          int(p.kernel_w),
          int(p.stride_h),
          int(p.stride_w),
          int(p.pad_h),
          int(p.pad_w)};
}

// Calls fn(O{}, std::bool_constant<ChannelsLast>) for argmax's offset dtype (u8 or i32, as the
// autograd op chose by the window's size; u8 where argmax is undefined) and the layout.
template <class Fn>
void with_max_pool_operands(const Tensor& argmax, const cpu::PoolGeometry& p, bool channels_last,
                            const char* op, Fn&& fn) {
  const auto layout = [&](auto offset) {
    if (channels_last) return fn(offset, std::true_type{});
    fn(offset, std::false_type{});
  };
  if (!argmax.defined()) return layout(std::uint8_t{});
  if (argmax.dtype() == DType::u8) {
    check(p.kernel_h * p.kernel_w <= 256, op, ": a ", p.kernel_h, " x ", p.kernel_w,
          " window's offsets do not fit u8 argmax; record them as i32");
    return layout(std::uint8_t{});
  }
  check(argmax.dtype() == DType::i32, op, ": argmax is ", dtype_name(argmax.dtype()),
        "; the GPU records window offsets as u8 or i32");
  layout(std::int32_t{});
}

inline dim3 max_pool_grid(const MaxPoolShape& s, std::int64_t per_plane) {
  const std::int64_t x = (per_plane + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return dim3(static_cast<unsigned>(std::clamp<std::int64_t>(x, 1, 65535)),
              static_cast<unsigned>(std::clamp<std::int64_t>(s.planes, 1, 65535)));
}

// y (x's dtype, shape [N, C, OH, OW]) and, where defined, argmax (u8 or i32, y's shape), all in
// x's layout.
inline void max_pool_forward(Context& ctx, const Tensor& x, const Tensor& y, const Tensor& argmax,
                             const cpu::PoolGeometry& p) {
  if (y.numel() == 0) return;
  const char* op = "max_pool2d";
  const bool channels_last = max_pool_channels_last(op, {&x, &y, &argmax});
  const MaxPoolShape s = max_pool_shape(x, y, p, channels_last, op);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    with_max_pool_operands(argmax, p, channels_last, op, [&](auto offset, auto layout) {
      using O = decltype(offset);
      max_pool_forward_kernel<T, O, decltype(layout)::value>
          <<<max_pool_grid(s, std::int64_t{s.OH} * s.OW * s.channels), kThreadsPerBlock, 0,
             ctx.stream()>>>(static_cast<const T*>(x.data_ptr()), static_cast<T*>(y.data_ptr()),
                             argmax.defined() ? static_cast<O*>(argmax.data_ptr()) : nullptr, s);
    });
    SK_CUDA_CHECK_LAUNCH("max_pool_forward_kernel");
  });
}

// grad_x (every element written) from grad_y and forward's argmax, all in one layout.
inline void max_pool_backward(Context& ctx, const Tensor& argmax, const Tensor& grad_y,
                              const Tensor& grad_x, const cpu::PoolGeometry& p) {
  if (grad_x.numel() == 0) return;
  const char* op = "max_pool2d backward";
  check(argmax.defined(), op, ": no argmax; the forward records one where a gradient is wanted");
  const bool channels_last = max_pool_channels_last(op, {&grad_x, &grad_y, &argmax});
  const MaxPoolShape s = max_pool_shape(grad_x, grad_y, p, channels_last, op);
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(grad_x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    with_max_pool_operands(argmax, p, channels_last, op, [&](auto offset, auto layout) {
      using O = decltype(offset);
      max_pool_backward_kernel<T, O, decltype(layout)::value>
          <<<max_pool_grid(s, std::int64_t{s.H} * s.W * s.channels), kThreadsPerBlock, 0,
             ctx.stream()>>>(static_cast<const T*>(grad_y.data_ptr()),
                             static_cast<const O*>(argmax.data_ptr()),
                             static_cast<T*>(grad_x.data_ptr()), s);
    });
    SK_CUDA_CHECK_LAUNCH("max_pool_backward_kernel");
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
