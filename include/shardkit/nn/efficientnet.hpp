// EfficientNet (Tan and Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
// Networks", 2019) as ClassyVision builds it -- the trunk of VISSL's efficientnet configs (SwAV's
// and SimCLR's models/efficientnet_B0 ... B2).
//
// B0 is seven stages of mobile inverted bottleneck blocks (MBConv): a 1 x 1 expansion to
// expand_ratio x the input width (none where the ratio is 1), a depthwise k x k convolution
// (groups = channels, the stage's stride on its first block), squeeze-and-excitation (the
// channels' means through a 1 x 1 convolution to se_ratio x the block's *input* width, SiLU, one
// back, a sigmoid that scales each channel), and a 1 x 1 projection, each convolution followed
// by a batch-norm and all but the projection's by SiLU; where the shape is kept, the block's
// input is added back, after drop connect (each sample's branch zeroed with probability
// rate x i / blocks for block i while training). B1 ... B7 scale every width by the width
// coefficient (rounded to the width divisor, never more than 10% down) and every stage's depth
// by the depth coefficient (rounded up). A 3 x 3 stride-2 stem before, and after, a 1 x 1
// convolution to 1280 (scaled) channels, the global mean and dropout.
//
// The children take the names VISSL's efficientnet trunk gives its feature blocks: conv1 (the
// stem, its batch-norm and activation), block0 ... block<n-1>, conv_final (the 1 x 1 head, its
// batch-norm and activation), avgpool, flatten and dropout (where the model's rate is above 0);
// inside a block ClassyVision's names (expand_conv, bn0, depthwise_conv, bn1, se_reduce,
// se_expand, project_conv, bn2). The weights start as ClassyVision's init_weights sets them:
// convolutions N(0, sqrt(2 / fan_out)) with fan_out = k x k x out_channels (the depthwise ones
// too), their biases 0, batch-norms 1 and 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "shardkit/nn/trunk.hpp"

