// CPU convolution and GEMM: im2col + Eigen matrix products (f64 unless the build leaves it out;
// f32 too in a build without oneDNN), one image at a time so the column buffer stays small; 1x1
// stride-1 unpadded convolutions skip im2col entirely.
#pragma once

// Eigen must be a system include for nvcc (its nvcc-only pragmas would warn in g++ under
// -Werror); Meson's eigen_dep is marked so.
#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "shardkit/autograd/cpu_kernels.hpp"
#include "shardkit/autograd/geometry.hpp"
#include "shardkit/core/channel_blocks.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd {

namespace cpu {

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MatrixMap = Eigen::Map<RowMatrix<T>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const RowMatrix<T>>;

// Whether the CPU computes GEMMs and convolutions in f64 (Eigen's products). A build can leave
// them out with SHARDKIT_CPU_F64_PRODUCTS=0 (Meson's cpu_f64_products=false, which
// `scripts/setup --main-job` sets): the tests' float64 references need them, a program that
// trains in f32 does not -- the SwAV trainer's f64 option (use_double_precision) covers its loss
// and Sinkhorn, which are no products -- and they are a sixth of the CPU kernel unit's compile
// (41-43 -> 35 s of one core on a 2-core EPYC), the first build's longest pole. A build defines
// it for every unit alike (Meson's shardkit_cpu_dep does); unlike SHARDKIT_WITH_DNNL it is not
// in the tables' ABI name, since only the unit that defines the tables compiles the products.
#if defined(SHARDKIT_CPU_F64_PRODUCTS) && !SHARDKIT_CPU_F64_PRODUCTS
inline constexpr bool kCpuF64Products = false;
#else
inline constexpr bool kCpuF64Products = true;
#endif

// The types the Eigen path computes: f64 (unless the build left it out, above); f32 only in a
// build without oneDNN, since with it the table sends every f32 GEMM and convolution to oneDNN
// (cpu_kernel_table.hpp) and an f32 instantiation here would be dead code -- Eigen's matrix
// products are a large part of the kernel table's compile time. Other dtypes get visit_real's
// refusal either way. (F64 is a parameter so that the tests reach the refusal in any build.)
template <bool F64 = kCpuF64Products, class Fn>
void visit_eigen_real(DType dtype, const char* op, Fn&& fn) {
  visit_real(dtype, op, [&](auto tag) {
    constexpr bool is_f64 = std::is_same_v<decltype(tag), double>;
    if constexpr (is_f64 ? F64 : !SK_WITH_DNNL)
      fn(tag);
    else if constexpr (is_f64)
      fail<NotAvailable>(op,
                         " in f64 on the CPU: this build left the CPU's f64 GEMMs and "
                         "convolutions out (Meson option cpu_f64_products=false, which "
                         "scripts/setup --main-job sets); configure the build with "
                         "-Dcpu_f64_products=true to compute in f64");
    else
      fail<StateError>(op,
                       " reached the CPU's Eigen path in f32 in a build with oneDNN, which "
                       "runs every f32 GEMM and convolution (autograd/cpu_kernel_table.hpp)");
  });
}

// C = alpha * op(A) op(B) + beta * C on contiguous row-major matrices.
inline void gemm(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                 const Tensor& c, double alpha, double beta) {
  visit_eigen_real(c.dtype(), "gemm", [&](auto tag) {
    using T = decltype(tag);
    ConstMatrixMap<T> A(static_cast<const T*>(a.data_ptr()), a.size(0), a.size(1));
    ConstMatrixMap<T> B(static_cast<const T*>(b.data_ptr()), b.size(0), b.size(1));
    MatrixMap<T> C(static_cast<T*>(c.data_ptr()), c.size(0), c.size(1));
    const T al = static_cast<T>(alpha);
    auto run = [&](const auto& opa, const auto& opb) {
      if (beta == 0) {
        C.noalias() = al * (opa * opb);
      } else {
        if (beta != 1) C *= static_cast<T>(beta);
        C.noalias() += al * (opa * opb);
      }
    };
    if (!transpose_a && !transpose_b) run(A, B);
    if (!transpose_a && transpose_b) run(A, B.transpose());
    if (transpose_a && !transpose_b) run(A.transpose(), B);
    if (transpose_a && transpose_b) run(A.transpose(), B.transpose());
  });
}

// One image [C, H, W] -> columns [C*KH*KW, OH*OW]; padding reads as zero.
template <class T>
void im2col(const T* image, const ConvGeometry& g, T* col) {
  const std::int64_t OHW = g.out_plane();
  for (std::int64_t c = 0; c < g.in_channels; ++c)
    for (std::int64_t kh = 0; kh < g.kernel_h; ++kh)
      for (std::int64_t kw = 0; kw < g.kernel_w; ++kw) {
        T* row = col + ((c * g.kernel_h + kh) * g.kernel_w + kw) * OHW;
        for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
          const std::int64_t ih = oh * g.stride_h - g.pad_h + kh * g.dilation_h;
          T* out = row + oh * g.out_w;
          if (ih < 0 || ih >= g.height) {
            std::fill(out, out + g.out_w, T(0));
            continue;
          }
          const T* in = image + (c * g.height + ih) * g.width;
          for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
            const std::int64_t iw = ow * g.stride_w - g.pad_w + kw * g.dilation_w;
            out[ow] = (iw >= 0 && iw < g.width) ? in[iw] : T(0);
          }
        }
      }
}

