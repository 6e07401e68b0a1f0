// RegNetX / RegNetY (Radosavovic et al., "Designing Network Design Spaces", 2020) and their
// AnyNet form, as ClassyVision builds them -- the trunks of VISSL's SEER and of its RegNet SwAV
// configs. A RegNet is given by five numbers (depth, w_0, w_a, w_m, group_width): block j of
// `depth` gets the width w_0 * w_m^round(log(u_j / w_0) / log(w_m)) with u_j = w_0 + w_a * j,
// rounded to a multiple of 8, and each run of equal widths is a stage (regnet_stages). An AnyNet
// gives the stages' widths, depths, strides, group widths and bottleneck ratios directly.
//
// Every block is ClassyVision's ResBottleneckBlock: a 1 x 1 convolution to the bottleneck width
// (`f.a`), a grouped 3 x 3 (`f.b`, groups of group_width channels, the stage's stride), RegNetY's
// squeeze-and-excitation (`f.se`: the global mean of each channel through a 1 x 1 convolution to
// se_ratio x the block's input width, a ReLU, one back and a sigmoid, which scales the channel),
// a 1 x 1 convolution out (`f.c`, `f.final_bn`), and relu(f(x) + x) -- x through a strided 1 x 1
// convolution and batch-norm (`proj`, `bn`) where the width or the size changes.
//
// The network's children take the names VISSL's regnet trunk gives its feature blocks: conv1
// (the stem), res2, res3, ... (ClassyVision's trunk_output.block1, block2, ...), avgpool and
// flatten. The modules inside are named as in ClassyVision (conv1.stem.0.weight,
// res2.block1-0.f.a.0.weight, res2.block1-0.f.se.excitation.0.bias, ...), so a VISSL checkpoint's
// trunk maps onto it with the `_feature_blocks.` prefix removed. The ReLUs after the batch-norms
// run inside them, and the one after the residual addition inside it (ResNetOptions'
// fuse_bn_relu): the same values, and no parameters move.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "shardkit/nn/trunk.hpp"

