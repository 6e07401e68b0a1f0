// ResNet-18/34/50/101/152 and ResNeXt in torchvision's layout (state-dict names conv1.weight,
// layer1.0.bn2.bias, layer2.0.downsample.0.weight, fc.weight...), with a small-image stem option
// (3x3 stride-1 conv, no max-pool) for 28x28 and 32x32 inputs. The network is a Sequential of its
// top-level children, so it can be split into checkpointed segments.
#pragma once

#include <array>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/nn/trunk.hpp"

namespace shardkit::nn {

enum class ResNetInit {
  pytorch_default,  // each layer's reset_parameters (kaiming_uniform a=sqrt(5), BN 1/0)
  torchvision,      // plus torchvision's kaiming_normal fan_out on convs
};

struct ResNetOptions {
  std::int64_t num_classes = 1000;  // 0: no fc (a trunk for a projection head)
  bool small_image_stem = false;
  DType dtype = DType::f32;
  ResNetInit init = ResNetInit::pytorch_default;
  bool zero_init_residual = false;  // last BN of each block starts at 0 (torchvision option)
  bool batch_norm_f32 = false;      // f16/bf16 activations through f32 batch-norm
  // Channels of the stem and the first stage (torchvision: 64); the stages double it. Smaller
  // values give the same architecture at a fraction of the cost (tests, CPU benchmarks).
  std::int64_t base_channels = 64;
  std::int64_t in_channels = 3;  // 1 for grayscale images (Fashion-MNIST)
  // The ReLU after the stem's bn1 and a block's bn1 (and bn2 in a bottleneck) runs inside that
  // batch-norm, and the one after the residual addition inside the addition (autograd::add_relu):
  // the same bits, a pass over the activation fewer each way for the batch-norms and one fewer
  // forward for the addition. The modules then differ from torchvision's: a forward hook on a
  // bn1 sees the output after the ReLU, a block's `relu` module is not called, and the network
  // has no `relu` child after its bn1 (no parameters: the state dict is torchvision's). False
  // keeps torchvision's modules and calls, for hooks that count on them.
  bool fuse_bn_relu = true;
  // Activations stored channels-last (NHWC memory, core/channels_last.hpp) from the stem's
  // output on: on the CPU oneDNN's convolutions then read and write them without reordering them
  // into a blocked layout and back around every call (for narrow networks most of a
  // convolution's time); on a GPU cuDNN's NHWC kernels run without the layout transposes they
  // make around NCHW tensors (18% of the kernel time of an H200's ResNet-18 step). Batch-norm,
  // max-pooling on the GPU, the residual additions and the ReLUs run in that layout. Convolutions
  // then take other kernels: the results agree to rounding, not bit for bit, with the NCHW
  // network's. No effect for half-precision activations on the CPU.
  bool channels_last = false;
  // Activations kept in the channel blocks oneDNN's convolution kernels compute in
  // (core/channel_blocks.hpp; CPU, f32) from the stem's convolution to the last residual block
  // (the max-pool of ImageNet's stem pools them as they are), which returns [N, C, H, W] to the
  // pooling: the convolutions and batch-norms pass them on without the reorders into those
  // blocks and back that every NCHW convolution makes. The kernels are the NCHW network's own,
  // and batch-norm's sums keep their order, so the results are the NCHW network's (bit for bit
  // in the SwAV quick run; core/channel_blocks.hpp says where the last bits of a double sum may
  // differ). Forward hooks on the modules in between see 5-D [N, C/b, H, W, b] tensors
  // (from_channel_blocks gives [N, C, H, W]). No effect on the GPU or for other dtypes.
  bool channel_blocks = false;
  // ResNeXt (torchvision's resnext50_32x4d: groups 32, width_per_group 4): a bottleneck's 3 x 3
  // convolution is grouped, `groups` groups of planes * width_per_group / 64 channels each (64:
  // the plain ResNet). Bottleneck networks only, as in torchvision.
  std::int64_t groups = 1;
  std::int64_t width_per_group = 64;
};

namespace detail {

inline std::shared_ptr<Conv2d> conv(Context& ctx, std::int64_t in, std::int64_t out,
                                    std::int64_t kernel, std::int64_t stride,
                                    const ResNetOptions& o, std::int64_t groups = 1) {
  auto c =
      std::make_shared<Conv2d>(ctx, in, out, kernel, stride, kernel / 2, false, o.dtype, groups);
  c->options.channels_last = o.channels_last;
  if (o.init == ResNetInit::torchvision) init::kaiming_normal_fan_out_(ctx, c->weight.data());
  return c;
}

inline std::shared_ptr<BatchNorm> bn(Context& ctx, std::int64_t channels, const ResNetOptions& o) {
  return std::make_shared<BatchNorm>(ctx, channels, 2, o.dtype, 1e-5, 0.1, o.batch_norm_f32);
}

// A residual block's convolution and batch-norm: in channel blocks when the network keeps them.
inline std::shared_ptr<Conv2d> block_conv(Context& ctx, std::int64_t in, std::int64_t out,
                                          std::int64_t kernel, std::int64_t stride,
                                          const ResNetOptions& o, std::int64_t groups = 1) {
  auto c = conv(ctx, in, out, kernel, stride, o, groups);
  c->options.channel_blocks = o.channel_blocks;
  return c;
}

inline std::shared_ptr<BatchNorm> block_bn(Context& ctx, std::int64_t channels,
                                           const ResNetOptions& o) {
  auto b = bn(ctx, channels, o);
  b->options.channel_blocks = o.channel_blocks;
  return b;
}

// The end of a residual block: relu(out + identity), the identity first put in out's layout
// (with channel blocks, the first block gets [N, C, H, W] where the stem's convolution did not
// write blocks), and the result returned as [N, C, H, W] by the network's last block. With
// `fused` (the block's ReLUs fused: ResNetOptions::fuse_bn_relu) the addition and the ReLU are
// one pass (autograd::add_relu; the same values), and the `relu` module is not called.
inline Variable residual_end(Context& ctx, Module& relu, const Variable& out,
                             const Variable& identity, bool ends_trunk, bool fused) {
  const Variable skip = autograd::channel_blocks_like(ctx, identity, out);
  Variable y =
      fused ? autograd::add_relu(ctx, out, skip) : relu(ctx, autograd::add(ctx, out, skip));
  if (ends_trunk && has_channel_block_form(y.data())) y = autograd::from_channel_blocks(ctx, y);
  return y;
}

}  // namespace detail

class BasicBlock : public Module {
 public:
  static constexpr std::int64_t kExpansion = 1;
  BasicBlock(Context& ctx, std::int64_t in, std::int64_t planes, std::int64_t stride,
             const ResNetOptions& o) {
    check(o.groups == 1 && o.width_per_group == 64, "ResNet: groups ", o.groups,
          " and width_per_group ", o.width_per_group,
          " ask for ResNeXt blocks, which only bottleneck networks have (depth 50 and more); use "
          "groups 1 and width_per_group 64 with basic blocks");
    conv1 = register_module("conv1", detail::block_conv(ctx, in, planes, 3, stride, o));
    bn1 = register_module("bn1", detail::block_bn(ctx, planes, o));
    bn1->options.relu = o.fuse_bn_relu;  // the ReLU after bn1, inside it
    relu = register_module("relu", std::make_shared<ReLU>());
    conv2 = register_module("conv2", detail::block_conv(ctx, planes, planes, 3, 1, o));
    bn2 = register_module("bn2", detail::block_bn(ctx, planes, o));
    if (o.zero_init_residual) fill(ctx, bn2->weight.data(), 0.0);
    if (stride != 1 || in != planes) {
      downsample = register_module("downsample", std::make_shared<Sequential>());
      downsample->push_back(detail::block_conv(ctx, in, planes, 1, stride, o));
      downsample->push_back(detail::block_bn(ctx, planes, o));
    }
  }
  const char* type_name() const override { return "BasicBlock"; }
  Variable forward(Context& ctx, const Variable& x) override {
    Variable out = (*bn1)(ctx, (*conv1)(ctx, x));  // (with the first ReLU, when fused)
    if (!bn1->options.relu) out = (*relu)(ctx, out);
    out = (*bn2)(ctx, (*conv2)(ctx, out));
    return detail::residual_end(ctx, *relu, out, downsample ? (*downsample)(ctx, x) : x, ends_trunk,
                                bn1->options.relu);
  }
  bool ends_trunk = false;  // the network's last block (returns [N, C, H, W])
  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<BatchNorm> bn1, bn2;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> downsample;
};

class Bottleneck : public Module {
 public:
  static constexpr std::int64_t kExpansion = 4;
  Bottleneck(Context& ctx, std::int64_t in, std::int64_t planes, std::int64_t stride,
             const ResNetOptions& o) {
    const std::int64_t out = planes * kExpansion;
    // torchvision's: int(planes * (width_per_group / 64.)) * groups
    check(o.groups >= 1, "ResNet: groups ", o.groups,
          " is no number of groups for the bottleneck's 3 x 3 convolutions; use groups >= 1 (1 "
          "for ResNet, e.g. 32 for ResNeXt)");
    const std::int64_t width = planes * o.width_per_group / 64 * o.groups;
    check(width > 0, "ResNet: groups ", o.groups, " and width_per_group ", o.width_per_group,
          " leave a bottleneck of ", planes,
          " planes no channels (planes x width_per_group / 64 rounds to 0); use width_per_group "
          ">= ",
          (64 + planes - 1) / planes, " or more base channels");
    conv1 = register_module("conv1", detail::block_conv(ctx, in, width, 1, 1, o));
    bn1 = register_module("bn1", detail::block_bn(ctx, width, o));
    conv2 = register_module("conv2",  // v1.5: the stride here; ResNeXt's groups here
                            detail::block_conv(ctx, width, width, 3, stride, o, o.groups));
    bn2 = register_module("bn2", detail::block_bn(ctx, width, o));
    conv3 = register_module("conv3", detail::block_conv(ctx, width, out, 1, 1, o));
    bn3 = register_module("bn3", detail::block_bn(ctx, out, o));
    bn1->options.relu = bn2->options.relu = o.fuse_bn_relu;  // the ReLUs after them, inside
    relu = register_module("relu", std::make_shared<ReLU>());
    if (o.zero_init_residual) fill(ctx, bn3->weight.data(), 0.0);
    if (stride != 1 || in != out) {
      downsample = register_module("downsample", std::make_shared<Sequential>());
      downsample->push_back(detail::block_conv(ctx, in, out, 1, stride, o));
      downsample->push_back(detail::block_bn(ctx, out, o));
    }
  }
  const char* type_name() const override { return "Bottleneck"; }
  Variable forward(Context& ctx, const Variable& x) override {
    Variable y = (*bn1)(ctx, (*conv1)(ctx, x));  // (bn1 and bn2 with their ReLUs, when fused)
    if (!bn1->options.relu) y = (*relu)(ctx, y);
    y = (*bn2)(ctx, (*conv2)(ctx, y));
    if (!bn2->options.relu) y = (*relu)(ctx, y);
    y = (*bn3)(ctx, (*conv3)(ctx, y));
    return detail::residual_end(ctx, *relu, y, downsample ? (*downsample)(ctx, x) : x, ends_trunk,
                                bn1->options.relu);
  }
  bool ends_trunk = false;  // the network's last block (returns [N, C, H, W])
  std::shared_ptr<Conv2d> conv1, conv2, conv3;
  std::shared_ptr<BatchNorm> bn1, bn2, bn3;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> downsample;
};

class ResNet : public Trunk {
 public:
  const char* type_name() const override { return "ResNet"; }
  std::vector<std::string> stage_names() const override {
    return {"layer1", "layer2", "layer3", "layer4"};
  }