namespace shardkit::nn {

// ClassyVision's EfficientNetParams.
struct EfficientNetParams {
  double width_coefficient = 1.0, depth_coefficient = 1.0;
  std::int64_t resolution = 224;
  double dropout_rate = 0.2;
};

// The parameters of EfficientNet-`version` (B0 ... B7); false for another name.
inline bool efficientnet_named_params(const std::string& version, EfficientNetParams& p) {
  struct Named {
    const char* version;
    EfficientNetParams params;
  };
  static constexpr Named kNamed[] = {
      {"B0", {1.0, 1.0, 224, 0.2}}, {"B1", {1.0, 1.1, 240, 0.2}}, {"B2", {1.1, 1.2, 260, 0.3}},
      {"B3", {1.2, 1.4, 300, 0.3}}, {"B4", {1.4, 1.8, 380, 0.4}}, {"B5", {1.6, 2.2, 456, 0.4}},
      {"B6", {1.8, 2.6, 528, 0.5}}, {"B7", {2.0, 3.1, 600, 0.5}},
  };
  for (const Named& n : kNamed)
    if (version == n.version) {
      p = n.params;
      return true;
    }
  return false;
}

// What every block and the stem share (ClassyVision's EfficientNet arguments).
struct EfficientNetOptions {
  EfficientNetParams params;
  double bn_momentum = 0.01, bn_epsilon = 1e-3;
  double drop_connect_rate = 0.2;
  std::int64_t width_divisor = 8;
  std::int64_t min_width = 0;  // 0: the width divisor (ClassyVision's None)
  bool use_se = true;
  std::int64_t in_channels = 3;
  DType dtype = DType::f32;
};

// ClassyVision's scale_width: filters x coefficient rounded to the nearest multiple of the
// divisor (halves up), at least min_width, and a divisor more where that lost over 10%.
inline std::int64_t efficientnet_width(std::int64_t filters, const EfficientNetOptions& o) {
  const double coefficient = o.params.width_coefficient;
  if (coefficient == 0) return filters;
  const double scaled = double(filters) * coefficient;
  const std::int64_t divisor = o.width_divisor;
  const std::int64_t min_width = o.min_width > 0 ? o.min_width : divisor;
  std::int64_t width = std::max(
      min_width, static_cast<std::int64_t>(scaled + double(divisor) / 2) / divisor * divisor);
  if (double(width) < 0.9 * scaled) width += divisor;
  return width;
}

// ClassyVision's scale_depth: repeats x coefficient, rounded up.
inline std::int64_t efficientnet_depth(std::int64_t repeats, double coefficient) {
  if (coefficient == 0) return repeats;
  return static_cast<std::int64_t>(std::ceil(coefficient * double(repeats)));
}

// One MBConv block's shape.
struct MBConvSpec {
  std::int64_t in = 0, out = 0, expand_ratio = 1, kernel = 3, stride = 1;
  double se_ratio = 0.25;
  bool id_skip = true;
  double drop_connect_rate = 0;  // this block's (the model's rate x i / blocks)
};

// Every block of the network `o` describes, in order (ClassyVision's BLOCK_PARAMS, scaled).
inline std::vector<MBConvSpec> efficientnet_blocks(const EfficientNetOptions& o) {
  struct Stage {
    std::int64_t repeats, kernel, stride, expand_ratio, in, out;
  };
  static constexpr Stage kB0[] = {
      {1, 3, 1, 1, 32, 16},  {2, 3, 2, 6, 16, 24},   {2, 5, 2, 6, 24, 40},  {3, 3, 2, 6, 40, 80},
      {3, 5, 1, 6, 80, 112}, {4, 5, 2, 6, 112, 192}, {1, 3, 1, 6, 192, 320}};
  std::vector<MBConvSpec> blocks;
  for (const Stage& s : kB0) {
    const std::int64_t in = efficientnet_width(s.in, o), out = efficientnet_width(s.out, o);
    const std::int64_t repeats = efficientnet_depth(s.repeats, o.params.depth_coefficient);
    for (std::int64_t r = 0; r < repeats; ++r)
      blocks.push_back(
          {r == 0 ? in : out, out, s.expand_ratio, s.kernel, r == 0 ? s.stride : 1, 0.25, true, 0});
  }
  for (std::size_t i = 0; i < blocks.size(); ++i)
    blocks[i].drop_connect_rate = o.drop_connect_rate * double(i) / double(blocks.size());
  return blocks;
}

namespace detail {

inline std::shared_ptr<Conv2d> efficientnet_conv(Context& ctx, std::int64_t in, std::int64_t out,
                                                 std::int64_t kernel, std::int64_t stride,
                                                 const EfficientNetOptions& o,
                                                 std::int64_t groups = 1, bool bias = false) {
  auto c = std::make_shared<Conv2d>(ctx, in, out, kernel, stride, (kernel - 1) / 2, bias, o.dtype,
                                    groups);
  init::kaiming_normal_fan_out_(ctx, c->weight.data());
  if (bias) fill(ctx, c->bias.data(), 0.0);
  return c;
}

inline std::shared_ptr<BatchNorm> efficientnet_bn(Context& ctx, std::int64_t channels,
                                                  const EfficientNetOptions& o) {
  return std::make_shared<BatchNorm>(ctx, channels, 2, o.dtype, o.bn_epsilon, o.bn_momentum);
}

// A convolution, its batch-norm and SiLU, as nn.Sequential "0", "1", "2" (the stem, the head).
inline std::shared_ptr<Sequential> conv_bn_silu(Context& ctx, std::int64_t in, std::int64_t out,
                                                std::int64_t kernel, std::int64_t stride,
                                                const EfficientNetOptions& o) {
  auto s = std::make_shared<Sequential>();
  s->push_back(efficientnet_conv(ctx, in, out, kernel, stride, o));
  s->push_back(efficientnet_bn(ctx, out, o));
  s->push_back(std::make_shared<SiLU>());
  return s;
}

}  // namespace detail

// ClassyVision's MBConvBlock.
class MBConvBlock : public Module {
 public:
  MBConvBlock(Context& ctx, const MBConvSpec& spec, const EfficientNetOptions& o) : spec(spec) {
    check(spec.in >= 1 && spec.out >= 1 && spec.expand_ratio >= 1 && spec.kernel % 2 == 1 &&
              spec.stride >= 1 && (!o.use_se || (spec.se_ratio > 0 && spec.se_ratio <= 1)) &&
              spec.drop_connect_rate >= 0 && spec.drop_connect_rate < 1,
          "MBConvBlock: in ", spec.in, ", out ", spec.out, ", expand_ratio ", spec.expand_ratio,
          ", kernel ", spec.kernel, ", stride ", spec.stride, ", se_ratio ", spec.se_ratio,
          ", drop_connect_rate ", spec.drop_connect_rate,
          "; widths, ratio and stride must be >= 1, the kernel odd, se_ratio in (0, 1] (as "
          "ClassyVision asserts; use_se = false for no squeeze-and-excitation) and "
          "drop_connect_rate in [0, 1)");
    const std::int64_t expanded = spec.in * spec.expand_ratio;
    if (spec.expand_ratio != 1) {
      expand_conv = register_module("expand_conv",
                                    detail::efficientnet_conv(ctx, spec.in, expanded, 1, 1, o));
      bn0 = register_module("bn0", detail::efficientnet_bn(ctx, expanded, o));
    }
    depthwise_conv = register_module(
        "depthwise_conv",
        detail::efficientnet_conv(ctx, expanded, expanded, spec.kernel, spec.stride, o, expanded));
    bn1 = register_module("bn1", detail::efficientnet_bn(ctx, expanded, o));
    if (o.use_se) {  // (the reduction counted from the block's input width)
      const auto reduced =
          std::max<std::int64_t>(1, static_cast<std::int64_t>(double(spec.in) * spec.se_ratio));
      se_reduce = register_module(
          "se_reduce", detail::efficientnet_conv(ctx, expanded, reduced, 1, 1, o, 1, true));
      se_expand = register_module(
          "se_expand", detail::efficientnet_conv(ctx, reduced, expanded, 1, 1, o, 1, true));
    }
    project_conv = register_module("project_conv",
                                   detail::efficientnet_conv(ctx, expanded, spec.out, 1, 1, o));
    bn2 = register_module("bn2", detail::efficientnet_bn(ctx, spec.out, o));
  }
  const char* type_name() const override { return "MBConvBlock"; }