namespace shardkit::nn {

enum class RegNetStem {
  simple_stem_in,  // 3 x 3 convolution, stride 2 (RegNet's)
  res_stem_in,     // ResNet's: 7 x 7 stride 2 and a 3 x 3 max-pool stride 2
  res_stem_cifar,  // 3 x 3 stride 1 (small images)
};

// One stage: `depth` blocks of `width` output channels, the first with `stride`.
struct RegNetStage {
  std::int64_t width = 0, stride = 2, depth = 0, group_width = 1;
  double bottleneck_multiplier = 1.0;
};

// ClassyVision's RegNetParams (its defaults).
struct RegNetParams {
  int depth = 0;
  double w_0 = 0, w_a = 0, w_m = 0;
  std::int64_t group_width = 0;
  double bottleneck_multiplier = 1.0;
};

// What every block and the stem share (ClassyVision's AnyNetParams beyond the stages).
struct RegNetOptions {
  RegNetStem stem = RegNetStem::simple_stem_in;
  std::int64_t stem_width = 32;
  bool use_se = true;  // RegNetY (false: RegNetX)
  double se_ratio = 0.25;
  double bn_epsilon = 1e-5, bn_momentum = 0.1;
  std::int64_t in_channels = 3;
  std::int64_t num_classes = 0;  // > 0: a classifier (fc) after the pooling and flatten
  DType dtype = DType::f32;
};

namespace detail {

// Python's round(): halves to even (the current rounding mode's nearest, as numpy.round).
inline double round_half_even(double x) { return std::nearbyint(x); }

}  // namespace detail

// The stages of RegNet `p`, as ClassyVision's RegNetParams.get_expanded_params: the quantised
// block widths, split where the width changes, then each stage's width and group width made
// compatible (the bottleneck width a multiple of the group width).
inline std::vector<RegNetStage> regnet_stages(const RegNetParams& p) {
  check(p.depth >= 1 && p.w_a >= 0 && p.w_0 > 0 && p.w_m > 1 && std::fmod(p.w_0, 8.0) == 0 &&
            p.group_width >= 1 && p.bottleneck_multiplier > 0,
        "RegNet: depth ", p.depth, ", w_0 ", p.w_0, ", w_a ", p.w_a, ", w_m ", p.w_m,
        ", group_width ", p.group_width, ", bottleneck_multiplier ", p.bottleneck_multiplier,
        " are not a RegNet's; depth >= 1, w_a >= 0, w_0 > 0 and a multiple of 8, w_m > 1, "
        "group_width >= 1, bottleneck_multiplier > 0 (e.g. regnet_y_400mf: 16, 48, 27.89, 2.09, "
        "8, 1.0)");
  constexpr double kQuantum = 8;
  std::vector<std::int64_t> widths;
  for (int j = 0; j < p.depth; ++j) {
    const double continuous = j * p.w_a + p.w_0;
    const double capacity = detail::round_half_even(std::log(continuous / p.w_0) / std::log(p.w_m));
    widths.push_back(static_cast<std::int64_t>(
        detail::round_half_even(p.w_0 * std::pow(p.w_m, capacity) / kQuantum) * kQuantum));
  }
  std::vector<RegNetStage> stages;
  for (std::size_t j = 0; j < widths.size(); ++j) {
    if (j == 0 || widths[j] != widths[j - 1])
      stages.push_back({widths[j], 2, 0, p.group_width, p.bottleneck_multiplier});
    ++stages.back().depth;
  }
  for (RegNetStage& s : stages) {  // (_adjust_widths_groups_compatibilty)
    const auto bottleneck = static_cast<std::int64_t>(double(s.width) * s.bottleneck_multiplier);
    check(bottleneck >= 1, "RegNet: a stage of ", s.width, " channels with bottleneck_multiplier ",
          s.bottleneck_multiplier, " has no bottleneck channel; use a larger multiplier");
    s.group_width = std::min(s.group_width, bottleneck);
    const auto quantised = static_cast<std::int64_t>(
        detail::round_half_even(double(bottleneck) / double(s.group_width)) *
        double(s.group_width));
    s.width = static_cast<std::int64_t>(double(quantised) / s.bottleneck_multiplier);
  }
  return stages;
}

// ClassyVision's registered RegNets (regnet_y_400mf ... regnet_y_256gf, regnet_x_400mf ...
// regnet_x_32gf): their parameters, and whether they have squeeze-and-excitation (Y) or not
// (X). False for another name.
inline bool regnet_named_params(const std::string& name, RegNetParams& p, bool& use_se) {
  struct Named {
    const char* name;
    int depth;
    double w_0, w_a, w_m;
    std::int64_t group_width;
    bool se;
  };
  static constexpr Named kNamed[] = {
      {"regnet_y_400mf", 16, 48, 27.89, 2.09, 8, true},
      {"regnet_y_800mf", 14, 56, 38.84, 2.4, 16, true},
      {"regnet_y_1.6gf", 27, 48, 20.71, 2.65, 24, true},
      {"regnet_y_3.2gf", 21, 80, 42.63, 2.66, 24, true},
      {"regnet_y_8gf", 17, 192, 76.82, 2.19, 56, true},
      {"regnet_y_16gf", 18, 200, 106.23, 2.48, 112, true},
      {"regnet_y_32gf", 20, 232, 115.89, 2.53, 232, true},
      {"regnet_y_64gf", 20, 352, 147.48, 2.4, 328, true},
      {"regnet_y_128gf", 27, 456, 160.83, 2.52, 264, true},
      {"regnet_y_256gf", 27, 640, 124.47, 2.04, 848, true},
      {"regnet_x_400mf", 22, 24, 24.48, 2.54, 16, false},
      {"regnet_x_800mf", 16, 56, 35.73, 2.28, 16, false},
      {"regnet_x_1.6gf", 18, 80, 34.01, 2.25, 24, false},
      {"regnet_x_3.2gf", 25, 88, 26.31, 2.25, 48, false},
      {"regnet_x_8gf", 23, 80, 49.56, 2.88, 120, false},
      {"regnet_x_16gf", 22, 216, 55.59, 2.1, 128, false},
      {"regnet_x_32gf", 23, 320, 69.86, 2.0, 168, false},
  };
  for (const Named& n : kNamed)
    if (name == n.name) {
      p = {n.depth, n.w_0, n.w_a, n.w_m, n.group_width, 1.0};
      use_se = n.se;
      return true;
    }
  return false;
}

// A block's widths as ClassyVision's BottleneckTransform makes them (each a whole number;
// `block_groups` 0 where the group width exceeds the bottleneck): the bottleneck's channels
// (the block's output width x the multiplier), the grouped 3 x 3's groups (bottleneck //
// group_width, which must then split the bottleneck evenly) and the squeeze-and-excitation's
// reduced width (se_ratio x the block's input width).
inline std::int64_t block_bottleneck(std::int64_t out, double bottleneck_multiplier) {
  return static_cast<std::int64_t>(detail::round_half_even(double(out) * bottleneck_multiplier));
}
inline std::int64_t block_groups(std::int64_t bottleneck, std::int64_t group_width) {
  return group_width >= 1 ? bottleneck / group_width : 0;
}
inline std::int64_t block_se_width(double se_ratio, std::int64_t in) {
  return static_cast<std::int64_t>(detail::round_half_even(se_ratio * double(in)));
}

// The names regnet_named_params knows, for messages.
inline std::string regnet_names() {
  return "regnet_y_400mf, regnet_y_800mf, regnet_y_1.6gf, regnet_y_3.2gf, regnet_y_8gf, "
         "regnet_y_16gf, regnet_y_32gf, regnet_y_64gf, regnet_y_128gf, regnet_y_256gf, "
         "regnet_x_400mf, regnet_x_800mf, regnet_x_1.6gf, regnet_x_3.2gf, regnet_x_8gf, "
         "regnet_x_16gf, regnet_x_32gf";
}

namespace detail {

// ClassyVision's init_weights: every convolution N(0, sqrt(2 / fan_out)) (its bias, the
// squeeze-and-excitation's, keeps nn.Conv2d's default), batch-norms 1 and 0.
inline std::shared_ptr<Conv2d> regnet_conv(Context& ctx, std::int64_t in, std::int64_t out,
                                           std::int64_t kernel, std::int64_t stride,
                                           const RegNetOptions& o, std::int64_t groups = 1,
                                           bool bias = false) {
  auto c =
      std::make_shared<Conv2d>(ctx, in, out, kernel, stride, kernel / 2, bias, o.dtype, groups);
  init::kaiming_normal_fan_out_(ctx, c->weight.data());
  return c;
}

inline std::shared_ptr<BatchNorm> regnet_bn(Context& ctx, std::int64_t channels,
                                            const RegNetOptions& o, bool relu) {
  auto b = std::make_shared<BatchNorm>(ctx, channels, 2, o.dtype, o.bn_epsilon, o.bn_momentum);
  b->options.relu = relu;
  return b;
}

// A convolution and its batch-norm (with the ReLU after it, inside), as nn.Sequential "0", "1".
inline std::shared_ptr<Sequential> conv_bn(Context& ctx, std::int64_t in, std::int64_t out,
                                           std::int64_t kernel, std::int64_t stride,
                                           const RegNetOptions& o, std::int64_t groups = 1) {
  auto s = std::make_shared<Sequential>();
  s->push_back(regnet_conv(ctx, in, out, kernel, stride, o, groups));
  s->push_back(regnet_bn(ctx, out, o, true));
  return s;
}

}  // namespace detail

// ClassyVision's SqueezeAndExcitationLayer: x times sigmoid(conv(relu(conv(mean of x over
// each channel's plane)))), the 1 x 1 convolutions with biases.
class SqueezeExcitation : public Module {
 public:
  SqueezeExcitation(Context& ctx, std::int64_t channels, std::int64_t reduced,
                    const RegNetOptions& o) {
    avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
    excitation = register_module("excitation", std::make_shared<Sequential>());
    excitation->push_back(detail::regnet_conv(ctx, channels, reduced, 1, 1, o, 1, true));
    excitation->push_back(std::make_shared<ReLU>());
    excitation->push_back(detail::regnet_conv(ctx, reduced, channels, 1, 1, o, 1, true));
    excitation->push_back(std::make_shared<Sigmoid>());
  }
  const char* type_name() const override { return "SqueezeExcitation"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return autograd::channel_scale(ctx, x, (*excitation)(ctx, (*avgpool)(ctx, x)));
  }
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<Sequential> excitation;
};

// ClassyVision's BottleneckTransform: a, b, se (RegNetY), c, final_bn.
class BottleneckTransform : public Module {
 public:
  BottleneckTransform(Context& ctx, std::int64_t in, std::int64_t out, std::int64_t stride,
                      std::int64_t group_width, double bottleneck_multiplier,
                      const RegNetOptions& o) {
    const std::int64_t width = block_bottleneck(out, bottleneck_multiplier);
    const std::int64_t groups = block_groups(width, group_width);
    check(groups >= 1 && width % groups == 0, "RegNet: a bottleneck of ", width,
          " channels with a group width of ", group_width, " makes ", groups,
          " groups, which do not split it evenly; use a group width that divides it");
    a = register_module("a", detail::conv_bn(ctx, in, width, 1, 1, o));
    b = register_module("b", detail::conv_bn(ctx, width, width, 3, stride, o, groups));
    // (the reduction counted from the block's input width; se_ratio 0 means no SE, as
    // ClassyVision's `if se_ratio:`)
    if (o.use_se && o.se_ratio != 0) {
      const std::int64_t reduced = block_se_width(o.se_ratio, in);
      check(reduced >= 1, "RegNet: se_ratio ", o.se_ratio, " of ", in,
            " channels leaves squeeze-and-excitation no channel; use a larger se_ratio (or "
            "use_se = false, or se_ratio 0, for no squeeze-and-excitation)");
      se = register_module("se", std::make_shared<SqueezeExcitation>(ctx, width, reduced, o));
    }
    c = register_module("c", detail::regnet_conv(ctx, width, out, 1, 1, o));
    final_bn = register_module("final_bn", detail::regnet_bn(ctx, out, o, false));
  }
  const char* type_name() const override { return "BottleneckTransform"; }
  Variable forward(Context& ctx, const Variable& x) override {
    Variable y = (*b)(ctx, (*a)(ctx, x));
    if (se) y = (*se)(ctx, y);
    return (*final_bn)(ctx, (*c)(ctx, y));
  }
  std::shared_ptr<Sequential> a, b;
  std::shared_ptr<SqueezeExcitation> se;
  std::shared_ptr<Conv2d> c;
  std::shared_ptr<BatchNorm> final_bn;
};

// ClassyVision's ResBottleneckBlock: relu(f(x) + x), x projected where the shape changes.
class ResBottleneckBlock : public Module {
 public:
  ResBottleneckBlock(Context& ctx, std::int64_t in, std::int64_t out, std::int64_t stride,
                     std::int64_t group_width, double bottleneck_multiplier,
                     const RegNetOptions& o) {
    if (in != out || stride != 1) {
      proj = register_module("proj", detail::regnet_conv(ctx, in, out, 1, stride, o));
      bn = register_module("bn", detail::regnet_bn(ctx, out, o, false));
    }
    f = register_module("f", std::make_shared<BottleneckTransform>(
                                 ctx, in, out, stride, group_width, bottleneck_multiplier, o));
  }
  const char* type_name() const override { return "ResBottleneckBlock"; }
  Variable forward(Context& ctx, const Variable& x) override {
    const Variable skip = proj ? (*bn)(ctx, (*proj)(ctx, x)) : x;
    return autograd::add_relu(ctx, skip, (*f)(ctx, x));
  }
  std::shared_ptr<Conv2d> proj;
  std::shared_ptr<BatchNorm> bn;
  std::shared_ptr<BottleneckTransform> f;
};

class RegNet : public Trunk {
 public:
  const char* type_name() const override { return "RegNet"; }
  std::vector<std::string> stage_names() const override {
    std::vector<std::string> names;
    for (std::size_t s = 0; s < stages.size(); ++s) names.push_back("res" + std::to_string(s + 2));
    return names;
  }

