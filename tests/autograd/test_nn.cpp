// Modules: state-dict names, parameter counts against torchvision, initialisation, forward and
// backward shapes, hooks, module paths in errors.
#include <doctest/doctest.h>
#include <algorithm>

#include <cmath>
#include <string>

#include "shardkit/nn/nn.hpp"
#include "trunk_shapes.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;
using ag::Variable;

namespace {

Variable random_input(sk::Context& ctx, sk::Shape shape) {
  sk::Tensor t = sk::empty(ctx, std::move(shape), sk::DType::f32, sk::MemoryCategory::activations);
  sk::normal_(ctx, t, 0.0, 1.0);
  return Variable(t);
}

bool has_name(const std::vector<std::pair<std::string, sk::Tensor>>& entries,
              const std::string& name) {
  for (auto& [n, t] : entries)
    if (n == name) return true;
  return false;
}

}  // namespace

TEST_CASE("ResNet parameter counts and state-dict layout match torchvision") {
  sk::Context ctx({.seed = 31});
  auto r18 = nn::resnet18(ctx);
  CHECK(r18->parameter_count() == 11'689'512);
  CHECK(r18->named_parameters().size() == 62);
  const auto sd18 = r18->state_dict();
  CHECK(sd18.size() == 122);
  CHECK(sd18.front().first == "conv1.weight");
  CHECK(sd18[1].first == "bn1.weight");
  CHECK(sd18[3].first == "bn1.running_mean");
  CHECK(sd18[5].first == "bn1.num_batches_tracked");
  CHECK(sd18[6].first == "layer1.0.conv1.weight");
  CHECK(has_name(sd18, "layer2.0.downsample.0.weight"));
  CHECK(has_name(sd18, "layer2.0.downsample.1.running_var"));
  CHECK(!has_name(sd18, "layer1.0.downsample.0.weight"));
  CHECK(sd18.back().first == "fc.bias");
  CHECK(sd18.back().second.shape() == sk::Shape{1000});

  auto r50 = nn::resnet50(ctx);
  CHECK(r50->parameter_count() == 25'557'032);
  CHECK(r50->named_parameters().size() == 161);
  CHECK(r50->state_dict().size() == 320);
  CHECK(has_name(r50->state_dict(), "layer4.2.conv3.weight"));
  // The deeper ResNets, and ResNeXt (grouped 3 x 3 convolutions in wider bottlenecks):
  // torchvision's resnet101, resnet152, resnext50_32x4d and resnext101_32x8d (their parameters
  // deferred: shapes without memory).
  const sk::DeferredParameters shapes_only(ctx);
  CHECK(nn::resnet101(ctx)->parameter_count() == 44'549'160);
  CHECK(nn::resnet152(ctx)->parameter_count() == 60'192'808);
  nn::ResNetOptions resnext;
  resnext.groups = 32;
  resnext.width_per_group = 4;
  auto x50 = nn::resnet50(ctx, resnext);
  CHECK(x50->parameter_count() == 25'028'904);
  CHECK(x50->named_parameters().size() == 161);
  const auto grouped = x50->state_dict();
  const auto conv2 = std::find_if(grouped.begin(), grouped.end(),
                                  [](const auto& e) { return e.first == "layer1.0.conv2.weight"; });
  REQUIRE(conv2 != grouped.end());
  CHECK(conv2->second.shape() == sk::Shape{128, 4, 3, 3});  // 32 groups of 4 channels
  resnext.width_per_group = 8;
  CHECK(nn::resnet101(ctx, resnext)->parameter_count() == 88'791'336);
  // By torchvision's names (the planner's --model), and by depth.
  CHECK(nn::resnet_named(ctx, "resnext50_32x4d")->parameter_count() == 25'028'904);
  CHECK(nn::resnet_named(ctx, "resnet34")->parameter_count() ==
        nn::resnet(ctx, 34)->parameter_count());
  CHECK(nn::resnet_named(ctx, "resnext50") == nullptr);
  CHECK(nn::resnet_named(ctx, "model.safetensors") == nullptr);
  // Only the names torchvision uses: no space, sign, leading zero or separator in the numbers.
  for (const char* other : {"resnet 50", "resnet+50", "resnet050", "resnet-18", "resnet50 ",
                            "resnext50_+32x4d", "resnext50_32x04d", "resnet99999"})
    CHECK_MESSAGE(nn::resnet_named(ctx, other) == nullptr, other);
  nn::ResNetOptions no_groups;
  for (const std::int64_t groups : {0, -32}) {
    no_groups.groups = groups;
    const std::string message =
        "groups " + std::to_string(groups) + " is no number of groups for the bottleneck's";
    CHECK_THROWS_WITH(nn::resnet50(ctx, no_groups), doctest::Contains(message.c_str()));
  }
  CHECK_THROWS_WITH(nn::resnet(ctx, 200), doctest::Contains("use 18, 34, 50, 101 or 152"));
  nn::ResNetOptions basic_grouped;
  basic_grouped.groups = 32;
  CHECK_THROWS_WITH(nn::resnet18(ctx, basic_grouped),
                    doctest::Contains("which only bottleneck networks have"));

  nn::ResNetOptions small;
  small.num_classes = 10;
  small.small_image_stem = true;
  auto cifar = nn::resnet18(ctx, small);
  // 3x3 stem (1728 instead of 9408 weights) and a 10-class fc.
  CHECK(cifar->parameter_count() == 11'689'512 - 9408 + 1728 - 513 * 1000 + 513 * 10);
  CHECK(!has_name(cifar->state_dict(), "maxpool"));
}

