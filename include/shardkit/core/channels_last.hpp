// Channels-last memory for [N, C, H, W] tensors: the same shape and indexing, with the elements
// stored as [N, H, W, C] (strides H*W*C, 1, W*C, C) -- PyTorch's torch.channels_last. oneDNN's
// CPU convolutions read and write this layout as it is (its "nhwc"), while a plain NCHW tensor
// is reordered into a channel-blocked layout before every convolution and back after it; for
// the few channels of small networks those reorders cost as much as the convolution itself.
//
// Element-wise kernels run over a tensor's memory as a flat array, so every operand of one must
// share one dense layout. The autograd ops keep a channels-last tensor as it is where their
// kernels take it (convolution, batch-norm, add, ReLU, max-pool, and on the CPU adaptive
// average pool; on the CPU in f32 and f64, on the GPU in f32, f16 and bf16, where cuDNN's NHWC
// convolutions also spare the layout transposes its fastest kernels make around NCHW tensors);
// every other op makes its inputs contiguous first, as it always has, so a channels-last
// tensor is correct everywhere and fast where it matters.
#pragma once

#include "shardkit/core/tensor_ops.hpp"

namespace shardkit {

// Whether `t` is 4-D and laid out channels-last (size-1 dimensions' strides ignored, as
// is_contiguous ignores them: a tensor with one channel, or 1 x 1 planes, is both).
inline bool is_channels_last(const Tensor& t) {
  if (t.dim() != 4) return false;
  const std::int64_t order[4] = {1, 3, 2, 0};  // innermost first: C, W, H, N
  std::int64_t expected = 1;
  for (std::int64_t d : order) {
    if (t.size(d) == 1) continue;
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// Whether a tensor of `shape` on `device` in `dtype` may be kept channels-last: 4-D, with more
// than one channel and more than one value per plane (else the two layouts are the same memory
// and the contiguous path serves), in f32 or f64 on the CPU (whose kernels widen half types
// through contiguous f32 copies), in f32, f16 or bf16 on a GPU (cuDNN's NHWC convolutions; f64
// stays NCHW there, where cuDNN's double kernels are).
inline bool channels_last_applies(Device device, DType dtype, const Shape& shape) {
  // (cheapest tests first: every element-wise op asks, mostly of tensors that are not 4-D)
  if (shape.size() != 4 || shape[1] <= 1 || shape[2] * shape[3] <= 1) return false;
  if (device.is_cpu()) return dtype == DType::f32 || dtype == DType::f64;
  return dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16;
}

// Whether the autograd ops keep `t` channels-last rather than making it contiguous: a
// channels-last tensor where channels_last_applies -- so not also contiguous, and of a dtype
// the device's convolution and batch-norm kernels compute in as it is.
inline bool keeps_channels_last(const Tensor& t) {
  return t.dim() == 4 && t.defined() && channels_last_applies(t.device(), t.dtype(), t.shape()) &&
         is_channels_last(t);
}

// An uninitialised [N, C, H, W] tensor stored channels-last.
inline Tensor empty_channels_last(Context& ctx, Device device, const Shape& shape, DType dtype,
                                  MemoryCategory category = MemoryCategory::activations) {
  check(shape.size() == 4, "empty_channels_last: shape ", shape_text(shape),
        " is not [N, C, H, W]");
  Tensor nhwc = empty_on(ctx, device, {shape[0], shape[2], shape[3], shape[1]}, dtype, category);
  return nhwc.transpose(1, 3).transpose(2, 3);  // [N, W, H, C] -> [N, C, H, W] view
}

// `t` itself if stored channels-last, else a channels-last copy of it.
inline Tensor to_channels_last(Context& ctx, const Tensor& t) {
  if (is_channels_last(t)) return t;
  Tensor out = empty_channels_last(ctx, t.device(), t.shape(), t.dtype(), t.storage()->category());
  copy(ctx, out, t);
  return out;
}

// `t` as the ops that keep channels-last tensors read it: itself when kept channels-last or
// contiguous, else a contiguous copy.
inline Tensor dense(Context& ctx, const Tensor& t) {
  return keeps_channels_last(t) ? t : contiguous(ctx, t);
}

// `t` in the dense layout of `like` (a tensor dense() returned): channels-last when `like` is
// kept so, else contiguous. Element-wise kernels need their operands so.
inline Tensor dense_as(Context& ctx, const Tensor& t, const Tensor& like) {
  return keeps_channels_last(like) ? to_channels_last(ctx, t) : contiguous(ctx, t);
}

// An uninitialised tensor of `like`'s shape (or `shape`, of the same rank) in its dense layout.
inline Tensor empty_dense_like(Context& ctx, const Tensor& like, const Shape& shape, DType dtype,
                               MemoryCategory category = MemoryCategory::activations) {
  if (keeps_channels_last(like) && shape.size() == 4)
    return empty_channels_last(ctx, like.device(), shape, dtype, category);
  return empty_on(ctx, like.device(), shape, dtype, category);
}

}  // namespace shardkit
