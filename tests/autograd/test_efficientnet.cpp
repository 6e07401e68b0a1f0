// EfficientNet (nn/efficientnet.hpp) as ClassyVision builds it: parameter counts against
// torchvision's same networks, VISSL's and ClassyVision's module names, each child's [C, H, W]
// against a forward, drop connect only while training and only on blocks with a skip, and a
// checkpointed training forward and backward equal to the plain one bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "shardkit/nn/nn.hpp"
#include "trunk_shapes.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;
using ag::Variable;

namespace {

nn::EfficientNetOptions options_of(const char* version) {
  nn::EfficientNetOptions o;
  REQUIRE(nn::efficientnet_named_params(version, o.params));
  return o;
}

Variable random_images(sk::Context& ctx, sk::Shape shape) {
  sk::Tensor t = sk::empty(ctx, std::move(shape), sk::DType::f32, sk::MemoryCategory::activations);
  sk::normal_(ctx, t, 0.0, 1.0);
  return Variable(t);
}

}  // namespace

TEST_CASE("EfficientNet B0-B2: torchvision's parameter counts without the classifier") {
  sk::Context ctx({.seed = 1});
  // torchvision's efficientnet_b0/b1/b2 (the same blocks, widths and depths) have 5,288,548,
  // 7,794,184 and 9,109,994 parameters with their 1000-class classifier (features x 1000 + 1000).
  struct Expected {
    const char* version;
    std::int64_t with_classifier, features, blocks;
  };
  for (const Expected& e : {Expected{"B0", 5288548, 1280, 16}, Expected{"B1", 7794184, 1280, 23},
                            Expected{"B2", 9109994, 1408, 23}}) {
    CAPTURE(e.version);
    auto net = nn::efficientnet(ctx, options_of(e.version));
    CHECK(net->parameter_count() == e.with_classifier - (e.features * 1000 + 1000));
    CHECK(net->feature_dim == e.features);
    CHECK(static_cast<std::int64_t>(net->block_paths().size()) == e.blocks);
  }
  auto b0 = nn::efficientnet(ctx, options_of("B0"));
  std::vector<std::string> names;
  for (const auto& [name, t] : b0->state_dict()) names.push_back(name);
  for (const char* expected :
       {"conv1.0.weight", "conv1.1.running_mean", "block0.depthwise_conv.weight",
        "block0.bn1.weight", "block0.se_reduce.bias", "block0.se_expand.weight",
        "block0.project_conv.weight", "block0.bn2.num_batches_tracked", "block1.expand_conv.weight",
        "block1.bn0.bias", "block15.project_conv.weight", "conv_final.0.weight",
        "conv_final.1.running_var"}) {
    CAPTURE(expected);
    CHECK(std::find(names.begin(), names.end(), expected) != names.end());
  }
  CHECK(std::find(names.begin(), names.end(), "block0.expand_conv.weight") == names.end());
  // Block 1's squeeze is a quarter of its 16 input channels, from 96 expanded ones.
  CHECK(b0->blocks[1].in == 16);
  for (const auto& [name, t] : b0->named_parameters())
    if (name == "block1.se_reduce.weight") CHECK(t.shape() == sk::Shape{4, 96, 1, 1});
  // ClassyVision's init: convolution biases 0, batch-norms 1 and 0.
  for (const auto& [name, t] : b0->named_parameters())
    if (name.find("se_reduce.bias") != std::string::npos) {
      const auto v = sk::to_vector<float>(ctx, t.data());
      CHECK(std::all_of(v.begin(), v.end(), [](float b) { return b == 0; }));
    }
  // Convolutions N(0, sqrt(2 / fan_out)), fan_out = k x k x out (a depthwise one's too): the
  // head's 409 600 draws and the last stage's 5 x 5 depthwise weights (1 152 x 25).
  for (const auto& [name, t] : b0->named_parameters()) {
    if (name != "conv_final.0.weight" && name != "block15.depthwise_conv.weight") continue;
    CAPTURE(name);
    const auto v = sk::to_vector<float>(ctx, t.data());
    double sum = 0, squares = 0;
    for (const float w : v) sum += w, squares += double(w) * w;
    const double n = double(v.size()), mean = sum / n;
    const double fan_out = double(t.size(0) * t.size(2) * t.size(3));
    CHECK(std::abs(mean) < 4 * std::sqrt(2 / fan_out / n));
    CHECK(std::sqrt(squares / n - mean * mean) ==
          doctest::Approx(std::sqrt(2 / fan_out)).epsilon(0.02));
  }
  CHECK(b0->children().back().first == "dropout");
  nn::EfficientNetOptions bad = options_of("B0");
  bad.drop_connect_rate = 1.0;
  CHECK_THROWS_WITH_AS(nn::efficientnet(ctx, bad), doctest::Contains("the rates in [0, 1)"),
                       sk::InvalidArgument);
  CHECK_FALSE(nn::efficientnet_named_params("B8", bad.params));
  // A block's squeeze-and-excitation ratio in (0, 1], as ClassyVision asserts (it built a
  // one-channel squeeze before), and its drop-connect rate when it is built, not at forward.
  const nn::EfficientNetOptions o = options_of("B0");
  for (const double ratio : {0.0, -0.25, 1.5})
    CHECK_THROWS_WITH_AS(nn::MBConvBlock(ctx, {16, 16, 1, 3, 1, ratio}, o),
                         doctest::Contains("se_ratio in (0, 1]"), sk::InvalidArgument);
  nn::EfficientNetOptions no_se = o;
  no_se.use_se = false;
  CHECK(nn::MBConvBlock(ctx, {16, 16, 1, 3, 1, 0.0}, no_se).se_reduce == nullptr);
  CHECK_THROWS_WITH_AS(nn::MBConvBlock(ctx, {16, 16, 1, 3, 1, 0.25, true, 1.0}, o),
                       doctest::Contains("drop_connect_rate 1;"), sk::InvalidArgument);
}

