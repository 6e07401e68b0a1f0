// Module checkpoints in safetensors: a ResNet-18 saved and loaded into another instance gives the
// same state and the same outputs; files that do not fit the module are refused, untouched.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "shardkit/checkpoint/module_state.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;

namespace {

std::string scratch(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("shardkit_module_" + std::to_string(::getpid()) + "_" + name + ".safetensors"))
      .string();
}

std::shared_ptr<nn::Module> small_resnet18(sk::Context& ctx, int classes = 10) {
  nn::ResNetOptions o;
  o.num_classes = classes;
  o.small_image_stem = true;
  return nn::resnet18(ctx, o);
}

std::vector<float> eval_logits(sk::Context& ctx, nn::Module& net, const sk::Tensor& images) {
  net.eval();
  ag::NoGradGuard no_grad(ctx);
  return sk::to_vector<float>(ctx, net(ctx, ag::Variable(images)).data());
}

}  // namespace

TEST_CASE("a saved ResNet-18 loads into another instance: same state, same outputs") {
  const auto path = scratch("r18");
  sk::Context ctx({.seed = 3});
  auto net = small_resnet18(ctx);
  auto images = sk::empty(ctx, {4, 3, 12, 12}, sk::DType::f32);
  sk::normal_(ctx, images, 0, 1);
  {  // one training forward, so the running statistics and the batch counter are not defaults
    net->train();
    (void)(*net)(ctx, ag::Variable(images));
  }
  const auto expected = eval_logits(ctx, *net, images);
  sk::checkpoint::save_module(path, ctx, *net);

  sk::Context other({.seed = 99});
  auto copy = small_resnet18(other);
  CHECK(eval_logits(other, *copy, images) != expected);  // differently initialised
  const auto report = sk::checkpoint::load_module(path, other, *copy);
  CHECK(report.missing.empty());
  CHECK(report.unexpected.empty());
  CHECK(eval_logits(other, *copy, images) == expected);
  const auto a = net->state_dict(), b = copy->state_dict();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].first == b[i].first);
    CHECK(sk::checkpoint::host_bytes(ctx, a[i].first, a[i].second).bytes ==
          sk::checkpoint::host_bytes(other, b[i].first, b[i].second).bytes);
  }
  CHECK(sk::to_vector<std::int64_t>(other, copy->state_dict()[5].second)[0] ==
        1);  // bn1.num_batches_tracked
  std::filesystem::remove(path);
}

TEST_CASE("a checkpoint that does not fit the module is refused and the module stays as it was") {
  const auto path = scratch("misfit");
  sk::Context ctx({.seed = 5});
  auto ten = small_resnet18(ctx, 10);
  sk::checkpoint::save_module(path, ctx, *ten);
  auto hundred = small_resnet18(ctx, 100);
  const auto before = sk::to_vector<float>(ctx, hundred->state_dict().front().second);
  CHECK_THROWS_WITH_AS(
      sk::checkpoint::load_module(path, ctx, *hundred),
      doctest::Contains("'fc.weight' is f32[10, 512] in the file but f32[100, 512] in the module"),
      sk::IoError);
  CHECK(sk::to_vector<float>(ctx, hundred->state_dict().front().second) == before);  // untouched

  auto resnet34 = nn::resnet34(ctx);
  CHECK_THROWS_WITH_AS(sk::checkpoint::load_module(path, ctx, *resnet34),
                       doctest::Contains("missing [layer1.2.conv1.weight"), sk::IoError);
  // Not strict: the matching names load, the rest is reported. A Linear named like the fc.
  nn::Sequential head;
  head.add("fc", std::make_shared<nn::Linear>(ctx, 512, 10));
  const auto report = sk::checkpoint::load_module(path, ctx, head, false);
  CHECK(report.missing.empty());
  CHECK(report.unexpected.size() == ten->state_dict().size() - 2);
  CHECK(sk::to_vector<float>(ctx, head.state_dict()[0].second) ==
        sk::to_vector<float>(ctx, ten->state_dict()[ten->state_dict().size() - 2].second));
  std::filesystem::remove(path);
}
