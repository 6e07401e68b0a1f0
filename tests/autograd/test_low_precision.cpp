// f16 and bf16 on the CPU (store low precision, compute in f32, round on store): an MLP and a
// ResNet-18 run forward and backward in 16 bits, and their logits, loss and parameter
// gradients stay within what the format's rounding gives of the f32 run from the same weights;
// batch-norm keeps f32 statistics.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace nn = shardkit::nn;
namespace ag = shardkit::autograd;

namespace {

// Norm-wise relative difference of two tensors (any dtypes), in f64.
double relative(sk::Context& ctx, const sk::Tensor& got, const sk::Tensor& want) {
  const auto a = sk::to_vector<double>(ctx, sk::cast(ctx, got, sk::DType::f64));
  const auto b = sk::to_vector<double>(ctx, sk::cast(ctx, want, sk::DType::f64));
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// Every parameter of `net` as `dtype` (the compute copy of mixed precision).
void cast_parameters(sk::Context& ctx, nn::Module& net, sk::DType dtype) {
  for (auto& [name, p] : net.named_parameters()) p.set_data(sk::cast(ctx, p.data(), dtype));
}

struct Result {
  sk::Tensor logits, loss;
  std::vector<sk::Tensor> grads;
};

template <class Build>
Result run(sk::Context& ctx, Build&& build, sk::DType dtype, const sk::Shape& input) {
  auto net = build(ctx);
  if (dtype != sk::DType::f32) cast_parameters(ctx, *net, dtype);
  sk::Context data({.seed = 17});
  auto x = sk::empty(data, input, sk::DType::f32);
  sk::normal_(data, x, 0.0, 1.0);
  std::vector<std::int64_t> labels;
  for (std::int64_t i = 0; i < input[0]; ++i) labels.push_back(i % 5);
  auto logits = (*net)(ctx, ag::Variable(sk::cast(ctx, x, dtype)));
  auto loss = ag::cross_entropy(ctx, logits, sk::from_vector(ctx, labels, {input[0]}));
  ag::backward(ctx, loss);
  Result out{logits.data(), loss.data(), {}};
  for (auto& p : net->parameters()) out.grads.push_back(p.grad());
  return out;
}

// Every parameter's gradient as one f64 vector.
sk::Tensor flat(sk::Context& ctx, const std::vector<sk::Tensor>& grads) {
  std::vector<double> all;
  for (const auto& g : grads) {
    const auto v = sk::to_vector<double>(ctx, sk::cast(ctx, g, sk::DType::f64));
    all.insert(all.end(), v.begin(), v.end());
  }
  return sk::from_vector(ctx, all, {static_cast<std::int64_t>(all.size())});
}

template <class Net>
std::shared_ptr<Net> randomised(sk::Context& ctx, std::shared_ptr<Net> net) {
  sk::Context init({.seed = 3});
  for (auto& p : net->parameters()) {
    auto v = sk::empty(init, p.shape(), sk::DType::f32);
    sk::uniform_(init, v, -0.2, 0.2);
    sk::copy(ctx, p.data(), v);
  }
  return net;
}

}  // namespace

// Each stored 16-bit tensor carries the format's rounding (2^-9 for bf16, 2^-12 for f16); a
// gradient that sums 16 K products with cancellation (batch-norm, convolution) amplifies it,
// and 20 such layers compound. The bounds below are what that gives, measured; a kernel that
// lost its f32 arithmetic or rounded twice would miss the tight ones.
TEST_CASE("an MLP in bf16 on the CPU: every gradient within 10% of the f32 run") {
  auto mlp = [](sk::Context& ctx) {
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Flatten>());
    net->push_back(std::make_shared<nn::Linear>(ctx, 3 * 32 * 32, 64));
    for (int l = 0; l < 6; ++l) {
      net->push_back(std::make_shared<nn::ReLU>());
      net->push_back(std::make_shared<nn::Linear>(ctx, 64, 64));
    }
    net->push_back(std::make_shared<nn::ReLU>());
    net->push_back(std::make_shared<nn::Linear>(ctx, 64, 5));
    return randomised(ctx, net);
  };
  sk::Context ctx;
  const auto f32 = run(ctx, mlp, sk::DType::f32, {16, 3, 32, 32});
  const auto bf16 = run(ctx, mlp, sk::DType::bf16, {16, 3, 32, 32});
  CHECK(relative(ctx, bf16.logits, f32.logits) < 0.02);
  for (std::size_t i = 0; i < f32.grads.size(); ++i)
    CHECK(relative(ctx, bf16.grads[i], f32.grads[i]) < 0.1);
}

TEST_CASE("a ResNet-18 in f16 and bf16 on the CPU follows the f32 run") {
  auto resnet = [](sk::Context& ctx) {
    nn::ResNetOptions o;
    o.num_classes = 5;
    o.small_image_stem = true;
    o.base_channels = 8;
    return randomised(ctx, nn::resnet18(ctx, o));
  };
  sk::Context ctx;
  const auto f32 = run(ctx, resnet, sk::DType::f32, {16, 3, 32, 32});
  for (auto dtype : {sk::DType::bf16, sk::DType::f16}) {
    const bool bf16 = dtype == sk::DType::bf16;
    const auto low = run(ctx, resnet, dtype, {16, 3, 32, 32});
    CAPTURE(sk::dtype_name(dtype));
    CHECK(low.logits.dtype() == dtype);
    CHECK(low.loss.dtype() == sk::DType::f32);  // losses accumulate in f32
    const double logits = relative(ctx, low.logits, f32.logits);
    const double head = relative(ctx, low.grads.back(), f32.grads.back());  // fc.bias
    const double head_weight =
        relative(ctx, low.grads[low.grads.size() - 2], f32.grads[f32.grads.size() - 2]);
    const double whole = relative(ctx, flat(ctx, low.grads), flat(ctx, f32.grads));
    CHECK(logits < (bf16 ? 0.01 : 0.002));
    CHECK(relative(ctx, low.loss, f32.loss) < (bf16 ? 0.01 : 0.002));
    CHECK(head < (bf16 ? 0.01 : 0.002));
    CHECK(head_weight < (bf16 ? 0.03 : 0.005));
    CHECK(whole < (bf16 ? 0.5 : 0.25));
    for (const auto& g : low.grads) CHECK(g.dtype() == dtype);
    MESSAGE(sk::dtype_name(dtype), ": logits ", logits, ", fc weight gradient ", head_weight,
            ", all gradients ", whole);
  }
}

TEST_CASE("batch-norm in a 16-bit network keeps f32 running statistics") {
  sk::Context ctx;
  nn::BatchNorm bn(ctx, 6, 1);
  for (auto& p : bn.parameters()) p.set_data(sk::cast(ctx, p.data(), sk::DType::bf16));
  sk::Context data({.seed = 5});
  auto x = sk::empty(data, {10, 6}, sk::DType::f32);
  sk::normal_(data, x, 2.0, 3.0);
  auto y = bn(ctx, ag::Variable(sk::cast(ctx, x, sk::DType::bf16)));
  CHECK(y.dtype() == sk::DType::bf16);
  for (const auto& [name, b] : bn.named_buffers())
    if (sk::is_floating(b.dtype())) CHECK(b.dtype() == sk::DType::f32);
  // The running mean moved towards the batch mean (about 2), computed in f32.
  const auto mean = sk::to_vector<float>(ctx, bn.named_buffers()[0].second);
  for (float m : mean) CHECK(m > 0.05f);
}
