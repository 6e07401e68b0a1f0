// Tensor-level math without autograd, dispatched by device: element-wise ops through the
// function table; on the CPU, f32 GEMM and convolution through oneDNN when the build has it
// (cpu_dnnl.hpp), f64 and builds without it through Eigen, batch-norm and pooling through
// Eigen (f16/bf16 computed in f32, cpu_widen.hpp); on the GPU, cuBLAS/cuDNN.
// Results are new contiguous tensors counted as activations.
#pragma once

#include "shardkit/autograd/cpu_conv.hpp"
#include "shardkit/autograd/cpu_dnnl.hpp"
#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/autograd/cuda_libraries.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::fn {

inline Tensor new_like(Context& ctx, const Tensor& like, Shape shape, DType dtype,
                       MemoryCategory category = MemoryCategory::activations) {
  return empty_on(ctx, like.device(), std::move(shape), dtype, category);
}
inline Tensor new_like(Context& ctx, const Tensor& like) {
  return new_like(ctx, like, like.shape(), like.dtype());
}

inline Tensor pointwise(Context& ctx, Pointwise op, const Tensor& a, const Tensor& b,
                        double alpha = 1, double beta = 1) {
  Tensor out = new_like(ctx, a);
  kernels_for(ctx, a).pointwise(ctx, op, out, a, b, alpha, beta);
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
  Tensor s = src.dtype() == dst.dtype() ? contiguous(ctx, src) : cast(ctx, src, dst.dtype());
  if (dst.is_contiguous()) {
    kernels_for(ctx, dst).pointwise(ctx, Pointwise::axpby, dst, dst, s, 1, 1);
    return;
  }
  Tensor sum = add(ctx, contiguous(ctx, dst), s);
  copy(ctx, dst, sum);
}

inline void gemm(Context& ctx, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                 const Tensor& c, double alpha = 1, double beta = 0) {
  if (c.device().is_cpu())
    return cpu::in_f32(
        ctx,
        [&](const Tensor& x, const Tensor& y, const Tensor& z) {
#if SK_WITH_DNNL
          if (z.dtype() == DType::f32)
            return cpu::dnnl::sgemm(ctx, x, transpose_a, y, transpose_b, z, alpha, beta);
#endif
          cpu::gemm(x, transpose_a, y, transpose_b, z, alpha, beta);
        },
        a, b, c);
#if SK_WITH_CUDA
  cuda::gemm(ctx, a, transpose_a, b, transpose_b, c, alpha, beta);
#else
  (void)ctx;  // the CPU branch above returned; a CUDA tensor cannot exist in this build
#endif
}

inline void conv2d_forward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& y,
                           const ConvGeometry& g) {
  if (x.device().is_cpu())
    return cpu::in_f32(
        ctx,
        [&](const Tensor& a, const Tensor& b, const Tensor& c) {
#if SK_WITH_DNNL
          if (a.dtype() == DType::f32) return cpu::dnnl::convolutions(ctx).forward(ctx, a, b, c, g);
#endif
          cpu::conv2d_forward(a, b, c, g);
        },
        x, w, y);
#if SK_WITH_CUDA
  cuda::conv2d_forward(ctx, x, w, y, g);
#else
  (void)ctx;  // the CPU branch above returned; a CUDA tensor cannot exist in this build
#endif
}

inline void conv2d_backward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& gy,
                            const Tensor& gx, const Tensor& gw, const ConvGeometry& g) {
  if (x.device().is_cpu())
    return cpu::in_f32(
        ctx,
        [&](const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d, const Tensor& e) {
#if SK_WITH_DNNL
          if (a.dtype() == DType::f32)
            return cpu::dnnl::convolutions(ctx).backward(ctx, a, b, c, d, e, g);
#endif
          cpu::conv2d_backward(a, b, c, d, e, g);
        },
        x, w, gy, gx, gw);
#if SK_WITH_CUDA
  cuda::conv2d_backward(ctx, x, w, gy, gx, gw, g);
#else
  (void)ctx;  // the CPU branch above returned; a CUDA tensor cannot exist in this build
#endif
}

}  // namespace shardkit::autograd::fn