  // The [C, H, W] that child `name` (conv1, bn1, relu, maxpool, layer1 ... layer4, avgpool)
  // returns for images of h x w pixels, known without a forward: what an estimate made before
  // the run needs of a layer's features (the SwAV trainer's kNN memory). Every window that
  // shrinks the images here halves them as floor((n - 1) / 2) + 1: the 7 x 7 stem convolution
  // (padding 3), the max-pool's 3 x 3 (padding 1) and each later stage's first 3 x 3 (padding 1)
  // and 1 x 1 convolutions, all at stride 2.
  std::array<std::int64_t, 3> child_output_shape(std::string_view name, std::int64_t h,
                                                 std::int64_t w) const override {
    check(h >= 1 && w >= 1, "ResNet::child_output_shape: images of ", h, " x ", w,
          " pixels; both sides must be >= 1");
    std::array<std::int64_t, 3> shape{stage_channels[0], h, w};  // (the stem's channels)
    std::string names;
    for (const auto& [child, module] : children()) {
      if (child == "flatten" || child == "fc") break;  // (no [C, H, W] past here)
      if ((child == "conv1" && !small_image_stem) || child == "maxpool")
        shape = shrink_by_stride(shape, 2);
      if (child.starts_with("layer")) {
        const int stage = child[5] - '1';
        if (stage > 0) shape = shrink_by_stride(shape, 2);
        shape[0] = stage_channels[static_cast<std::size_t>(stage)] * expansion;
      }
      if (child == "avgpool") shape = {shape[0], 1, 1};
      if (child == name) return shape;
      names += (names.empty() ? "" : ", ") + child;
    }
    throw InvalidArgument("ResNet::child_output_shape: no child \"" + std::string(name) +
                          "\" with a [C, H, W] output; the children that have one: " + names);
  }

