// Differentiable 2-D convolution (NCHW, OIHW weights, stride/padding/dilation, groups, optional
// bias):
// on the CPU oneDNN's primitives for f32 (cpu_dnnl.hpp), im2col + Eigen for f64 or a build
// without oneDNN (cpu_conv.hpp); cuDNN (forward, backward-data, backward-filter) on the GPU.
// An input stored channels-last (core/channels_last.hpp) is read as it is, and the output is
// channels-last too -- or asked for (Conv2dOptions::channels_last) from any input, which is how
// a network's first convolution turns its activations channels-last. (cuDNN convolves in one
// layout: there an NCHW input of a channels-last output is copied, and the weight is copied to
// KRSC, cuda_libraries.hpp.) Asked to
// (Conv2dOptions::channel_blocks), it reads a 5-D input as channel blocks and writes its output
// in them where oneDNN's kernel computes in them (core/channel_blocks.hpp).
#pragma once

#include "shardkit/autograd/basic.hpp"
#include "shardkit/autograd/channel_blocks.hpp"
#include "shardkit/core/channel_blocks.hpp"

namespace shardkit::autograd {

struct Conv2dOptions {
  std::int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  // Grouped convolution (ConvGeometry): the weight is [out, in / groups, kh, kw].
  std::int64_t groups = 1;
  // Write the output channels-last where channels_last_applies (the CPU in f32 and f64, a GPU in
  // f32, f16 and bf16); elsewhere it is contiguous.
  bool channels_last = false;
  // Read a 5-D input [N, C/b, H, W, b] as channel blocks (on a GPU, through an NCHW copy), and
  // write the output in the channel blocks oneDNN's kernel for this shape computes in (CPU, f32,
  // no bias; the shape tells which: [N, C_out/b, H_out, W_out, b]), or [N, C_out, H_out, W_out]
  // where it computes in none.
  bool channel_blocks = false;

  static Conv2dOptions make(std::int64_t stride, std::int64_t padding, std::int64_t dilation = 1,
                            std::int64_t groups = 1) {
    return {stride, stride, padding, padding, dilation, dilation, groups};
  }
};

namespace detail {

struct Conv2dNode final : Node {
  Tensor x, weight;
  ConvGeometry geometry;
  bool has_bias = false;
  const char* name() const override { return "conv2d"; }
  bool y_channels_last = false;  // the output's layout, in which the gradient is read
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = y_channels_last ? to_channels_last(ctx, gy) : contiguous(ctx, gy);
    Gradients grads(edges.size());
    if (edges[0].valid()) grads[0] = empty_dense_like(ctx, x, x.shape(), x.dtype());
    if (edges[1].valid())
      grads[1] = fn::new_like(ctx, g, weight.shape(), weight.dtype(), MemoryCategory::gradients);
    if (grads[0].defined() || grads[1].defined())
      fn::conv2d_backward(ctx, x, weight, g, grads[0], grads[1], geometry);
    if (has_bias && edges[2].valid()) {
      grads[2] =
          fn::new_like(ctx, g, {geometry.out_channels}, weight.dtype(), MemoryCategory::gradients);
      // (channels-last: rows of channels, in the same order over each channel's values)
      const std::int64_t plane = geometry.out_plane();
      kernels_for(ctx, g).channel_sum(ctx, g, grads[2],
                                      y_channels_last ? geometry.batch * plane : geometry.batch,
                                      geometry.out_channels, y_channels_last ? 1 : plane);
    }
    return grads;
  }
  void release_saved() override { x = weight = Tensor(); }
};

}  // namespace detail