TEST_CASE("default initialisation follows PyTorch and is reproducible by seed") {
  sk::Context a({.seed = 7}), b({.seed = 7});
  nn::Conv2d conv(a, 16, 32, 3, 1, 1, true);
  nn::Conv2d again(b, 16, 32, 3, 1, 1, true);
  const auto w = sk::to_vector<float>(a, conv.weight.data());
  const double bound = 1.0 / std::sqrt(16.0 * 9.0);
  double max_abs = 0;
  for (float v : w) max_abs = std::max(max_abs, std::abs(double(v)));
  CHECK(max_abs <= bound);
  CHECK(max_abs > 0.9 * bound);  // 4608 draws come close to the bound
  CHECK(w == sk::to_vector<float>(b, again.weight.data()));
  nn::BatchNorm bn(a, 8);
  CHECK(sk::to_vector<float>(a, bn.weight.data()) == std::vector<float>(8, 1.0f));
  CHECK(sk::to_vector<float>(a, bn.bias.data()) == std::vector<float>(8, 0.0f));
  CHECK(sk::to_vector<float>(a, bn.running_var) == std::vector<float>(8, 1.0f));
}

TEST_CASE("ResNet forward and backward shapes (small images)") {
  sk::Context ctx({.seed = 32});
  SUBCASE("resnet18, small-image stem") {
    nn::ResNetOptions o;
    o.num_classes = 10;
    o.small_image_stem = true;
    auto net = nn::resnet18(ctx, o);
    auto x = random_input(ctx, {2, 3, 16, 16});
    x.set_requires_grad(true);
    auto logits = (*net)(ctx, x);
    CHECK(logits.shape() == sk::Shape{2, 10});
    auto loss = ag::cross_entropy(ctx, logits, sk::from_vector<std::int64_t>(ctx, {3, 9}, {2}));
    ag::backward(ctx, loss);
    CHECK(x.grad().shape() == x.shape());
    for (auto& [name, p] : net->named_parameters()) {
      CAPTURE(name);
      REQUIRE(p.grad().defined());
      CHECK(p.grad().shape() == p.shape());
    }
    auto bn = std::dynamic_pointer_cast<nn::BatchNorm>(net->children()[1].second);
    REQUIRE(bn);
    CHECK(sk::to_vector<std::int64_t>(ctx, bn->num_batches_tracked)[0] == 1);
  }
  SUBCASE("resnet50, ImageNet stem, 1000 classes") {
    auto net = nn::resnet50(ctx);
    auto x = random_input(ctx, {2, 3, 32, 32});
    auto logits = (*net)(ctx, x);
    CHECK(logits.shape() == sk::Shape{2, 1000});
    ag::backward(ctx,
                 ag::cross_entropy(ctx, logits, sk::from_vector<std::int64_t>(ctx, {3, 999}, {2})));
    for (auto& [name, p] : net->named_parameters()) {
      CAPTURE(name);
      REQUIRE(p.grad().defined());
    }
  }
  SUBCASE("eval mode uses and keeps the running statistics") {
    nn::ResNetOptions o;
    o.num_classes = 4;
    o.small_image_stem = true;
    auto net = nn::resnet18(ctx, o);
    net->eval();
    auto x = random_input(ctx, {1, 3, 8, 8});  // batch 1 is fine in eval mode
    auto before = sk::to_vector<float>(ctx, net->state_dict()[3].second);
    auto y1 = (*net)(ctx, x);
    auto y2 = (*net)(ctx, x);
    CHECK(sk::to_vector<float>(ctx, y1.data()) == sk::to_vector<float>(ctx, y2.data()));
    CHECK(sk::to_vector<float>(ctx, net->state_dict()[3].second) == before);
  }
}

