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

// The kernel runs over the operands' memory as flat arrays: b is brought to a's dense layout
// (a no-op when it has it), and the result takes it too.
inline Tensor pointwise(Context& ctx, Pointwise op, const Tensor& a, const Tensor& b,
                        double alpha = 1, double beta = 1) {
  const Tensor ad = dense(ctx, a);
  const Tensor bd = b.defined() ? dense_as(ctx, b, ad) : b;
  Tensor out = empty_dense_like(ctx, ad, ad.shape(), ad.dtype());
  kernels_for(ctx, ad).pointwise(ctx, op, out, ad, bd, alpha, beta);
  return out;
}

inline Tensor add(Context& ctx, const Tensor& a, const Tensor& b) {
  return pointwise(ctx, Pointwise::axpby, a, b, 1, 1);
}
inline Tensor scale(Context& ctx, const Tensor& a, double alpha) {
  return pointwise(ctx, Pointwise::axpby, a, Tensor(), alpha, 0);
}
inline Tensor mul(Context& ctx, const Tensor& a, const Tensor& b) {
  return pointwise(ctx, Pointwise::mul, a, b, 1, 0);
}

// dst += src in place (same shape; src converted to dst's dtype first when they differ).
inline void accumulate(Context& ctx, const Tensor& dst, const Tensor& src) {
  Tensor s = src.dtype() == dst.dtype() ? src : cast(ctx, src, dst.dtype());
  if (dst.is_contiguous() || keeps_channels_last(dst)) {  // (dense: flat in place)
    kernels_for(ctx, dst).pointwise(ctx, Pointwise::axpby, dst, dst, dense_as(ctx, s, dst), 1, 1);
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

inline void conv2d_backward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& gy,
                            const Tensor& gx, const Tensor& gw, const ConvGeometry& g) {
  kernels_for(ctx, x).conv2d_backward(ctx, x, w, gy, gx, gw, g);
}

}  // namespace shardkit::autograd::fn