  // The architecture child_output_shape reads (set by the builder): the stem's kind, each
  // stage's planes (the stem has the first's) and the blocks' channel expansion.
  bool small_image_stem = false;
  std::array<std::int64_t, 4> stage_channels{};
  std::int64_t expansion = 1;
};

namespace detail {

template <class Block>
std::shared_ptr<ResNet> build_resnet(Context& ctx, const std::vector<int>& blocks,
                                     const ResNetOptions& o) {
  check(o.num_classes >= 0, "ResNet: num_classes ", o.num_classes, " must be >= 0");
  check(o.base_channels > 0, "ResNet: base_channels ", o.base_channels, " must be > 0");
  check(o.in_channels > 0, "ResNet: in_channels ", o.in_channels, " must be > 0");
  check(!(o.channels_last && o.channel_blocks),
        "ResNet: channels_last and channel_blocks are two layouts for the same activations; "
        "choose one");
  const std::int64_t c = o.base_channels;
  auto net = std::make_shared<ResNet>();
  // (channel blocks from the stem's convolution on)
  if (o.small_image_stem)
    net->add("conv1", block_conv(ctx, o.in_channels, c, 3, 1, o));
  else
    net->add("conv1", block_conv(ctx, o.in_channels, c, 7, 2, o));
  auto bn1 = block_bn(ctx, c, o);
  bn1->options.relu = o.fuse_bn_relu;  // the stem's ReLU inside its batch-norm, or its own module
  net->add("bn1", bn1);
  if (!o.fuse_bn_relu) net->add("relu", std::make_shared<ReLU>());
  if (!o.small_image_stem) {
    auto maxpool = std::make_shared<MaxPool2d>(3, 2, 1);
    maxpool->channel_blocks = o.channel_blocks;
    net->add("maxpool", maxpool);
  }
  std::int64_t in = c;
  const std::int64_t planes[] = {c, 2 * c, 4 * c, 8 * c};
  net->small_image_stem = o.small_image_stem;
  net->stage_channels = {planes[0], planes[1], planes[2], planes[3]};
  net->expansion = Block::kExpansion;
  for (std::size_t stage = 0; stage < 4; ++stage) {
    auto layer = std::make_shared<Sequential>();
    for (int b = 0; b < blocks[stage]; ++b) {
      const std::int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      auto block = std::make_shared<Block>(ctx, in, planes[stage], stride, o);
      block->ends_trunk = stage == 3 && b + 1 == blocks[stage];
      layer->push_back(block);
      in = planes[stage] * Block::kExpansion;
    }
    net->add("layer" + std::to_string(stage + 1), layer);
  }
  net->add("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  net->add("flatten", std::make_shared<Flatten>());
  if (o.num_classes > 0)
    net->add("fc", std::make_shared<Linear>(ctx, in, o.num_classes, true, o.dtype));
  net->feature_dim = in;
  return net;
}

}  // namespace detail

inline std::shared_ptr<ResNet> resnet18(Context& ctx, const ResNetOptions& o = {}) {
  return detail::build_resnet<BasicBlock>(ctx, {2, 2, 2, 2}, o);
}
inline std::shared_ptr<ResNet> resnet34(Context& ctx, const ResNetOptions& o = {}) {
  return detail::build_resnet<BasicBlock>(ctx, {3, 4, 6, 3}, o);
}
inline std::shared_ptr<ResNet> resnet50(Context& ctx, const ResNetOptions& o = {}) {
  return detail::build_resnet<Bottleneck>(ctx, {3, 4, 6, 3}, o);
}
inline std::shared_ptr<ResNet> resnet101(Context& ctx, const ResNetOptions& o = {}) {
  return detail::build_resnet<Bottleneck>(ctx, {3, 4, 23, 3}, o);
}
inline std::shared_ptr<ResNet> resnet152(Context& ctx, const ResNetOptions& o = {}) {
  return detail::build_resnet<Bottleneck>(ctx, {3, 8, 36, 3}, o);
}

// Whether torchvision has a ResNet of `depth`: 18, 34, 50, 101 or 152.
inline bool is_resnet_depth(int depth) {
  return depth == 18 || depth == 34 || depth == 50 || depth == 101 || depth == 152;
}

// The ResNet of `depth` (is_resnet_depth) with `o`; another depth is refused by name.
inline std::shared_ptr<ResNet> resnet(Context& ctx, int depth, const ResNetOptions& o = {}) {
  switch (depth) {
    case 18:
      return resnet18(ctx, o);
    case 34:
      return resnet34(ctx, o);
    case 50:
      return resnet50(ctx, o);
    case 101:
      return resnet101(ctx, o);
    case 152:
      return resnet152(ctx, o);
    default:
      fail<InvalidArgument>("ResNet: depth ", depth,
                            " is not one of torchvision's; use 18, 34, 50, ", "101 or 152");
  }
}

// A network named as torchvision names it: "resnet<depth>" or "resnext<depth>_<groups>x<width
// per group>d" (resnext50_32x4d, resnext101_32x8d); `o` gives the other options. Returns
// nullptr for a name of neither form.
inline std::shared_ptr<ResNet> resnet_named(Context& ctx, const std::string& name,
                                            ResNetOptions o = {}) {
  // Digits only, no sign, space or leading zero: "resnet 50" or "resnet050" is no such name.
  static const std::regex plain("resnet([1-9][0-9]{0,3})");
  static const std::regex grouped("resnext([1-9][0-9]{0,3})_([1-9][0-9]{0,3})x([1-9][0-9]{0,3})d");
  std::smatch m;
  if (std::regex_match(name, m, plain)) return resnet(ctx, std::stoi(m[1].str()), o);
  if (std::regex_match(name, m, grouped)) {
    o.groups = std::stoi(m[2].str());
    o.width_per_group = std::stoi(m[3].str());
    return resnet(ctx, std::stoi(m[1].str()), o);
  }
  return nullptr;
}

}  // namespace shardkit::nn
