// Differentiable pooling: max-pool (CPU loops with saved argmax; cuDNN on the GPU, which pools a
// channels-last input as it is, core/channels_last.hpp) and adaptive average pool (PyTorch's
// windows; function-table kernels on both devices).
#pragma once

#include "shardkit/autograd/basic.hpp"
#include "shardkit/core/channel_blocks.hpp"

namespace shardkit::autograd {

namespace detail {

struct MaxPoolNode final : Node {
  Tensor x, y, argmax;  // CPU keeps argmax only; cuDNN's backward wants x and y
  Shape input_shape;
  DType dtype = DType::f32;
  cpu::PoolGeometry p;
  const char* name() const override { return "max_pool2d"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    // (the GPU's gradients in its x's and y's layouts: cuDNN describes them alike)
    const bool gpu = gy.device().is_cuda();
    Tensor g = gpu ? dense_as(ctx, gy, y) : contiguous(ctx, gy);
    Tensor gx = gpu ? empty_dense_like(ctx, x, input_shape, dtype)
                    : fn::new_like(ctx, g, input_shape, dtype);
    kernels_for(ctx, g).max_pool_backward(ctx, x, y, argmax, g, gx, p);
    return {gx};
  }
  void release_saved() override { x = y = argmax = Tensor(); }
};

struct AdaptiveAvgPoolNode final : Node {
  Shape input_shape;
  DType dtype = DType::f32;
  const char* name() const override { return "adaptive_avg_pool2d"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = contiguous(ctx, gy);
    Tensor gx = fn::new_like(ctx, g, input_shape, dtype);
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
  const std::int64_t OH = (x.size(2) + 2 * padding - kernel) / stride + 1;
  const std::int64_t OW = (x.size(3) + 2 * padding - kernel) / stride + 1;
  check(OH > 0 && OW > 0, "max_pool2d: input ", shape_text(x.shape()),
        " is smaller than the kernel ", kernel, module_suffix(ctx));
  Shape y_shape = x.shape();  // (H and W are dimensions 2 and 3 in both layouts)
  y_shape[2] = OH;
  y_shape[3] = OW;
  // (the CPU's loops take NCHW; cuDNN takes a channels-last x as it is, y then channels-last too)
  const bool gpu = x.device().is_cuda();
  Tensor xd = gpu ? dense(ctx, x.data()) : contiguous(ctx, x.data());
  Tensor y = gpu ? empty_dense_like(ctx, xd, y_shape, x.dtype())
                 : fn::new_like(ctx, xd, y_shape, x.dtype());
  // (the CPU's backward reads where each maximum was; cuDNN's reads x and y again)
  const Tensor argmax =
      xd.device().is_cpu() ? fn::new_like(ctx, xd, y.shape(), DType::i64) : Tensor();
  kernels_for(ctx, xd).max_pool_forward(ctx, xd, y, argmax, p);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::MaxPoolNode>();
  node->p = p;
  node->input_shape = x.shape();
  node->dtype = x.dtype();
  if (xd.device().is_cpu()) {
    node->argmax = argmax;
  } else {
    node->x = xd;
    node->y = y;
  }
  return record(ctx, node, {&x}, std::move(y));
}

inline Variable adaptive_avg_pool2d(Context& ctx, const Variable& x, std::int64_t out_h,
                                    std::int64_t out_w) {
  check(x.defined() && x.dim() == 4, "adaptive_avg_pool2d: input ",
        x.defined() ? shape_text(x.shape()) : ShapeText::undefined(), " is not [N, C, H, W]",
        module_suffix(ctx));
  check(out_h > 0 && out_w > 0, "adaptive_avg_pool2d: output size ", out_h, "x", out_w,
        " must be positive", module_suffix(ctx));
  Tensor xd = contiguous(ctx, x.data());
  Tensor y = fn::new_like(ctx, xd, {x.size(0), x.size(1), out_h, out_w}, x.dtype());
  kernels_for(ctx, xd).adaptive_avg_pool_forward(ctx, xd, y);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::AdaptiveAvgPoolNode>();
  node->input_shape = x.shape();
  node->dtype = x.dtype();
  return record(ctx, node, {&x}, std::move(y));
}

}  // namespace shardkit::autograd
