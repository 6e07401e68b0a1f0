// Tensor-level math without autograd, dispatched by device through the function table
// (device_table.hpp; cpu_kernel_table.hpp says what the CPU runs, cuBLAS/cuDNN serve the GPU).
// Results are new dense tensors counted as activations: contiguous, or channels-last where the
// first operand is kept so (core/channels_last.hpp).
#pragma once

#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::fn {

inline Tensor new_like(Context& ctx, const Tensor& like, Shape shape, DType dtype,
                       MemoryCategory category = MemoryCategory::activations) {
  return empty_on(ctx, like.device(), std::move(shape), dtype, category);
}
inline Tensor new_like(Context& ctx, const Tensor& like) {
  return new_like(ctx, like, like.shape(), like.dtype());
}

// The kernel runs over the operands' memory as flat arrays of a's element type: b is brought to
// a's dense layout and dtype (a no-op when it has them), and the result takes them too. (Two
// gradients of one value may differ in dtype -- batch-norm's weight gradient is f32 for a 16-bit
// weight -- and the CUDA kernel would read b's bytes as a's type.)
inline Tensor pointwise(Context& ctx, Pointwise op, const Tensor& a, const Tensor& b,
                        double alpha = 1, double beta = 1) {
  // (Every small op runs this: the operands are copied -- a reference count each -- only when
  // one has to change layout.)
  const bool channels_last = keeps_channels_last(a);
  Tensor a_moved, b_moved;
  const Tensor& ad = channels_last || a.is_contiguous() ? a : (a_moved = contiguous(ctx, a));
  const bool b_in_place =
      !b.defined() ||
      (b.dtype() == a.dtype() && (channels_last ? is_channels_last(b) : b.is_contiguous()));
  if (!b_in_place && (channels_last || b.dtype() != a.dtype())) {
    // (channels-last in a's dtype too: the CPU table widens a half-precision operand into a
    // contiguous copy)
    b_moved = channels_last
                  ? empty_channels_last(ctx, a.device(), a.shape(), a.dtype())
                  : empty_on(ctx, b.device(), b.shape(), a.dtype(), b.storage()->category());
    copy(ctx, b_moved, b);
  }
  const Tensor& bd = b_in_place ? b : b_moved.defined() ? b_moved : (b_moved = contiguous(ctx, b));
  Tensor out = channels_last ? empty_channels_last(ctx, ad.device(), ad.shape(), ad.dtype())
                             : new_like(ctx, ad);
  kernels_for(ctx, ad).pointwise(ctx, op, out, ad, bd, alpha, beta);
  return out;
}

inline Tensor add(Context& ctx, const Tensor& a, const Tensor& b) {
  return pointwise(ctx, Pointwise::axpby, a, b, 1, 1);
}
inline Tensor add_relu(Context& ctx, const Tensor& a, const Tensor& b) {
  return pointwise(ctx, Pointwise::add_relu, a, b, 1, 1);
}
inline Tensor scale(Context& ctx, const Tensor& a, double alpha) {
  return pointwise(ctx, Pointwise::axpby, a, Tensor(), alpha, 0);
}
inline Tensor mul(Context& ctx, const Tensor& a, const Tensor& b) {
  return pointwise(ctx, Pointwise::mul, a, b, 1, 0);
}

// dst += src in place (same shape; src converted to dst's dtype first when they differ).
inline void accumulate(Context& ctx, const Tensor& dst, const Tensor& src) {
  Tensor cast_src;
  const Tensor& s = src.dtype() == dst.dtype() ? src : (cast_src = cast(ctx, src, dst.dtype()));
  const bool channels_last = keeps_channels_last(dst);
  if (dst.is_contiguous() || channels_last) {  // (dense: flat in place, s in dst's layout)
    const bool in_place = channels_last ? is_channels_last(s) : s.is_contiguous();
    kernels_for(ctx, dst).pointwise(ctx, Pointwise::axpby, dst, dst,
                                    in_place ? s : dense_as(ctx, s, dst), 1, 1);
    return;
  }
  Tensor sum = add(ctx, contiguous(ctx, dst), s);
  copy(ctx, dst, sum);
}

inline void gemm(Context& ctx, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                 const Tensor& c, double alpha = 1, double beta = 0) {
  kernels_for(ctx, c).gemm(ctx, a, transpose_a, b, transpose_b, c, alpha, beta);
}

inline void conv2d_forward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& y,
                           const ConvGeometry& g) {
  kernels_for(ctx, x).conv2d_forward(ctx, x, w, y, g);
}

inline std::int64_t conv2d_output_block(Context& ctx, const Tensor& x, const ConvGeometry& g) {
  return kernels_for(ctx, x).conv2d_output_block(ctx, x, g);
}

inline void conv2d_backward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& gy,
                            const Tensor& gx, const Tensor& gw, const ConvGeometry& g) {
  kernels_for(ctx, x).conv2d_backward(ctx, x, w, gy, gx, gw, g);
}

}  // namespace shardkit::autograd::fn
