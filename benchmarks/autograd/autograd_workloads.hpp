// The workloads of the autograd benchmarks, shared by the CPU and GPU executables: one forward +
// backward of a conv / batch-norm / linear layer at ResNet shapes, and a ResNet-18 training step.
#pragma once

#include <benchmark/benchmark.h>

#include <functional>
#include <memory>

#include "shardkit/nn/nn.hpp"

namespace shardkit::bench::autograd_workloads {

namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;

inline ag::Variable random_variable(Context& ctx, Shape shape, bool requires_grad) {
  Tensor t = empty(ctx, std::move(shape), DType::f32, MemoryCategory::activations);
  uniform_(ctx, t, -1, 1);
  return ag::Variable(t, requires_grad);
}

// A prepared step: run() does one forward + backward; flops is its arithmetic (multiply-adds x2).
struct Workload {
  std::function<void()> run;
  double flops = 0;
  double bytes = 0;  // the floor: what its kernels must read and write, where counted
};

// conv2d fwd + bwd-data + bwd-filter: 3x the forward's 2*N*OC*OH*OW*C*K*K.
// (channels_last: the input, the output and its gradient stored NHWC, core/channels_last.hpp)
inline Workload conv_workload(Context& ctx, std::int64_t n, std::int64_t c, std::int64_t hw,
                              std::int64_t oc, std::int64_t k, std::int64_t stride,
                              bool channels_last = false) {
  auto x = std::make_shared<ag::Variable>(random_variable(ctx, {n, c, hw, hw}, true));
  auto w = std::make_shared<ag::Variable>(random_variable(ctx, {oc, c, k, k}, true));
  auto o = ag::Conv2dOptions::make(stride, k / 2);
  const std::int64_t out = (hw + 2 * (k / 2) - k) / stride + 1;
  auto grad = std::make_shared<Tensor>(full(ctx, {n, oc, out, out}, DType::f32, 1e-3));
  if (channels_last) {
    *x = ag::Variable(to_channels_last(ctx, x->data()), true);
    *grad = to_channels_last(ctx, *grad);
    o.channels_last = true;
  }
  Workload wl;
  wl.run = [&ctx, x, w, o, grad] {
    x->clear_grad();
    w->clear_grad();
    ag::backward(ctx, ag::conv2d(ctx, *x, *w, ag::Variable(), o), *grad);
  };
  wl.flops = 3.0 * 2.0 * double(n * oc * out * out) * double(c * k * k);
  return wl;
}

// Batch-norm forward + backward on [n, c, hw, hw]: NCHW for block == 0, else held in channel
// blocks of `block` (8 or 16: [n, c / block, hw, hw, block], core/channel_blocks.hpp); or
// channels-last (NHWC, core/channels_last.hpp).
inline Workload batch_norm_workload(Context& ctx, std::int64_t n, std::int64_t c, std::int64_t hw,
                                    std::int64_t block = 0, bool channels_last = false) {
  auto x = std::make_shared<ag::Variable>(random_variable(ctx, {n, c, hw, hw}, true));
  auto bn = std::make_shared<nn::BatchNorm>(ctx, c);
  auto grad = std::make_shared<Tensor>(full(ctx, {n, c, hw, hw}, DType::f32, 1e-3));
  if (channels_last) {
    *x = ag::Variable(to_channels_last(ctx, x->data()), true);
    *grad = to_channels_last(ctx, *grad);
  }
  if (block > 0) {
    *x = ag::Variable(to_channel_blocks(ctx, x->data(), block), true);
    *grad = to_channel_blocks(ctx, *grad, block);
    bn->options.channel_blocks = true;
  }
  Workload wl;
  wl.run = [&ctx, x, bn, grad] {
    x->clear_grad();
    bn->zero_grad();
    ag::backward(ctx, (*bn)(ctx, *x), *grad);
  };
  wl.flops = 10.0 * double(n * c * hw * hw);  // ~4 forward + ~6 backward per element
  return wl;
}

// ImageNet's stem max-pool (3 x 3, stride 2, padding 1) forward and backward on [n, c, hw, hw]
// f32, through the device's kernels alone (autograd's leaf would add a copy of x's gradient).
// Its floor on the GPU: x read and y written, with a byte per output for where the maximum lies
// (the u8 window offset), then that byte and y's gradient read and x's gradient written.
inline Workload max_pool_workload(Context& ctx, std::int64_t n, std::int64_t c, std::int64_t hw,
                                  bool channels_last = false) {
  const ag::cpu::PoolGeometry p{3, 3, 2, 2, 1, 1};
  const std::int64_t ohw = (hw + 2 - 3) / 2 + 1;
  const auto make = [&](std::int64_t side, DType dtype) {
    return channels_last ? empty_channels_last(ctx, ctx.device(), {n, c, side, side}, dtype)
                         : empty(ctx, {n, c, side, side}, dtype);
  };
  auto x = std::make_shared<Tensor>(make(hw, DType::f32));
  copy(ctx, *x, random_variable(ctx, {n, c, hw, hw}, false).data());
  auto y = std::make_shared<Tensor>(make(ohw, DType::f32));
  auto argmax = std::make_shared<Tensor>(make(ohw, ag::max_pool_argmax_dtype(ctx.device(), p)));
  auto gy = std::make_shared<Tensor>(make(ohw, DType::f32));
  fill(ctx, *gy, 1e-3);
  auto gx = std::make_shared<Tensor>(make(hw, DType::f32));
  Workload wl;
  wl.run = [&ctx, p, x, y, argmax, gy, gx] {
    const auto& kernels = ag::kernels_for(ctx, *x);
    kernels.max_pool_forward(ctx, *x, *y, *argmax, p);
    kernels.max_pool_backward(ctx, *argmax, *gy, *gx, p);
  };
  const double in = double(n * c * hw * hw), out = double(n * c * ohw * ohw);
  wl.bytes = 2 * 4 * in + out * (4 + 1 + 1 + 4);
  return wl;
}

inline Workload linear_workload(Context& ctx, std::int64_t n, std::int64_t in, std::int64_t out) {
  auto x = std::make_shared<ag::Variable>(random_variable(ctx, {n, in}, true));
  auto layer = std::make_shared<nn::Linear>(ctx, in, out);
  auto grad = std::make_shared<Tensor>(full(ctx, {n, out}, DType::f32, 1e-3));
  Workload wl;
  wl.run = [&ctx, x, layer, grad] {
    x->clear_grad();
    layer->zero_grad();
    ag::backward(ctx, (*layer)(ctx, *x), *grad);
  };
  wl.flops = 3.0 * 2.0 * double(n * in * out);
  return wl;
}

// One ResNet-18 training step (forward, cross-entropy, backward; no optimizer) on `batch`
// images of `hw` x `hw`: the small-image stem for hw <= 64, ImageNet's otherwise. The
// activations' layout (channel blocks: the CPU only):
enum class ActivationLayout {
  nchw,
  // NHWC (ResNetOptions::channels_last), the images too, as PyTorch's
  // model.to(memory_format=torch.channels_last) with channels-last inputs
  channels_last,
  // oneDNN's channel blocks between the convolutions (ResNetOptions::channel_blocks): the
  // NCHW step's bits without its reorders
  channel_blocks,
};
// A classifier's training step on `images`: zero_grad, a training-mode forward, cross-entropy
// against label 0, backward.
inline Workload classifier_step(Context& ctx, std::shared_ptr<nn::Module> net,
                                const ag::Variable& images) {
  auto held = std::make_shared<ag::Variable>(images);
  auto labels = std::make_shared<Tensor>(zeros(ctx, {images.size(0)}, DType::i64));
  Workload wl;
  wl.run = [&ctx, net, held, labels] {
    net->zero_grad();
    ag::backward(ctx, ag::cross_entropy(ctx, (*net)(ctx, *held), *labels));
  };
  return wl;
}

inline Workload resnet18_step(Context& ctx, std::int64_t batch, std::int64_t hw,
                              std::int64_t classes, std::int64_t width = 64,
                              ActivationLayout layout = ActivationLayout::nchw) {
  const bool channels_last = layout == ActivationLayout::channels_last;
  nn::ResNetOptions o;
  o.num_classes = classes;
  o.small_image_stem = hw <= 64;
  o.base_channels = width;
  o.channels_last = channels_last;
  o.channel_blocks = layout == ActivationLayout::channel_blocks;
  ag::Variable pixels = random_variable(ctx, {batch, 3, hw, hw}, false);
  if (channels_last) pixels = ag::Variable(to_channels_last(ctx, pixels.data()));
  return classifier_step(ctx, nn::resnet18(ctx, o), pixels);
}

// ClassyVision's regnet_y_400mf training step, as resnet18_step's: zero_grad, a training-mode
// forward, cross-entropy against label 0, backward. Images of 64 pixels or less get the
// CIFAR-style stem (res_stem_cifar: 3 x 3 stride 1) and `classes` as given.
inline Workload regnet_y_400mf_step(Context& ctx, std::int64_t batch, std::int64_t hw,
                                    std::int64_t classes) {
  nn::RegNetParams params;
  nn::RegNetOptions o;
  check(nn::regnet_named_params("regnet_y_400mf", params, o.use_se), "regnet_y_400mf unknown");
  o.num_classes = classes;
  o.stem = hw <= 64 ? nn::RegNetStem::res_stem_cifar : nn::RegNetStem::simple_stem_in;
  return classifier_step(ctx, nn::regnet(ctx, params, o),
                         random_variable(ctx, {batch, 3, hw, hw}, false));
}

}  // namespace shardkit::bench::autograd_workloads