  Variable forward(Context& ctx, const Variable& input) override {
    Variable x = input;
    if (expand_conv) x = autograd::silu(ctx, (*bn0)(ctx, (*expand_conv)(ctx, x)));
    x = autograd::silu(ctx, (*bn1)(ctx, (*depthwise_conv)(ctx, x)));
    if (se_reduce) {
      const Variable squeezed = autograd::adaptive_avg_pool2d(ctx, x, 1, 1);
      const Variable excited = (*se_expand)(ctx, autograd::silu(ctx, (*se_reduce)(ctx, squeezed)));
      x = autograd::channel_scale(ctx, x, autograd::sigmoid(ctx, excited));
    }
    x = (*bn2)(ctx, (*project_conv)(ctx, x));
    if (!has_skip()) return x;
    if (is_training() && spec.drop_connect_rate > 0)
      x = autograd::drop_connect(ctx, x, spec.drop_connect_rate);
    return autograd::add(ctx, x, input);
  }
  // Whether the input is added back (only then is drop connect applied).
  bool has_skip() const { return spec.id_skip && spec.stride == 1 && spec.in == spec.out; }

  MBConvSpec spec;
  std::shared_ptr<Conv2d> expand_conv, depthwise_conv, se_reduce, se_expand, project_conv;
  std::shared_ptr<BatchNorm> bn0, bn1, bn2;
};

class EfficientNet : public Trunk {
 public:
  const char* type_name() const override { return "EfficientNet"; }
  // VISSL names no stages res2 ... res5 in an EfficientNet: its features are its children's.
  std::vector<std::string> stage_names() const override { return {}; }
  std::vector<std::string> block_paths() const override {
    std::vector<std::string> paths;
    for (std::size_t i = 0; i < blocks.size(); ++i) paths.push_back("block" + std::to_string(i));
    return paths;
  }

