// Dropout and drop connect (autograd/dropout.hpp): the masks' rule (kept where the Philox word's
// unit value is >= p, scaled by 1 / (1 - p)), their statistics, the tape's random stream
// (determinism by key, fresh masks per draw, put back for a checkpointed recomputation),
// gradients against float64 finite differences, refusals; and SiLU's gradient.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "gradcheck.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;
using ag::Variable;

namespace {

Variable random_f64(sk::Context& ctx, sk::Shape shape, double low, double high) {
  return ag::testing::random_variable(ctx, std::move(shape), low, high);
}

// Each element's mask value as the rule gives it from the stream (seed, first block).
std::vector<double> expected_mask(std::uint64_t seed, std::uint64_t first_block, std::int64_t n,
                                  double p) {
  const sk::RandomSpec spec{sk::RandomKind::keep_mask, p, 1.0 / (1.0 - p), seed, first_block};
  std::vector<double> out;
  for (std::int64_t i = 0; i < n; ++i) out.push_back(spec.value_at(static_cast<std::uint64_t>(i)));
  return out;
}

}  // namespace

TEST_CASE("dropout keeps x / (1 - p) where the stream's word is >= p, zero elsewhere") {
  sk::Context ctx({.seed = 3});
  const auto x = random_f64(ctx, {40, 50}, 0.5, 2);  // (never 0: a zero is a dropped element)
  ag::tape(ctx).set_random_stream({11, 5});
  const Variable y = ag::dropout(ctx, x, 0.3);
  CHECK(ag::tape(ctx).random_stream().next_block == 5 + 2000 / 4);
  const auto xv = sk::to_vector<double>(ctx, x.data()), yv = sk::to_vector<double>(ctx, y.data());
  const auto mask = expected_mask(11, 5, 2000, 0.3);
  std::int64_t kept = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) {
    CHECK(yv[i] == xv[i] * mask[i]);
    kept += yv[i] != 0;
  }
  // Kept with probability 0.7: 1400 of 2000, a standard deviation of 20.5.
  CHECK(std::abs(kept - 1400) < 80);
  // Another draw from the stream: another mask; the same key: the same mask.
  const auto again = sk::to_vector<double>(ctx, ag::dropout(ctx, x, 0.3).data());
  CHECK(again != yv);
  ag::tape(ctx).set_random_stream({11, 5});
  CHECK(sk::to_vector<double>(ctx, ag::dropout(ctx, x, 0.3).data()) == yv);
  // p = 0 is the identity; p outside [0, 1) is refused by name.
  CHECK(ag::dropout(ctx, x, 0).data().data_ptr() == x.data().data_ptr());
  CHECK_THROWS_WITH_AS(ag::dropout(ctx, x, 1.0), doctest::Contains("probability 1 is outside"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(nn::Dropout(-0.1), doctest::Contains("in [0, 1)"), sk::InvalidArgument);
}

TEST_CASE(
    "bf16 and f16 dropout: the kept values x / (1 - p) rounded once, not by a rounded scale") {
  sk::Context ctx({.seed = 8});
  for (const sk::DType dtype : {sk::DType::bf16, sk::DType::f16}) {
    CAPTURE(sk::dtype_name(dtype));
    const sk::Tensor x = sk::cast(ctx, random_f64(ctx, {4000}, 0.5, 2).data(), dtype);
    for (const bool per_sample : {false, true}) {
      CAPTURE(per_sample);
      ag::tape(ctx).set_random_stream({13, 0});
      const Variable in(per_sample ? x.view({4000, 1}) : x);
      const double p = 0.025;  // (1 / 0.975 is 1.0234 in bf16: 0.2% off)
      const auto as_f32 = [&](const sk::Tensor& t) {
        return sk::to_vector<float>(ctx, sk::cast(ctx, t, sk::DType::f32));
      };
      const auto y =
          as_f32((per_sample ? ag::drop_connect(ctx, in, p) : ag::dropout(ctx, in, p)).data());
      const auto exact = as_f32(sk::cast(
          ctx, ag::fn::scale(ctx, sk::cast(ctx, x, sk::DType::f32), 1.0 / (1.0 - p)), dtype));
      std::int64_t kept = 0, equal = 0;
      for (std::size_t i = 0; i < y.size(); ++i)
        if (y[i] != 0) ++kept, equal += y[i] == exact[i];
      CHECK(kept > 3800);
      CHECK(equal == kept);
    }
  }
}

TEST_CASE("a step's range of the random stream is not overrun") {
  sk::Context ctx({.seed = 9});
  const auto x = random_f64(ctx, {100}, -1, 1);
  ag::tape(ctx).set_random_stream({14, 0, 20});  // 25 blocks needed
  CHECK_THROWS_WITH_AS(ag::dropout(ctx, x, 0.5), doctest::Contains("pass its end, block 20"),
                       sk::StateError);
  // An unkeyed tape draws from the context's seed, apart from the context's own stream.
  sk::Context other({.seed = 9});
  CHECK(ag::tape(other).random_stream().key == ag::random_stream_key(9, 0));
  CHECK(ag::random_stream_key(9, 0) != 9);
  CHECK(ag::random_stream_key(9, 0) != ag::random_stream_key(9, 1));
}

TEST_CASE("drop connect zeroes whole samples, each kept with probability 1 - p") {
  sk::Context ctx({.seed = 4});
  const auto x = random_f64(ctx, {400, 3, 2, 2}, 0.5, 2);
  ag::tape(ctx).set_random_stream({12, 0});
  const Variable y = ag::drop_connect(ctx, x, 0.25);
  CHECK(ag::tape(ctx).random_stream().next_block == 100);  // one word a sample
  const auto xv = sk::to_vector<double>(ctx, x.data()), yv = sk::to_vector<double>(ctx, y.data());
  const auto mask = expected_mask(12, 0, 400, 0.25);
  std::int64_t kept = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) CHECK(yv[i] == xv[i] * mask[i / 12]);
  for (const double m : mask) kept += m != 0;
  CHECK(std::abs(kept - 300) < 30);  // (a standard deviation of 8.7)
}