TEST_CASE("ResNet::child_output_shape: each child's [C, H, W] as a forward gives it") {
  // Both stems, basic and bottleneck blocks, unfused ReLUs (a `relu` child), and sides that
  // each halving rounds (odd, even, 1).
  sk::Context ctx({.seed = 34});
  struct Case {
    const char* name;
    int depth;
    bool small_stem, fuse;
    std::int64_t h, w;
  };
  for (const Case& k : {Case{"resnet18 small stem", 18, true, true, 28, 28},
                        Case{"resnet18 ImageNet stem, unfused", 18, false, false, 33, 47},
                        Case{"resnet50 ImageNet stem", 50, false, true, 64, 17},
                        Case{"resnet50 small stem, 1 x 5", 50, true, true, 1, 5}}) {
    CAPTURE(k.name);
    nn::ResNetOptions o;
    o.num_classes = 3;
    o.base_channels = 4;
    o.small_image_stem = k.small_stem;
    o.fuse_bn_relu = k.fuse;
    auto net = nn::resnet(ctx, k.depth, o);
    net->eval();  // (a batch of one)
    const int compared = sk::testing::check_child_output_shapes(
        ctx, *net, random_input(ctx, {1, 3, k.h, k.w}), {"flatten", "fc"});
    CHECK(compared == (k.small_stem ? 7 : 8) + (k.fuse ? 0 : 1));  // (conv1 ... avgpool)
  }
  auto net = nn::resnet18(ctx);
  CHECK_THROWS_WITH(net->child_output_shape("layer5", 32, 32),
                    doctest::Contains("the children that have one: conv1, bn1, maxpool, layer1"));
  CHECK_THROWS_WITH(net->child_output_shape("layer1", 0, 32),
                    doctest::Contains("images of 0 x 32 pixels"));
}