  // The [C, H, W] of child `name` (conv1, block<i>, conv_final, avgpool) for h x w images: the
  // stem and each depthwise convolution are k x k with padding (k - 1) / 2, which at stride s
  // gives floor((n - 1) / s) + 1.
  std::array<std::int64_t, 3> child_output_shape(std::string_view name, std::int64_t h,
                                                 std::int64_t w) const override {
    check(h >= 1 && w >= 1, "EfficientNet::child_output_shape: images of ", h, " x ", w,
          " pixels; both sides must be >= 1");
    std::array<std::int64_t, 3> shape = shrink_by_stride({stem_width, h, w}, 2);
    if (name == "conv1") return shape;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      shape = shrink_by_stride(shape, blocks[i].stride);
      shape[0] = blocks[i].out;
      if (name == "block" + std::to_string(i)) return shape;
    }
    shape[0] = feature_dim;
    if (name == "conv_final") return shape;
    if (name == "avgpool") return {shape[0], 1, 1};
    throw InvalidArgument("EfficientNet::child_output_shape: no child \"" + std::string(name) +
                          "\" with a [C, H, W] output; the children that have one: conv1, block0 "
                          "... block" +
                          std::to_string(blocks.size() - 1) + ", conv_final, avgpool");
  }

  std::int64_t stem_width = 32;
  std::vector<MBConvSpec> blocks;
};

// The EfficientNet `o` describes (ClassyVision's EfficientNet without its classifier).
inline std::shared_ptr<EfficientNet> efficientnet(Context& ctx, const EfficientNetOptions& o) {
  const EfficientNetParams& p = o.params;
  check(p.width_coefficient >= 0 && p.depth_coefficient >= 0 && p.dropout_rate >= 0 &&
            p.dropout_rate < 1 && o.drop_connect_rate >= 0 && o.drop_connect_rate < 1 &&
            o.width_divisor >= 1 && o.min_width >= 0 && o.in_channels >= 1,
        "EfficientNet: width_coefficient ", p.width_coefficient, ", depth_coefficient ",
        p.depth_coefficient, ", dropout_rate ", p.dropout_rate, ", drop_connect_rate ",
        o.drop_connect_rate, ", width_divisor ", o.width_divisor, ", min_width ", o.min_width,
        ", in_channels ", o.in_channels,
        "; the coefficients must be >= 0, the rates in [0, 1), the divisor and channels >= 1 "
        "(B0: 1.0, 1.0, 0.2, 0.2, 8)");
  auto net = std::make_shared<EfficientNet>();
  net->stem_width = efficientnet_width(32, o);
  net->blocks = efficientnet_blocks(o);
  net->add("conv1", detail::conv_bn_silu(ctx, o.in_channels, net->stem_width, 3, 2, o));
  for (std::size_t i = 0; i < net->blocks.size(); ++i)
    net->add("block" + std::to_string(i), std::make_shared<MBConvBlock>(ctx, net->blocks[i], o));
  net->feature_dim = efficientnet_width(1280, o);
  net->add("conv_final",
           detail::conv_bn_silu(ctx, net->blocks.back().out, net->feature_dim, 1, 1, o));
  net->add("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  net->add("flatten", std::make_shared<Flatten>());
  if (p.dropout_rate > 0) net->add("dropout", std::make_shared<Dropout>(p.dropout_rate));
  return net;
}

}  // namespace shardkit::nn