// The adjoint of im2col: columns are added back into the image (which the caller zeroed).
template <class T>
void col2im(const T* col, const ConvGeometry& g, T* image) {
  const std::int64_t OHW = g.out_plane();
  for (std::int64_t c = 0; c < g.in_channels; ++c)
    for (std::int64_t kh = 0; kh < g.kernel_h; ++kh)
      for (std::int64_t kw = 0; kw < g.kernel_w; ++kw) {
        const T* row = col + ((c * g.kernel_h + kh) * g.kernel_w + kw) * OHW;
        for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
          const std::int64_t ih = oh * g.stride_h - g.pad_h + kh * g.dilation_h;
          if (ih < 0 || ih >= g.height) continue;
          T* out = image + (c * g.height + ih) * g.width;
          const T* in = row + oh * g.out_w;
          for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
            const std::int64_t iw = ow * g.stride_w - g.pad_w + kw * g.dilation_w;
            if (iw >= 0 && iw < g.width) out[iw] += in[ow];
          }
        }
      }
}

// A grouped convolution (g.groups > 1) runs as one convolution per group (ConvGeometry::
// per_group): a group's input channels, weight rows and output channels are each a contiguous
// run of an image's.
inline void conv2d_forward(const Tensor& x, const Tensor& weight, const Tensor& y,
                           const ConvGeometry& g) {
  visit_eigen_real(x.dtype(), "conv2d", [&](auto tag) {
    using T = decltype(tag);
    const ConvGeometry s = g.per_group();
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    HostScratch scratch;
    T* col = s.is_pointwise() ? nullptr
                              : scratch.uninitialised<T>(std::size_t(s.patch() * s.out_plane()));
    for (std::int64_t n = 0; n < g.batch; ++n)
      for (std::int64_t group = 0; group < g.groups; ++group) {
        const T* image = in + (n * g.in_channels + group * s.in_channels) * g.height * g.width;
        const T* columns = image;
        if (!s.is_pointwise()) {
          im2col(image, s, col);
          columns = col;
        }
        ConstMatrixMap<T> W(w + group * s.out_channels * s.patch(), s.out_channels, s.patch());
        ConstMatrixMap<T> C(columns, s.patch(), s.out_plane());
        MatrixMap<T> Y(out + (n * g.out_channels + group * s.out_channels) * s.out_plane(),
                       s.out_channels, s.out_plane());
        Y.noalias() = W * C;
      }
  });
}