  // The [C, H, W] of child `name` (conv1, res2, ..., avgpool) for h x w images: every window
  // that shrinks them here is a 3 x 3 with padding 1 or a 1 x 1 without, which at stride s give
  // floor((n - 1) / s) + 1; ResNet's stem adds its 7 x 7 (padding 3) and max-pool (3 x 3,
  // padding 1) at stride 2, the same halving.
  std::array<std::int64_t, 3> child_output_shape(std::string_view name, std::int64_t h,
                                                 std::int64_t w) const override {
    check(h >= 1 && w >= 1, "RegNet::child_output_shape: images of ", h, " x ", w,
          " pixels; both sides must be >= 1");
    std::array<std::int64_t, 3> shape{stem_width, h, w};
    if (stem == RegNetStem::simple_stem_in) shape = shrink_by_stride(shape, 2);
    if (stem == RegNetStem::res_stem_in) shape = shrink_by_stride(shrink_by_stride(shape, 2), 2);
    if (name == "conv1") return shape;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      shape = shrink_by_stride(shape, stages[s].stride);
      shape[0] = stages[s].width;
      if (name == "res" + std::to_string(s + 2)) return shape;
    }
    if (name == "avgpool") return {shape[0], 1, 1};
    std::string names = "conv1";
    for (const std::string& stage : stage_names()) names += ", " + stage;
    throw InvalidArgument("RegNet::child_output_shape: no child \"" + std::string(name) +
                          "\" with a [C, H, W] output; the children that have one: " + names +
                          ", avgpool");
  }