TEST_CASE(
    "ResNet blocks with batch-norm + ReLU fused or not: the same bits; unfused, torchvision's "
    "module calls") {
  struct Run {
    std::vector<float> logits;
    std::vector<std::vector<float>> grads;
    int relu_calls = 0;      // forward hook on layer1.0.relu
    float bn1_min = 0;       // smallest value a forward hook on layer1.0.bn1 sees
    float stem_bn1_min = 0;  // ... on the stem's bn1
    bool stem_relu = false;  // the network has a relu child after its bn1
  };
  for (const bool bottleneck : {false, true}) {
    CAPTURE(bottleneck);
    auto run = [&](bool fuse) {
      sk::Context ctx({.seed = 33});
      nn::ResNetOptions o;
      o.num_classes = 10;
      o.small_image_stem = true;
      o.base_channels = 8;
      o.fuse_bn_relu = fuse;
      auto net = bottleneck ? nn::resnet50(ctx, o) : nn::resnet18(ctx, o);
      Run r;
      for (auto& [name, m] : net->named_modules()) {
        if (name == "layer1.0.relu")
          m->register_forward_hook(
              [&](nn::Module&, const Variable&, const Variable&) { ++r.relu_calls; });
        if (name == "layer1.0.bn1" || name == "bn1")
          m->register_forward_hook(
              [&, stem = name == "bn1"](nn::Module&, const Variable&, const Variable& y) {
                const auto v = sk::to_vector<float>(ctx, y.data());
                (stem ? r.stem_bn1_min : r.bn1_min) = *std::min_element(v.begin(), v.end());
              });
        if (name == "relu") r.stem_relu = true;
      }
      auto logits = (*net)(ctx, random_input(ctx, {4, 3, 12, 12}));
      ag::backward(ctx, ag::cross_entropy(ctx, logits,
                                          sk::from_vector<std::int64_t>(ctx, {1, 4, 7, 9}, {4})));
      r.logits = sk::to_vector<float>(ctx, logits.data());
      for (auto& [name, p] : net->named_parameters())
        r.grads.push_back(sk::to_vector<float>(ctx, p.grad()));
      return r;
    };
    const Run fused = run(true), plain = run(false);
    CHECK(fused.logits == plain.logits);
    CHECK(fused.grads == plain.grads);
    CHECK(plain.relu_calls == (bottleneck ? 3 : 2));  // after bn1 (bn2) and after the add
    CHECK(fused.relu_calls == 0);                     // all inside bn1 (bn2) and the add
    CHECK(plain.bn1_min < 0);                         // batch-norm's own output
    CHECK(fused.bn1_min == 0);                        // after the ReLU inside it
    CHECK(plain.stem_relu);                           // the stem: torchvision's modules
    CHECK(!fused.stem_relu);                          // its ReLU inside its bn1
    CHECK(plain.stem_bn1_min < 0);
    CHECK(fused.stem_bn1_min == 0);
  }
}

TEST_CASE("module hooks: forward pre/post, backward pre/post") {
  sk::Context ctx({.seed = 33});
  auto head = nn::mlp_head(ctx, 6, 8, 3);
  std::vector<std::string> events;
  auto& linear = head->at(0);
  linear.register_forward_pre_hook([&](nn::Module& m, const Variable& in) {
    events.push_back("pre:" + m.path() + sk::shape_str(in.shape()));
  });
  linear.register_forward_hook([&](nn::Module&, const Variable&, const Variable& out) {
    events.push_back("post" + sk::shape_str(out.shape()));
  });
  linear.register_backward_pre_hook([&](nn::Module&, const sk::Tensor& g) {
    events.push_back("bwd-pre" + sk::shape_str(g.shape()));
  });
  linear.register_backward_hook([&](nn::Module&, const sk::Tensor& g) {
    events.push_back("bwd-post" + (g.defined() ? sk::shape_str(g.shape()) : " (none)"));
  });
  dynamic_cast<nn::Linear&>(head->at(3)).weight.register_grad_ready_hook([&](Variable&) {
    events.push_back("ready:3.weight");
  });
  auto y = (*head)(ctx, random_input(ctx, {4, 6}));
  ag::backward(ctx,
               ag::cross_entropy(ctx, y, sk::from_vector<std::int64_t>(ctx, {0, 1, 2, 0}, {4})));
  // The input needs no gradient, so none is made for it: the backward hook runs where the
  // output's gradient arrives, without one (PyTorch's full backward hook: grad_input None).
  const std::vector<std::string> expected{"pre:0[4, 6]", "post[4, 8]", "ready:3.weight",
                                          "bwd-pre[4, 8]", "bwd-post (none)"};
  CHECK(events == expected);

  // An input that needs a gradient: the hook sees it leave, once the module's backward is done.
  events.clear();
  Variable x(random_input(ctx, {4, 6}).data(), true);
  y = (*head)(ctx, x);
  ag::backward(ctx,
               ag::cross_entropy(ctx, y, sk::from_vector<std::int64_t>(ctx, {0, 1, 2, 0}, {4})));
  const std::vector<std::string> with_input_grad{"pre:0[4, 6]", "post[4, 8]", "ready:3.weight",
                                                 "bwd-pre[4, 8]", "bwd-post[4, 6]"};
  CHECK(events == with_input_grad);
  CHECK(x.grad().defined());

  // The hooks do not make a gradient where none was needed: a frozen module fed plain data
  // (its hooks' pass-through once made the output need one, and the first layer compute a
  // gradient for its input).
  for (auto& p : head->parameters()) p.set_requires_grad(false);
  CHECK_FALSE((*head)(ctx, random_input(ctx, {4, 6})).requires_grad());
  for (auto& p : head->parameters()) p.set_requires_grad(true);

  // Removing hooks by id: only the named one goes.
  events.clear();
  const auto id = linear.register_forward_pre_hook(
      [&](nn::Module&, const Variable&) { events.push_back("second pre"); });
  CHECK(linear.remove_hook(id));
  CHECK_FALSE(linear.remove_hook(id));
  (void)(*head)(ctx, random_input(ctx, {4, 6}));
  CHECK(events.front() == "pre:0[4, 6]");
  CHECK(std::find(events.begin(), events.end(), "second pre") == events.end());
}

