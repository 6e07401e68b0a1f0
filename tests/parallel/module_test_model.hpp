// Models and data shared by the module-level tests (ShardedModule, FSDP): an MLP with
// batch-norm and a frozen parameter, a small ResNet-18, per-rank random batches, and the
// parameters/buffers of a module on the host.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "shardkit/nn/nn.hpp"

namespace module_test {

namespace sk = shardkit;
namespace nn = shardkit::nn;
namespace ag = shardkit::autograd;

// Every parameter of `module` uniform in [-bound, bound] from a stream seeded with `seed` (so
// every rank can build the same or a different model).
inline void fill_uniform(sk::Context& ctx, nn::Module& module, std::uint64_t seed, double bound) {
  sk::Context host({.seed = seed});
  for (auto& p : module.parameters()) {
    auto values = sk::empty(host, p.shape(), sk::DType::f32);
    sk::uniform_(host, values, -bound, bound);
    sk::copy(ctx, p.data(), values);
  }
}

// Every parameter from a seeded stream and a frozen bias in the middle.
inline std::shared_ptr<nn::Sequential> mlp(sk::Context& ctx, std::uint64_t seed,
                                           bool with_frozen = true) {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(ctx, 12, 40));
  net->push_back(std::make_shared<nn::BatchNorm>(ctx, 40, 1));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(ctx, 40, 23));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(ctx, 23, 7));
  fill_uniform(ctx, *net, seed, 0.4);
  if (with_frozen) dynamic_cast<nn::Linear&>(net->at(3)).bias.set_requires_grad(false);
  return net;
}

// ResNet-18 (torchvision's layout and names) 8 channels wide with the small-image stem, for
// 8x8 inputs; parameters from a seeded stream.
inline std::shared_ptr<nn::ResNet> small_resnet(sk::Context& ctx, std::uint64_t seed) {
  nn::ResNetOptions o;
  o.num_classes = 5;
  o.small_image_stem = true;
  o.base_channels = 8;
  auto net = nn::resnet18(ctx, o);
  fill_uniform(ctx, *net, seed, 0.1);
  return net;
}

struct Batch {
  ag::Variable x;
  sk::Tensor labels;
};

// Rank `rank`'s batch of step `step`: inputs of `shape`, labels in [0, classes).
inline Batch batch(sk::Context& ctx, const sk::Shape& shape, std::int64_t classes, int rank,
                   int step) {
  sk::Context host({.seed = 7777ull + 1009ull * static_cast<std::uint64_t>(rank) +
                            31ull * static_cast<std::uint64_t>(step)});
  auto x = sk::empty(host, shape, sk::DType::f32);
  sk::normal_(host, x, 0.0, 1.0);
  std::vector<std::int64_t> labels;
  for (std::int64_t i = 0; i < shape[0]; ++i) labels.push_back((i * 3 + rank + step) % classes);
  auto on_ctx = sk::empty(ctx, shape, sk::DType::f32);
  sk::copy(ctx, on_ctx, x);
  return {ag::Variable(on_ctx), sk::from_vector(ctx, labels, {shape[0]})};
}

// Every parameter (in f32: a 16-bit compute copy widened), then every f32 buffer, of `module`
// in state-dict order.
inline std::vector<float> module_values(sk::Context& ctx, const nn::Module& module) {
  std::vector<float> out;
  for (const auto& [name, p] : module.named_parameters()) {
    const sk::Tensor data = sk::contiguous(ctx, p.data());
    const auto v = sk::to_vector<float>(
        ctx, data.dtype() == sk::DType::f32 ? data : sk::cast(ctx, data, sk::DType::f32));
    out.insert(out.end(), v.begin(), v.end());
  }
  for (const auto& [name, b] : module.named_buffers()) {
    if (b.dtype() != sk::DType::f32) continue;
    const auto v = sk::to_vector<float>(ctx, b);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace module_test
