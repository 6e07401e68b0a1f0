// Channel-blocked memory for [N, C, H, W] activations on the CPU: oneDNN's nChw8c / nChw16c,
// held as a contiguous [N, C/b, H, W, b] tensor whose last dimension is b consecutive channels
// of one pixel. oneDNN's convolution kernels for AVX2 (b = 8) and AVX-512 (b = 16) compute in
// this layout; given NCHW tensors, every call reorders its input into it and its output back.
// A network that keeps its activations blocked between convolutions skips those reorders and
// runs the very kernels the NCHW network runs on the same values -- unlike channels-last
// (core/channels_last.hpp), which takes other kernels -- so its convolutions give the NCHW
// network's bits, and batch-norm's sums are made in the NCHW loops' order (the last bits of a
// double sum of products aside: FMA contraction is the compiler's choice per loop).
//
// A blocked tensor has no marker of its own: a 5-D tensor is read as channel blocks only where
// an option says so (Conv2dOptions::channel_blocks and BatchNormOptions::channel_blocks, set
// together by ResNetOptions::channel_blocks). The conversions below are exact copies.
#pragma once

#include "shardkit/core/tensor_ops.hpp"

namespace shardkit {

// The channel counts oneDNN's blocked layouts come in.
inline bool is_channel_block_width(std::int64_t b) { return b == 8 || b == 16; }

// Whether `t` has the form of a channel-blocked activation: 5-D with a block width of 8 or 16.
inline bool has_channel_block_form(const Tensor& t) {
  return t.defined() && t.dim() == 5 && is_channel_block_width(t.size(4));
}

// [N, C, H, W] of a blocked [N, C/b, H, W, b] shape.
inline Shape channel_unblocked_shape(const Shape& blocked) {
  return {blocked[0], blocked[1] * blocked[4], blocked[2], blocked[3]};
}

namespace detail {

// The [N, C/b, H, W, b] view of a contiguous [N, C, H, W] tensor: element (n, c, h, w) at
// index (n, c / b, h, w, c % b).
inline Tensor blocked_view_of_contiguous(const Tensor& nchw, std::int64_t b) {
  const std::int64_t N = nchw.size(0), C = nchw.size(1), H = nchw.size(2), W = nchw.size(3);
  return nchw.view({N, C / b, b, H, W}).transpose(2, 3).transpose(3, 4);
}

// Each [rows, cols] plane of `from` written transposed into `to`, a plane per task, in the
// destination's order. Both conversions are this: a block of b channels of one image is b rows
// of H * W values in NCHW and H * W rows of b values in channel blocks.
template <class E>
void transpose_planes(ThreadPool& pool, const E* from, E* to, std::int64_t planes,
                      std::int64_t rows, std::int64_t cols) {
  pool.parallel_for(planes, [=](std::int64_t p) {
    const E* src = from + p * rows * cols;
    E* dst = to + p * rows * cols;
    for (std::int64_t c = 0; c < cols; ++c)
      for (std::int64_t r = 0; r < rows; ++r) dst[c * rows + r] = src[r * cols + c];
  });
}

// `out` = `x` (both contiguous, on the CPU) with each [rows, cols] plane transposed.
inline void transpose_planes(Context& ctx, const Tensor& x, const Tensor& out, std::int64_t planes,
                             std::int64_t rows, std::int64_t cols) {
  const auto run = [&](auto element) {
    using E = decltype(element);
    transpose_planes(ctx.cpu_pool(), static_cast<const E*>(x.data_ptr()),
                     static_cast<E*>(out.data_ptr()), planes, rows, cols);
  };
  switch (x.element_size()) {
    case 2:
      return run(std::uint16_t{});
    case 4:
      return run(std::uint32_t{});
    case 8:
      return run(std::uint64_t{});
    default:
      fail<InvalidArgument>("channel blocks: ", dtype_name(x.dtype()), " is not supported");
  }
}

}  // namespace detail

// A contiguous [N, C/b, H, W, b] copy of the [N, C, H, W] tensor `x` (any layout). C must be a
// multiple of b.
inline Tensor to_channel_blocks(Context& ctx, const Tensor& x, std::int64_t b) {
  check(x.dim() == 4, "to_channel_blocks: input ", shape_text(x.shape()), " is not [N, C, H, W]");
  check(is_channel_block_width(b) && x.size(1) % b == 0, "to_channel_blocks: ", x.size(1),
        " channels do not split into blocks of ", b, " (the widths are 8 and 16)");
  const Tensor xc = contiguous(ctx, x);
  Tensor out = empty_on(ctx, x.device(), {x.size(0), x.size(1) / b, x.size(2), x.size(3), b},
                        x.dtype(), x.storage()->category());
  if (!x.device().is_cpu() || out.numel() == 0)
    copy(ctx, out, detail::blocked_view_of_contiguous(xc, b));
  else
    detail::transpose_planes(ctx, xc, out, x.size(0) * (x.size(1) / b), b, x.size(2) * x.size(3));
  return out;
}

// A contiguous [N, C, H, W] copy of the blocked tensor `x`.
inline Tensor from_channel_blocks(Context& ctx, const Tensor& x) {
  check(has_channel_block_form(x), "from_channel_blocks: input ", shape_text(x.shape()),
        " is not [N, C/b, H, W, b] with b 8 or 16");
  Tensor out = empty_on(ctx, x.device(), channel_unblocked_shape(x.shape()), x.dtype(),
                        x.storage()->category());
  if (!x.device().is_cpu() || out.numel() == 0)
    copy(ctx, detail::blocked_view_of_contiguous(out, x.size(4)), x);
  else
    detail::transpose_planes(ctx, contiguous(ctx, x), out, x.size(0) * x.size(1),
                             x.size(2) * x.size(3), x.size(4));
  return out;
}

}  // namespace shardkit