inline Variable conv2d(Context& ctx, const Variable& x, const Variable& weight,
                       const Variable& bias = Variable(), Conv2dOptions o = {}) {
  check(x.defined() && weight.defined(), "conv2d: input or weight undefined", module_suffix(ctx));
  const bool x_blocked = o.channel_blocks && has_channel_block_form(x.data());
  if (x_blocked && !x.device().is_cpu()) {  // (cuDNN reads no channel blocks: NCHW, as batch-norm)
    Conv2dOptions nchw = o;
    nchw.channel_blocks = false;
    return conv2d(ctx, from_channel_blocks(ctx, x), weight, bias, nchw);
  }
  check(x.dim() == 4 || x_blocked, "conv2d: input ", shape_text(x.shape()), " is not [N, C, H, W]",
        o.channel_blocks ? " or channel blocks [N, C/b, H, W, b]" : "", module_suffix(ctx));
  // (a blocked input with a channels-last output was described to oneDNN as NCHW and read
  // scrambled; one layout at a time, as ResNetOptions asks)
  check(!(x_blocked && o.channels_last), "conv2d: channel blocks and channels_last together",
        module_suffix(ctx), "; pass one of the two");
  check(weight.device() == x.device() && (!bias.defined() || bias.device() == x.device()),
        "conv2d: the weight", bias.defined() ? " and bias" : "", " must be on the input's device",
        module_suffix(ctx), "; move them there");
  const Shape x_shape = x_blocked ? channel_unblocked_shape(x.shape()) : x.shape();
  check(o.groups > 0 && x_shape[1] % o.groups == 0, "conv2d: groups ", o.groups,
        " does not divide the input's ", x_shape[1], " channels", module_suffix(ctx),
        "; pass groups that divide in_channels and out_channels");
  const std::int64_t group_in = x_shape[1] / o.groups;
  check(weight.dim() == 4 && weight.size(1) == group_in, "conv2d: input ", shape_text(x.shape()),
        " does not match weight ", shape_text(weight.shape()), module_suffix(ctx),
        "; the weight must be [out, ", group_in, ", kh, kw] (check in_channels",
        o.groups > 1 ? " / groups)" : ")");
  check(weight.size(0) % o.groups == 0, "conv2d: groups ", o.groups, " does not divide weight ",
        shape_text(weight.shape()), "'s ", weight.size(0), " output channels", module_suffix(ctx),
        "; pass groups that divide in_channels and out_channels");
  check(x.dtype() == weight.dtype(), "conv2d: input dtype ", dtype_name(x.dtype()),
        " differs from weight dtype ", dtype_name(weight.dtype()), module_suffix(ctx));
  check(o.stride_h > 0 && o.stride_w > 0 && o.dilation_h > 0 && o.dilation_w > 0 && o.pad_h >= 0 &&
            o.pad_w >= 0,
        "conv2d: strides and dilations must be > 0 and paddings >= 0", module_suffix(ctx));
  ConvGeometry g;
  g.batch = x_shape[0];
  g.in_channels = x_shape[1];
  g.height = x_shape[2];
  g.width = x_shape[3];
  g.out_channels = weight.size(0);
  g.kernel_h = weight.size(2);
  g.kernel_w = weight.size(3);
  g.stride_h = o.stride_h;
  g.stride_w = o.stride_w;
  g.pad_h = o.pad_h;
  g.pad_w = o.pad_w;
  g.dilation_h = o.dilation_h;
  g.dilation_w = o.dilation_w;
  g.groups = o.groups;
  // (checked before dividing: C++ truncates toward zero where PyTorch floors)
  check(g.height + 2 * g.pad_h >= g.dilation_h * (g.kernel_h - 1) + 1 &&
            g.width + 2 * g.pad_w >= g.dilation_w * (g.kernel_w - 1) + 1,
        "conv2d: input ", shape_text(x.shape()), " is smaller than the kernel ",
        shape_text(weight.shape()), " with this padding and dilation", module_suffix(ctx));
  g.out_h = (g.height + 2 * g.pad_h - g.dilation_h * (g.kernel_h - 1) - 1) / g.stride_h + 1;
  g.out_w = (g.width + 2 * g.pad_w - g.dilation_w * (g.kernel_w - 1) - 1) / g.stride_w + 1;
  const bool has_bias = bias.defined();
  if (has_bias)
    check(bias.shape() == Shape{g.out_channels} && bias.dtype() == x.dtype(), "conv2d: bias ",
          shape_text(bias.shape()), " does not match weight ", shape_text(weight.shape()),
          module_suffix(ctx));
  Tensor xd = dense(ctx, x.data()), wd = contiguous(ctx, weight.data());
  const Shape y_shape{g.batch, g.out_channels, g.out_h, g.out_w};
  const std::int64_t y_block =
      o.channel_blocks && !has_bias ? fn::conv2d_output_block(ctx, xd, g) : 0;
  const bool y_channels_last = y_block == 0 && (o.channels_last || keeps_channels_last(xd)) &&
                               channels_last_applies(xd.device(), x.dtype(), y_shape);
  Tensor y = y_block > 0 ? empty_on(ctx, xd.device(),
                                    {g.batch, g.out_channels / y_block, g.out_h, g.out_w, y_block},
                                    x.dtype(), MemoryCategory::activations)
             : y_channels_last
                 ? empty_channels_last(ctx, xd.device(), y_shape, x.dtype())
                 : empty_on(ctx, xd.device(), y_shape, x.dtype(), MemoryCategory::activations);
  fn::conv2d_forward(ctx, xd, wd, y, g);
  if (has_bias)  // (channels-last: rows of channels)
    kernels_for(ctx, y).channel_bias_add(ctx, y, contiguous(ctx, bias.data()),
                                         y_channels_last ? g.batch * g.out_plane() : g.batch,
                                         g.out_channels, y_channels_last ? 1 : g.out_plane());
  if (!needs_grad(ctx, {&x, &weight, &bias})) return Variable(std::move(y));
  auto node = make_pooled<detail::Conv2dNode>();
  node->x = xd;
  node->weight = wd;
  node->geometry = g;
  node->has_bias = has_bias;
  node->y_channels_last = y_channels_last;
  if (has_bias) return record(ctx, node, {&x, &weight, &bias}, std::move(y));
  return record(ctx, node, {&x, &weight}, std::move(y));
}

}  // namespace shardkit::autograd