  RegNetStem stem = RegNetStem::simple_stem_in;
  std::int64_t stem_width = 32;
  std::vector<RegNetStage> stages;
};

// An AnyNet of `stages` (ClassyVision's AnyNet with residual bottleneck blocks).
inline std::shared_ptr<RegNet> anynet(Context& ctx, const std::vector<RegNetStage>& stages,
                                      const RegNetOptions& o = {}) {
  check(!stages.empty(), "RegNet: no stages; give at least one");
  check(o.stem_width >= 1 && o.in_channels >= 1 && o.num_classes >= 0, "RegNet: stem_width ",
        o.stem_width, ", in_channels ", o.in_channels, ", num_classes ", o.num_classes,
        "; the first two must be >= 1, the last >= 0");
  for (std::size_t s = 0; s < stages.size(); ++s)
    check(stages[s].width >= 1 && stages[s].depth >= 1 && stages[s].stride >= 1 &&
              stages[s].group_width >= 1 && stages[s].bottleneck_multiplier > 0,
          "RegNet: stage ", s + 1, " has width ", stages[s].width, ", depth ", stages[s].depth,
          ", stride ", stages[s].stride, ", group_width ", stages[s].group_width,
          ", bottleneck_multiplier ", stages[s].bottleneck_multiplier,
          "; the first four must be >= 1, the multiplier > 0");
  auto net = std::make_shared<RegNet>();
  net->stem = o.stem;
  net->stem_width = o.stem_width;
  net->stages = stages;
  // conv1: ClassyVision's stem module, whose layers sit in a Sequential named `stem`.
  auto conv1 = std::make_shared<Sequential>();
  auto layers = std::make_shared<Sequential>();
  const bool resnet_stem = o.stem == RegNetStem::res_stem_in;
  const std::int64_t stride = o.stem == RegNetStem::res_stem_cifar ? 1 : 2;
  layers->push_back(
      detail::regnet_conv(ctx, o.in_channels, o.stem_width, resnet_stem ? 7 : 3, stride, o));
  layers->push_back(detail::regnet_bn(ctx, o.stem_width, o, true));
  if (resnet_stem) layers->add("3", std::make_shared<MaxPool2d>(3, 2, 1));  // ("2": the ReLU)
  conv1->add("stem", layers);
  net->add("conv1", conv1);
  std::int64_t in = o.stem_width;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    auto stage = std::make_shared<Sequential>();
    for (std::int64_t b = 0; b < stages[s].depth; ++b) {
      stage->add("block" + std::to_string(s + 1) + "-" + std::to_string(b),
                 std::make_shared<ResBottleneckBlock>(
                     ctx, in, stages[s].width, b == 0 ? stages[s].stride : 1, stages[s].group_width,
                     stages[s].bottleneck_multiplier, o));
      in = stages[s].width;
    }
    net->add("res" + std::to_string(s + 2), stage);
  }
  net->add("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  net->add("flatten", std::make_shared<Flatten>());
  if (o.num_classes > 0) {  // (ClassyVision's init: N(0, 0.01) weights, zero biases)
    auto fc = std::make_shared<Linear>(ctx, in, o.num_classes, true, o.dtype);
    normal_(ctx, fc->weight.data(), 0.0, 0.01);
    fill(ctx, fc->bias.data(), 0.0);
    net->add("fc", fc);
  }
  net->feature_dim = in;
  return net;
}

// The RegNet of `p` (regnet_stages) with `o`.
inline std::shared_ptr<RegNet> regnet(Context& ctx, const RegNetParams& p,
                                      const RegNetOptions& o = {}) {
  return anynet(ctx, regnet_stages(p), o);
}

}  // namespace shardkit::nn