TEST_CASE("errors name the op, both shapes and the module path") {
  sk::Context ctx({.seed = 34});
  nn::ResNetOptions o;
  o.num_classes = 10;
  o.small_image_stem = true;
  auto net = nn::resnet18(ctx, o);
  try {
    (void)(*net)(ctx, random_input(ctx, {2, 1, 8, 8}));
    FAIL("a 1-channel image went into a 3-channel stem");
  } catch (const sk::InvalidArgument& e) {
    const std::string what = e.what();
    CHECK(what.find("conv2d") != std::string::npos);
    CHECK(what.find("[2, 1, 8, 8]") != std::string::npos);
    CHECK(what.find("[64, 3, 3, 3]") != std::string::npos);
    CHECK(what.find("module 'conv1'") != std::string::npos);
  }
  auto outer = std::make_shared<nn::Sequential>();
  outer->add("trunk", std::make_shared<nn::Linear>(ctx, 5, 7));
  outer->add("head", nn::mlp_head(ctx, 6, 8, 3));
  try {
    (void)(*outer)(ctx, random_input(ctx, {4, 5}));
    FAIL("7 features went into a 6-feature head");
  } catch (const sk::InvalidArgument& e) {
    const std::string what = e.what();
    CHECK(what.find("linear: input [4, 7] does not match weight [8, 6]") != std::string::npos);
    CHECK(what.find("module 'head.0'") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS((*nn::mlp_head(ctx, 6, 8, 3))(ctx, random_input(ctx, {1, 6})),
                       doctest::Contains("more than one value per channel"), sk::InvalidArgument);
}

namespace {

std::vector<std::int64_t> stage_widths(const std::vector<nn::RegNetStage>& stages) {
  std::vector<std::int64_t> w;
  for (const auto& s : stages) w.push_back(s.width);
  return w;
}

}  // namespace

TEST_CASE("RegNet stages: ClassyVision's widths from depth, w_0, w_a, w_m and group_width") {
  // The output widths ClassyVision's regnet.py gives each registered model, and those of the
  // head dims in VISSL's SwAV RegNet configs (regnet128Gf: 7392, regnet256Gf_1: 10444).
  struct Case {
    const char* name;
    std::int64_t out;
  };
  for (const Case& k :
       {Case{"regnet_y_400mf", 440}, Case{"regnet_y_800mf", 768}, Case{"regnet_y_1.6gf", 888},
        Case{"regnet_y_3.2gf", 1512}, Case{"regnet_y_8gf", 2016}, Case{"regnet_y_16gf", 3024},
        Case{"regnet_y_32gf", 3712}, Case{"regnet_y_128gf", 7392}}) {
    CAPTURE(k.name);
    nn::RegNetParams p;
    bool se = false;
    REQUIRE(nn::regnet_named_params(k.name, p, se));
    CHECK(se);
    CHECK(nn::regnet_stages(p).back().width == k.out);
  }
  // regnet_y_16gf is the AnyNet of VISSL's swav_regnet_fsdp test config.
  nn::RegNetParams p;
  bool se = false;
  REQUIRE(nn::regnet_named_params("regnet_y_16gf", p, se));
  const auto stages = nn::regnet_stages(p);
  CHECK(stage_widths(stages) == std::vector<std::int64_t>{224, 448, 1232, 3024});
  std::vector<std::int64_t> depths;
  for (const auto& s : stages) {
    depths.push_back(s.depth);
    CHECK(s.group_width == 112);
    CHECK(s.stride == 2);
  }
  CHECK(depths == std::vector<std::int64_t>{2, 4, 11, 1});
  CHECK(nn::regnet_stages({27, 640, 230.83, 2.53, 373, 1.0}).back().width == 10444);
  // regnet_y_400mf's first stage: 48 channels in groups of 8; the group width never exceeds
  // the bottleneck (ClassyVision's compatibility step): a stage of 8 channels, groups of 8.
  CHECK(stage_widths(nn::regnet_stages({16, 48, 27.89, 2.09, 8, 1.0})) ==
        std::vector<std::int64_t>{48, 104, 208, 440});
  CHECK(nn::regnet_stages({2, 8, 0, 2, 16, 1.0}).front().group_width == 8);
  CHECK_FALSE(nn::regnet_named_params("regnet_z_500mf", p, se));
  CHECK_THROWS_WITH(nn::regnet_stages({16, 48, 27.89, 2.09, 8, 0.01}),
                    doctest::Contains("has no bottleneck channel"));
  CHECK_THROWS_WITH(nn::regnet_stages({16, 44, 27.89, 2.09, 8, 1.0}),
                    doctest::Contains("w_0 > 0 and a multiple of 8"));
  // The rule a bad multiplier breaks is named, with its value.
  CHECK_THROWS_WITH(nn::regnet_stages({16, 48, 27.89, 2.09, 8, 0.0}),
                    doctest::Contains("bottleneck_multiplier 0 are not a RegNet's"));
  CHECK_THROWS_WITH(nn::regnet_stages({16, 48, 27.89, 2.09, 8, 0.0}),
                    doctest::Contains("bottleneck_multiplier > 0"));
}

TEST_CASE("RegNet: ClassyVision's module names and parameter count; each child's [C, H, W]") {
  sk::Context ctx({.seed = 35});
  {
    // regnet_y_400mf without a classifier: torchvision's regnet_y_400mf (the same network)
    // has 4,344,144 parameters with its 1000-class fc (440 x 1000 + 1000).
    nn::RegNetParams p;
    bool se = false;
    REQUIRE(nn::regnet_named_params("regnet_y_400mf", p, se));
    nn::RegNetOptions o;
    o.use_se = se;
    auto net = nn::regnet(ctx, p, o);
    std::int64_t count = 0;
    for (const auto& [name, t] : net->named_parameters()) count += t.numel();
    CHECK(count == 4344144 - 441000);
    CHECK(net->feature_dim == 440);
    const auto names = [&] {
      std::vector<std::string> n;
      for (const auto& [name, t] : net->state_dict()) n.push_back(name);
      return n;
    }();
    for (const char* expected :
         {"conv1.stem.0.weight", "conv1.stem.1.running_var", "res2.block1-0.proj.weight",
          "res2.block1-0.bn.bias", "res2.block1-0.f.a.0.weight", "res2.block1-0.f.b.1.weight",
          "res2.block1-0.f.se.excitation.0.bias", "res2.block1-0.f.se.excitation.2.weight",
          "res2.block1-0.f.c.weight", "res2.block1-0.f.final_bn.weight",
          "res5.block4-5.f.final_bn.num_batches_tracked"}) {
      CAPTURE(expected);
      CHECK(std::find(names.begin(), names.end(), expected) != names.end());
    }
    CHECK(net->block_paths().size() == 1 + 3 + 6 + 6);  // (depths 1, 3, 6, 6)
    CHECK(net->block_paths()[1] == "res3.block2-0");
  }
  // A narrow AnyNet through every stem, strides 2 and 1, with and without SE: the shapes a
  // forward gives against child_output_shape.
  for (const nn::RegNetStem stem : {nn::RegNetStem::simple_stem_in, nn::RegNetStem::res_stem_in,
                                    nn::RegNetStem::res_stem_cifar}) {
    for (const bool se : {true, false}) {
      CAPTURE(static_cast<int>(stem));
      CAPTURE(se);
      nn::RegNetOptions o;
      o.stem = stem;
      o.stem_width = 8;
      o.use_se = se;
      o.in_channels = 1;
      auto net = nn::anynet(ctx, {{8, 2, 1, 4, 1.0}, {16, 1, 2, 8, 1.0}, {24, 2, 1, 8, 1.0}}, o);
      net->eval();
      const int compared = sk::testing::check_child_output_shapes(
          ctx, *net, random_input(ctx, {1, 1, 33, 20}), {"flatten"});
      CHECK(compared == 5);  // conv1, res2, res3, res4, avgpool
      CHECK(net->stage_names() == std::vector<std::string>{"res2", "res3", "res4"});
    }
  }
  // The classifier's init is ClassyVision's: N(0, 0.01) weights, zero biases.
  {
    nn::RegNetOptions o;
    o.num_classes = 1000;
    auto classifier = nn::anynet(ctx, {{64, 2, 1, 8, 1.0}}, o);
    for (const auto& [name, p] : classifier->named_parameters()) {
      if (name.rfind("fc.", 0) != 0) continue;
      const auto v = sk::to_vector<float>(ctx, p.data());
      double sum = 0, squares = 0;
      for (const float x : v) sum += x, squares += double(x) * x;
      const double mean = sum / double(v.size());
      if (name == "fc.bias") CHECK(squares == 0);
      if (name == "fc.weight") {  // (64 000 draws: the standard deviation within 2%)
        CHECK(std::abs(mean) < 3e-4);
        CHECK(std::sqrt(squares / double(v.size()) - mean * mean) ==
              doctest::Approx(0.01).epsilon(0.02));
      }
    }
  }
  auto net = nn::anynet(ctx, {{8, 2, 1, 8, 1.0}});
  CHECK_THROWS_WITH(net->child_output_shape("res3", 32, 32),
                    doctest::Contains("the children that have one: conv1, res2, avgpool"));
  // ClassyVision's groups, bottleneck // group_width: 12 // 8 is one group; 28 // 8 = 3 groups
  // do not split 28 channels, nor does a group width above the bottleneck (0 groups).
  CHECK(nn::anynet(ctx, {{12, 2, 1, 8, 1.0}})->block_paths().size() == 1);
  for (const std::int64_t group_width : {8, 16})
    CHECK_THROWS_WITH(nn::anynet(ctx, {{group_width == 8 ? 28 : 12, 2, 1, group_width, 1.0}}),
                      doctest::Contains("which do not split it evenly"));
  // A stage's own group width or multiplier is checked where the stage is read, not blamed on
  // the group width inside a block.
  for (const double multiplier : {0.0, -1.0}) {
    const std::string message = "bottleneck_multiplier " + std::to_string(int(multiplier)) +
                                "; the first four must be >= 1, the multiplier > 0";
    CHECK_THROWS_WITH(nn::anynet(ctx, {{64, 2, 1, 8, multiplier}}),
                      doctest::Contains(message.c_str()));
  }
  CHECK_THROWS_WITH(nn::anynet(ctx, {{8, 2, 1, 8, 1.0}, {64, 2, 1, 0, 1.0}}),
                    doctest::Contains("stage 2 has width 64, depth 1, stride 2, group_width 0"));
  // se_ratio 0 is "no squeeze-and-excitation", as ClassyVision's `if se_ratio:`.
  nn::RegNetOptions no_ratio, no_se;
  no_ratio.se_ratio = 0;
  no_se.use_se = false;
  const auto without_ratio = nn::anynet(ctx, {{8, 2, 1, 8, 1.0}}, no_ratio)->state_dict();
  const auto without_se = nn::anynet(ctx, {{8, 2, 1, 8, 1.0}}, no_se)->state_dict();
  REQUIRE(without_ratio.size() == without_se.size());
  for (std::size_t i = 0; i < without_se.size(); ++i)
    CHECK(without_ratio[i].first == without_se[i].first);
  nn::RegNetOptions tiny_ratio;
  tiny_ratio.se_ratio = 0.01;  // 0.01 x 32 rounds to 0 channels
  CHECK_THROWS_WITH(nn::anynet(ctx, {{8, 2, 1, 8, 1.0}}, tiny_ratio),
                    doctest::Contains("or se_ratio 0, for no squeeze-and-excitation"));
}