TEST_CASE("EfficientNet: each child's [C, H, W] as a forward gives it; drop connect's rates") {
  sk::Context ctx({.seed = 2});
  nn::EfficientNetOptions o = options_of("B0");
  o.in_channels = 1;
  auto net = nn::efficientnet(ctx, o);
  net->eval();
  const int compared = sk::testing::check_child_output_shapes(
      ctx, *net, random_images(ctx, {1, 1, 37, 20}), {"flatten", "dropout"});
  CHECK(compared == 1 + 16 + 2);  // conv1, block0 ... block15, conv_final, avgpool
  CHECK(net->child_output_shape("conv_final", 224, 224) == std::array<std::int64_t, 3>{1280, 7, 7});
  CHECK(net->stage_names().empty());
  CHECK_THROWS_WITH(net->child_output_shape("block16", 32, 32),
                    doctest::Contains("conv1, block0 ... block15, conv_final, avgpool"));
  // Block i's drop connect rate is 0.2 x i / 16; only blocks that add their input back drop.
  CHECK(net->blocks[0].drop_connect_rate == 0);
  CHECK(net->blocks[8].drop_connect_rate == 0.2 * 8 / 16);
  int skips = 0;
  for (const auto& [name, child] : net->children())
    if (const auto* block = dynamic_cast<nn::MBConvBlock*>(child.get())) skips += block->has_skip();
  CHECK(skips == 9);  // (16 blocks less the 7 stages' first)
}

TEST_CASE(
    "EfficientNet training: drop connect and dropout draw from the stream; checkpointed "
    "segments recompute the same masks") {
  sk::Context ctx({.seed = 3});
  nn::EfficientNetOptions o = options_of("B0");
  o.params.width_coefficient =
      0.25;  // (a narrow B0 and a higher drop rate: a quick test that drops)
  o.drop_connect_rate = 0.6;
  auto net = nn::efficientnet(ctx, o);
  const Variable images = random_images(ctx, {4, 3, 16, 16});
  const auto run = [&](int segments, std::uint64_t key) {
    net->set_checkpoint_segments(segments);
    net->zero_grad();
    ag::tape(ctx).set_random_stream({key, 0});
    const Variable y = (*net)(ctx, images);
    const auto drawn = ag::tape(ctx).random_stream().next_block;
    ag::backward(ctx, y, sk::full(ctx, y.shape(), sk::DType::f32, 0.25));
    std::vector<std::vector<float>> values{sk::to_vector<float>(ctx, y.data())};
    for (const auto& [name, p] : net->named_parameters())
      values.push_back(sk::to_vector<float>(ctx, p.grad()));
    return std::make_pair(values, drawn);
  };
  const auto [plain, drawn] = run(0, 41);
  // One word a sample for each of the 9 blocks with a skip (one block a sample: 4 words, one
  // Philox block), then 4 x 1280 / 4 blocks of dropout's words.
  CHECK(drawn == 9 + 4 * net->feature_dim / 4);
  CHECK(run(4, 41).first == plain);
  CHECK(run(0, 42).first != plain);  // (another key: other masks)
  // Evaluation drops nothing and draws nothing.
  net->eval();
  ag::tape(ctx).set_random_stream({43, 0});
  (void)(*net)(ctx, images);
  CHECK(ag::tape(ctx).random_stream().next_block == 0);
}