// grad_x (optional) and grad_weight (optional, overwritten) of a convolution.
inline void conv2d_backward(const Tensor& x, const Tensor& weight, const Tensor& grad_y,
                            const Tensor& grad_x, const Tensor& grad_weight,
                            const ConvGeometry& g) {
  visit_eigen_real(x.dtype(), "conv2d backward", [&](auto tag) {
    using T = decltype(tag);
    const ConvGeometry s = g.per_group();
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const std::size_t col_size = static_cast<std::size_t>(s.patch() * s.out_plane());
    HostScratch scratch;
    T* col = s.is_pointwise() ? nullptr : scratch.uninitialised<T>(col_size);
    T* grad_col =
        grad_x.defined() && !s.is_pointwise() ? scratch.uninitialised<T>(col_size) : nullptr;
    const std::int64_t image_size = g.in_channels * g.height * g.width;
    const std::int64_t group_size = s.in_channels * g.height * g.width;
    if (grad_weight.defined()) {
      MatrixMap<T> GW(static_cast<T*>(grad_weight.data_ptr()), g.out_channels, s.patch());
      GW.setZero();
    }
    for (std::int64_t n = 0; n < g.batch; ++n)
      for (std::int64_t group = 0; group < g.groups; ++group) {
        ConstMatrixMap<T> GY(gy + (n * g.out_channels + group * s.out_channels) * s.out_plane(),
                             s.out_channels, s.out_plane());
        const T* image = in + n * image_size + group * group_size;
        if (grad_weight.defined()) {
          const T* columns = image;
          if (!s.is_pointwise()) {
            im2col(image, s, col);
            columns = col;
          }
          ConstMatrixMap<T> C(columns, s.patch(), s.out_plane());
          MatrixMap<T> GW(
              static_cast<T*>(grad_weight.data_ptr()) + group * s.out_channels * s.patch(),
              s.out_channels, s.patch());
          GW.noalias() += GY * C.transpose();
        }
        if (grad_x.defined()) {
          ConstMatrixMap<T> W(w + group * s.out_channels * s.patch(), s.out_channels, s.patch());
          T* gx = static_cast<T*>(grad_x.data_ptr()) + n * image_size + group * group_size;
          if (s.is_pointwise()) {
            MatrixMap<T> GX(gx, s.patch(), s.out_plane());
            GX.noalias() = W.transpose() * GY;
          } else {
            MatrixMap<T> GC(grad_col, s.patch(), s.out_plane());
            GC.noalias() = W.transpose() * GY;
            std::fill(gx, gx + group_size, T(0));
            col2im(grad_col, s, gx);
          }
        }
      }
  });
}

// The same on tensors in any layout the convolutions take: channels-last (core/channels_last.hpp)
// and channel blocks [N, C/b, H, W, b] (core/channel_blocks.hpp: what a convolution asked for
// them reads; oneDNN reads them as they are) -- im2col reads and writes NCHW, so those operands go
// through NCHW copies, which move values without changing them: the NCHW call's bits.
inline Tensor nchw_operand(Context& ctx, const Tensor& t) {
  return has_channel_block_form(t) ? from_channel_blocks(ctx, t) : contiguous(ctx, t);
}

inline void conv2d_forward_any_layout(Context& ctx, const Tensor& x, const Tensor& weight,
                                      const Tensor& y, const ConvGeometry& g) {
  const Tensor xc = nchw_operand(ctx, x);
  if (y.is_contiguous() && y.dim() == 4) return conv2d_forward(xc, weight, y, g);
  const Tensor yc = empty_on(ctx, y.device(), {g.batch, g.out_channels, g.out_h, g.out_w},
                             y.dtype(), MemoryCategory::activations);
  conv2d_forward(xc, weight, yc, g);
  copy(ctx, y, has_channel_block_form(y) ? to_channel_blocks(ctx, yc, y.size(4)) : yc);
}

inline void conv2d_backward_any_layout(Context& ctx, const Tensor& x, const Tensor& weight,
                                       const Tensor& grad_y, const Tensor& grad_x,
                                       const Tensor& grad_weight, const ConvGeometry& g) {
  const Tensor xc = nchw_operand(ctx, x), gyc = nchw_operand(ctx, grad_y);
  if (!grad_x.defined() || (grad_x.is_contiguous() && grad_x.dim() == 4))
    return conv2d_backward(xc, weight, gyc, grad_x, grad_weight, g);
  const Tensor gxc = empty_on(ctx, grad_x.device(), {g.batch, g.in_channels, g.height, g.width},
                              grad_x.dtype(), MemoryCategory::activations);
  conv2d_backward(xc, weight, gyc, gxc, grad_weight, g);
  copy(ctx, grad_x,
       has_channel_block_form(grad_x) ? to_channel_blocks(ctx, gxc, grad_x.size(4)) : gxc);
}

}  // namespace cpu
}  // namespace shardkit::autograd
