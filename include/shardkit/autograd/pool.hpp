// Differentiable pooling: max-pool (each window's maximum recorded where it lies, and the
// backward gathering from those records: CPU loops, and our own kernels on the GPU, both of which
// pool a channels-last input as it is, core/channels_last.hpp) and adaptive average pool
// (PyTorch's windows; function-table kernels on both devices, the CPU's channels-last too).
//
// Why not cuDNN's max-pool on the GPU: cuDNN promises run-to-run determinism only for
// CUDNN_POOLING_MAX_DETERMINISTIC, not for the plain maximum (whose backward may add the
// gradients of overlapping windows -- ImageNet's 3 x 3 / 2 stem -- into their shared inputs with
// atomics), so a captured step could not promise the eager step's bits. Ours gathers them in
// the CPU's order, to the CPU's bits.
#pragma once

#include "shardkit/autograd/basic.hpp"
#include "shardkit/autograd/max_pool_windows.hpp"
#include "shardkit/core/channel_blocks.hpp"
#include "shardkit/core/channels_last.hpp"

namespace shardkit::autograd {

// What max_pool_forward records per output: on the CPU the input's index in its H x W plane
// (i64); on the GPU the offset in the window, row-major over kernel_h x kernel_w (u8 where a
// window has at most 256 values -- a quarter of an f32 y's bytes -- else i32).
inline DType max_pool_argmax_dtype(Device device, const cpu::PoolGeometry& p) {
  if (device.is_cpu()) return DType::i64;
  return p.kernel_h * p.kernel_w <= 256 ? DType::u8 : DType::i32;
}

namespace detail {

// A pool's output gradient in the layout its kernels read: y's (channels-last where x and y
// were kept so, else contiguous). A channels-last gradient of another dtype than x's (a root
// gradient given in f16 for an f32 y) is cast first: the CPU widens half types through
// contiguous copies, which would leave it NCHW beside a channels-last grad_x.
inline Tensor pooled_gradient(Context& ctx, const Tensor& gy, DType dtype, bool channels_last) {
  if (!channels_last) return contiguous(ctx, gy);
  return to_channels_last(ctx, gy.dtype() == dtype ? gy : cast(ctx, gy, dtype));
}

// A pool's input gradient, uninitialised, in x's layout.
inline Tensor pooled_input_gradient(Context& ctx, const Tensor& g, const Shape& input_shape,
                                    DType dtype, bool channels_last) {
  return channels_last ? empty_channels_last(ctx, g.device(), input_shape, dtype)
                       : fn::new_like(ctx, g, input_shape, dtype);
}

struct MaxPoolNode final : Node {
  Tensor argmax;  // (y's shape and layout)
  Shape input_shape;
  DType dtype = DType::f32;
  bool channels_last = false;  // (x, y and the gradients channels-last)
  cpu::PoolGeometry p;
  const char* name() const override { return "max_pool2d"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    const Tensor g = pooled_gradient(ctx, gy, dtype, channels_last);
    Tensor gx = pooled_input_gradient(ctx, g, input_shape, dtype, channels_last);
    kernels_for(ctx, g).max_pool_backward(ctx, argmax, g, gx, p);
    return {gx};
  }
  void release_saved() override { argmax = Tensor(); }
};

struct AdaptiveAvgPoolNode final : Node {
  Shape input_shape;
  DType dtype = DType::f32;
  bool channels_last = false;  // (x, y and the gradients channels-last: on the CPU)
  const char* name() const override { return "adaptive_avg_pool2d"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    const Tensor g = pooled_gradient(ctx, gy, dtype, channels_last);
    Tensor gx = pooled_input_gradient(ctx, g, input_shape, dtype, channels_last);
    kernels_for(ctx, g).adaptive_avg_pool_backward(ctx, g, gx);
    return {gx};
  }
};

}  // namespace detail

// With `channel_blocks`, an input held in channel blocks ([N, C/b, H, W, b] on the CPU,
// core/channel_blocks.hpp) is pooled as it is, into channel blocks of the same width: the same
// values as its [N, C, H, W] form would give. (Other inputs are [N, C, H, W].)
inline Variable max_pool2d(Context& ctx, const Variable& x, std::int64_t kernel,
                           std::int64_t stride, std::int64_t padding = 0,
                           bool channel_blocks = false) {
  const bool x_blocked =
      channel_blocks && x.defined() && has_channel_block_form(x.data()) && x.device().is_cpu();
  check(x.defined() && (x.dim() == 4 || x_blocked), "max_pool2d: input ",
        x.defined() ? shape_text(x.shape()) : ShapeText::undefined(), " is not [N, C, H, W]",
        channel_blocks ? " or channel blocks [N, C/b, H, W, b] on the CPU" : "",
        module_suffix(ctx));
  check(kernel > 0 && stride > 0 && padding >= 0 && 2 * padding <= kernel, "max_pool2d: kernel ",
        kernel, ", stride ", stride, ", padding ", padding,
        " invalid (need kernel, stride > 0 and padding <= kernel / 2)", module_suffix(ctx));
  cpu::PoolGeometry p{kernel, kernel, stride, stride, padding, padding};
  // (checked before dividing: C++ truncates toward zero, so a padded size 1 short of the
  // kernel gave 1 output where PyTorch's floor gives 0, and the CPU's windows read past a row)
  check(x.size(2) >= 1 && x.size(3) >= 1 && x.size(2) + 2 * padding >= kernel &&
            x.size(3) + 2 * padding >= kernel,
        "max_pool2d: input ", shape_text(x.shape()), " is smaller than the kernel ", kernel,
        " with padding ", padding, module_suffix(ctx));
  const std::int64_t OH = (x.size(2) + 2 * padding - kernel) / stride + 1;
  const std::int64_t OW = (x.size(3) + 2 * padding - kernel) / stride + 1;
  Shape y_shape = x.shape();  // (H and W are dimensions 2 and 3 in both layouts)
  y_shape[2] = OH;
  y_shape[3] = OW;
  // (both devices take a channels-last x as it is, y then channels-last too)
  const bool gpu = x.device().is_cuda();
  Tensor xd = dense(ctx, x.data());
  // (a channels-last image of more values than a GPU plane may hold is pooled plane by plane)
  if (gpu && keeps_channels_last(xd) && xd.numel() / xd.size(0) > kMaxPoolPlaneValues)
    xd = contiguous(ctx, xd);
  Tensor y = empty_dense_like(ctx, xd, y_shape, x.dtype());
  // (the CPU's loops always record where the maxima are; the GPU's only for a backward)
  const bool grad = needs_grad(ctx, {&x});
  const DType at_dtype = max_pool_argmax_dtype(xd.device(), p);
  const Tensor argmax = !gpu || grad ? empty_dense_like(ctx, xd, y_shape, at_dtype) : Tensor();
  kernels_for(ctx, xd).max_pool_forward(ctx, xd, y, argmax, p);
  if (!grad) return Variable(std::move(y));
  auto node = make_pooled<detail::MaxPoolNode>();
  node->p = p;
  node->input_shape = x.shape();
  node->dtype = x.dtype();
  node->channels_last = keeps_channels_last(xd);
  node->argmax = argmax;
  return record(ctx, node, {&x}, std::move(y));
}

inline Variable adaptive_avg_pool2d(Context& ctx, const Variable& x, std::int64_t out_h,
                                    std::int64_t out_w) {
  check(x.defined() && x.dim() == 4, "adaptive_avg_pool2d: input ",
        x.defined() ? shape_text(x.shape()) : ShapeText::undefined(), " is not [N, C, H, W]",
        module_suffix(ctx));
  check(out_h > 0 && out_w > 0, "adaptive_avg_pool2d: output size ", out_h, "x", out_w,
        " must be positive", module_suffix(ctx));
  check(x.size(2) >= 1 && x.size(3) >= 1, "adaptive_avg_pool2d: input ", shape_text(x.shape()),
        " has no pixels to average (PyTorch refuses it too)", module_suffix(ctx));
  // (the CPU's loops take a channels-last x as it is, y then channels-last too; the GPU's
  // kernels take NCHW)
  Tensor xd = x.device().is_cpu() ? dense(ctx, x.data()) : contiguous(ctx, x.data());
  Tensor y = empty_dense_like(ctx, xd, {x.size(0), x.size(1), out_h, out_w}, x.dtype());
  kernels_for(ctx, xd).adaptive_avg_pool_forward(ctx, xd, y);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::AdaptiveAvgPoolNode>();
  node->input_shape = x.shape();
  node->dtype = x.dtype();
  node->channels_last = keeps_channels_last(xd);
  return record(ctx, node, {&x}, std::move(y));
}

}  // namespace shardkit::autograd
