// SwAV's network (docs/swav.md, "Scores"): a ResNet, RegNet or EfficientNet trunk without its
// classifier, VISSL's swav_head -- a projection head of Linear -> BatchNorm1d -> ReLU per hidden
// width, then a Linear, whose output is L2-normalised -- and the prototypes, a bias-free Linear.
// State-dict names follow VISSL's (trunk.*, heads.0.projection_head.*,
// heads.0.prototypes0.weight) with torchvision's or ClassyVision's inside the trunk.
#pragma once

#include <memory>

#include "shardkit/nn/nn.hpp"
#include "swav_config.hpp"

namespace swav {

namespace nn = shardkit::nn;
namespace ag = shardkit::autograd;

class SwavHead : public nn::Module {
 public:
  SwavHead(sk::Context& ctx, const SwavConfig& c) {
    projection_head = register_module("projection_head", std::make_shared<nn::Sequential>());
    std::vector<std::int64_t> widths = c.head_hidden;
    widths.push_back(c.embedding_dim);
    std::int64_t in = c.head_in;
    for (std::size_t i = 0; i < widths.size(); ++i) {
      projection_head->push_back(std::make_shared<nn::Linear>(ctx, in, widths[i], c.head_bias));
      if (i + 1 == widths.size() && c.head_skip_last_bn) break;
      if (c.head_bn)
        projection_head->push_back(std::make_shared<nn::BatchNorm>(
            ctx, widths[i], 1, sk::DType::f32, c.bn_eps, c.bn_momentum));
      projection_head->push_back(std::make_shared<nn::ReLU>());
      in = widths[i];
    }
    prototypes0 = register_module(
        "prototypes0", std::make_shared<nn::Linear>(ctx, c.embedding_dim, c.prototypes, false));
  }
  const char* type_name() const override { return "SwavHead"; }
  // The normalised embedding of trunk features.
  ag::Variable forward(sk::Context& ctx, const ag::Variable& features) override {
    return ag::l2_normalize(ctx, (*projection_head)(ctx, features));
  }

  std::shared_ptr<nn::Sequential> projection_head;
  std::shared_ptr<nn::Linear> prototypes0;
};

// A container named "heads" holding head "0", as VISSL's model.heads list.
class SwavHeads : public nn::Module {
 public:
  SwavHeads(sk::Context& ctx, const SwavConfig& c) {
    head = register_module("0", std::make_shared<SwavHead>(ctx, c));
  }
  const char* type_name() const override { return "SwavHeads"; }
  ag::Variable forward(sk::Context& ctx, const ag::Variable& x) override { return (*head)(ctx, x); }
  std::shared_ptr<SwavHead> head;
};

class SwavModel : public nn::Module {
 public:
  static constexpr const char* kPrototypes = "heads.0.prototypes0.weight";

  SwavModel(sk::Context& ctx, const SwavConfig& c) {
    nn::ResNetOptions o;
    o.num_classes = 0;
    o.small_image_stem = c.small_image_stem;
    o.base_channels = c.base_channels;
    o.in_channels = c.in_channels;
    o.zero_init_residual = c.zero_init_residual;
    o.channels_last = c.channels_last;
    o.channel_blocks = c.channel_blocks && !c.channels_last;
    o.init = nn::ResNetInit::torchvision;  // kaiming_normal fan_out, as SwAV's resnet50.py
    o.groups = c.groups;
    o.width_per_group = c.width_per_group;
    if (c.trunk == "efficientnet") {
      nn::EfficientNetOptions e = c.efficientnet;
      e.in_channels = c.in_channels;
      trunk = register_module("trunk", nn::efficientnet(ctx, e));
    } else if (c.trunk == "regnet") {
      nn::RegNetOptions r = c.regnet;
      r.in_channels = c.in_channels;
      trunk = register_module("trunk", nn::anynet(ctx, c.regnet_stages, r));
    } else {
      trunk = register_module("trunk", nn::resnet(ctx, c.depth, o));
    }
    heads = register_module("heads", std::make_shared<SwavHeads>(ctx, c));
    if (c.checkpoint_splits > 0) trunk->set_checkpoint_segments(c.checkpoint_splits);
  }
  const char* type_name() const override { return "SwavModel"; }
  // The trunk's features of one batch of equally sized crops (the sharded module's forward).
  ag::Variable forward(sk::Context& ctx, const ag::Variable& crops) override {
    return (*trunk)(ctx, crops);
  }
  SwavHead& head() { return *heads->head; }

  std::shared_ptr<nn::Trunk> trunk;
  std::shared_ptr<SwavHeads> heads;
};

}  // namespace swav
