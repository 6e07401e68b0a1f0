// The GPU max-pool's work per thread (kernels/autograd/pooling.cuh): an output's window maximum
// and where it lies, an input's gradient gathered from the windows whose maximum it was. Host
// and device code, so that the CPU tests run exactly the kernels' window arithmetic against the
// CPU's loops (test_max_pool_windows.cpp): the GPU runs it only when one is lent.
#pragma once

#include <cstdint>

#include "shardkit/core/config.hpp"
#include "shardkit/core/dtype.hpp"

namespace shardkit::autograd {

// The most values a plane may hold (below 2^31, so that a grid-stride step past the last index
// does not overflow an int): a thread divides in 32 bits, not 64.
inline constexpr std::int64_t kMaxPoolPlaneValues = std::int64_t{1} << 30;

// A max-pool's sizes: `planes` of H x W positions into OH x OW, `channels` values side by side at
// each position (channels-last: a plane is an image and `channels` its C; NCHW: a plane is one
// channel of one image, channels 1), and the window. A plane holds at most kMaxPoolPlaneValues.
struct MaxPoolShape {
  std::int64_t planes;
  int H, W, OH, OW, channels;
  int kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w;
};

// Element j of a plane laid out as `s` says: its channel and its row and column (of the input's
// H x W, or of the output's OH x OW: `width` says which).
struct PlanePosition {
  int channel, row, column;
};
template <bool ChannelsLast>
SK_HOST_DEVICE SK_INLINE PlanePosition plane_position(int j, int width, int channels) {
  int c = 0, r = j;
  if constexpr (ChannelsLast) {
    c = j % channels;
    r = j / channels;
  }
  const int row = r / width;
  return {c, row, r - row * width};
}

template <class A>
struct WindowMax {
  A value;
  int at;  // offset in the window, row-major over kernel_h x kernel_w
};

// Output (oh, ow)'s window over `plane` (its values at plane[(h · W + w) · channels]): the first
// value inside the image, then each later one in row order that is larger or a NaN -- the CPU's
// rule (cpu_norm_pool.hpp's take_larger: a tie keeps the first, the last NaN wins, the padding
// never does) -- compared in A, which holds every T exactly.
template <class A, class T>
SK_HOST_DEVICE SK_INLINE WindowMax<A> window_max(const T* plane, const MaxPoolShape& s, int oh,
                                                 int ow) {
  const int top = oh * s.stride_h - s.pad_h, left = ow * s.stride_w - s.pad_w;
  const int h0 = top > 0 ? top : 0, h1 = top + s.kernel_h < s.H ? top + s.kernel_h : s.H;
  const int w0 = left > 0 ? left : 0, w1 = left + s.kernel_w < s.W ? left + s.kernel_w : s.W;
  WindowMax<A> best{convert_value<A>(plane[(std::int64_t{h0} * s.W + w0) * s.channels]),
                    (h0 - top) * s.kernel_w + (w0 - left)};
  for (int h = h0; h < h1; ++h)
    for (int w = h == h0 ? w0 + 1 : w0; w < w1; ++w) {
      const A v = convert_value<A>(plane[(std::int64_t{h} * s.W + w) * s.channels]);
      if (v > best.value || v != v) best = {v, (h - top) * s.kernel_w + (w - left)};
    }
  return best;
}

// Input (h, w)'s gradient: the gradients (gy) of the windows whose recorded maximum (at) it was,
// both laid out as the outputs, at [(oh · OW + ow) · channels], added in the outputs' order from
// 0 -- the CPU's additions in the CPU's order (its backward adds each output's gradient where its
// maximum was, output after output).
template <class A, class T, class O>
SK_HOST_DEVICE SK_INLINE A gathered_gradient(const T* gy, const O* at, const MaxPoolShape& s, int h,
                                             int w) {
  // The windows holding (h, w): oh · stride - pad <= h < oh · stride - pad + kernel.
  const int oh0 = h + s.pad_h < s.kernel_h ? 0 : (h + s.pad_h - s.kernel_h) / s.stride_h + 1;
  const int oh_end = (h + s.pad_h) / s.stride_h + 1;
  const int oh1 = oh_end < s.OH ? oh_end : s.OH;
  const int ow0 = w + s.pad_w < s.kernel_w ? 0 : (w + s.pad_w - s.kernel_w) / s.stride_w + 1;
  const int ow_end = (w + s.pad_w) / s.stride_w + 1;
  const int ow1 = ow_end < s.OW ? ow_end : s.OW;
  A sum = 0;
  for (int oh = oh0; oh < oh1; ++oh)
    for (int ow = ow0; ow < ow1; ++ow) {
      const std::int64_t o = (std::int64_t{oh} * s.OW + ow) * s.channels;
      const int here =
          (h - (oh * s.stride_h - s.pad_h)) * s.kernel_w + (w - (ow * s.stride_w - s.pad_w));
      if (static_cast<int>(at[o]) == here) sum += convert_value<A>(gy[o]);
    }
  return sum;
}

}  // namespace shardkit::autograd