TEST_CASE("dropout, drop connect and SiLU gradients against float64 finite differences") {
  sk::Context ctx({.seed = 5});
  const auto x = random_f64(ctx, {3, 4, 2, 3}, -1, 1);
  for (const bool per_sample : {false, true}) {
    CAPTURE(per_sample);
    // (each evaluation draws the same masks: the stream is keyed again before it)
    const auto result = ag::testing::gradcheck(ctx, {x}, [&](const std::vector<Variable>& v) {
      ag::tape(ctx).set_random_stream({21, 0});
      return per_sample ? ag::drop_connect(ctx, v[0], 0.5) : ag::dropout(ctx, v[0], 0.5);
    });
    CHECK(result.worst_relative_error <= 1e-6);
  }
  const auto wide = random_f64(ctx, {2, 3, 4}, -8, 8);  // (both tails of the sigmoid)
  const auto silu = ag::testing::gradcheck(
      ctx, {wide}, [&](const std::vector<Variable>& v) { return ag::silu(ctx, v[0]); });
  CHECK(silu.worst_relative_error <= 1e-6);
  ag::NoGradGuard no_grad(ctx);
  const auto wv = sk::to_vector<double>(ctx, wide.data());
  const auto sv = sk::to_vector<double>(ctx, ag::silu(ctx, wide).data());
  for (std::size_t i = 0; i < sv.size(); ++i) CHECK(sv[i] == wv[i] / (1 + std::exp(-wv[i])));
}

TEST_CASE("a checkpointed segment recomputes with the dropout masks its forward drew") {
  sk::Context ctx({.seed = 6});
  // Linear, dropout, Linear, dropout, Linear in two checkpointed segments, against the same
  // network without checkpointing: the same output and gradients, bit for bit.
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(ctx, 8, 16));
  net->push_back(std::make_shared<nn::Dropout>(0.5));
  net->push_back(std::make_shared<nn::Linear>(ctx, 16, 16));
  net->push_back(std::make_shared<nn::Dropout>(0.5));
  net->push_back(std::make_shared<nn::Linear>(ctx, 16, 4));
  sk::Tensor input = sk::empty(ctx, {5, 8}, sk::DType::f32);
  sk::normal_(ctx, input, 0.0, 1.0);
  const auto run = [&](int segments) {
    net->set_checkpoint_segments(segments);
    net->zero_grad();
    ag::tape(ctx).set_random_stream({31, 7});
    const Variable y = (*net)(ctx, Variable(input));
    ag::backward(ctx, y, sk::full(ctx, y.shape(), sk::DType::f32, 0.5));
    std::vector<std::vector<float>> values{sk::to_vector<float>(ctx, y.data())};
    for (const auto& [name, p] : net->named_parameters())
      values.push_back(sk::to_vector<float>(ctx, p.grad()));
    return values;
  };
  const auto plain = run(0);
  CHECK(run(2) == plain);
  CHECK(run(3) == plain);
  // Evaluation draws nothing and drops nothing.
  net->eval();
  const auto before = ag::tape(ctx).random_stream().next_block;
  (void)(*net)(ctx, Variable(input));
  CHECK(ag::tape(ctx).random_stream().next_block == before);
}

TEST_CASE("a dropout mask inside a captured step is refused by name") {
  sk::Context ctx({.seed = 7});
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 0, .max_graphs = 1});
  const auto x = random_f64(ctx, {4, 4}, -1, 1);
  CHECK_THROWS_WITH_AS(graph.run("k", [&] { (void)ag::dropout(ctx, x, 0.1); }),
                       doctest::Contains("dropout's mask inside the captured step"),
                       sk::CaptureRefused);
}
