// Every differentiable op against central finite differences in float64 (relative error <= 1e-6).
#include <doctest/doctest.h>

#include "gradcheck.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;
using ag::testing::gradcheck;
using ag::testing::random_away_from_zero;
using ag::testing::random_variable;

namespace {

constexpr double kTolerance = 1e-6;

void expect_gradients(sk::Context& ctx, const std::vector<Variable>& inputs,
                      const ag::testing::Forward& forward) {
  const auto result = gradcheck(ctx, inputs, forward);
  INFO("worst input " << result.worst_input << ", relative error " << result.worst_relative_error);
  CHECK(result.worst_relative_error <= kTolerance);
}

}  // namespace

TEST_CASE("gradcheck detects a wrong gradient") {
  sk::Context ctx({.seed = 1});
  auto a = random_variable(ctx, {3, 4}, -1, 1), b = random_variable(ctx, {3, 4}, -1, 1);
  auto forward = [&](const std::vector<Variable>& v) { return ag::mul(ctx, v[0], v[1]); };
  CHECK(gradcheck(ctx, {a, b}, forward).worst_relative_error <= kTolerance);
  CHECK(gradcheck(ctx, {a, b}, forward, 1e-6, 1e-3).worst_relative_error > kTolerance);
}

TEST_CASE("element-wise and shape ops") {
  sk::Context ctx({.seed = 2});
  auto a = random_variable(ctx, {2, 3, 4}, -1, 1), b = random_variable(ctx, {2, 3, 4}, -1, 1);
  expect_gradients(ctx, {a, b}, [&](const auto& v) { return ag::add(ctx, v[0], v[1]); });
  expect_gradients(ctx, {a, b}, [&](const auto& v) { return ag::mul(ctx, v[0], v[1]); });
  expect_gradients(ctx, {a}, [&](const auto& v) { return ag::scale(ctx, v[0], -2.5); });
  auto c = random_variable(ctx, {1, 3, 4}, -1, 1);
  expect_gradients(ctx, {a, c, b}, [&](const auto& v) { return ag::cat(ctx, {v[0], v[1], v[2]}); });
  expect_gradients(ctx, {a}, [&](const auto& v) { return ag::cat(ctx, {v[0], v[0]}); });
  // The same variable on both sides: gradients from two edges must add up.
  expect_gradients(ctx, {a}, [&](const auto& v) { return ag::mul(ctx, v[0], v[0]); });
  auto r = random_away_from_zero(ctx, {2, 3, 4}, 0.05, 1);
  expect_gradients(ctx, {r}, [&](const auto& v) { return ag::relu(ctx, v[0]); });
  // add_relu: sums at least 0.04 from the kink (|r| >= 0.05, |s| <= 0.01).
  auto s = random_variable(ctx, {2, 3, 4}, -0.01, 0.01);
  expect_gradients(ctx, {r, s}, [&](const auto& v) { return ag::add_relu(ctx, v[0], v[1]); });
  expect_gradients(ctx, {a}, [&](const auto& v) {
    return ag::mul(ctx, ag::flatten(ctx, v[0]), ag::flatten(ctx, v[0]));
  });
}

TEST_CASE("linear and matmul") {
  sk::Context ctx({.seed = 3});
  auto x = random_variable(ctx, {5, 4}, -1, 1), w = random_variable(ctx, {3, 4}, -1, 1);
  auto b = random_variable(ctx, {3}, -1, 1);
  expect_gradients(ctx, {x, w, b},
                   [&](const auto& v) { return ag::linear(ctx, v[0], v[1], v[2]); });
  expect_gradients(ctx, {x, w}, [&](const auto& v) { return ag::linear(ctx, v[0], v[1]); });
  // A frozen weight and bias: the input's gradient alone (the node keeps no copy of x then).
  const Variable frozen_w(w.data()), frozen_b(b.data());
  expect_gradients(ctx, {x},
                   [&](const auto& v) { return ag::linear(ctx, v[0], frozen_w, frozen_b); });
  auto m = random_variable(ctx, {4, 6}, -1, 1);
  expect_gradients(ctx, {x, m}, [&](const auto& v) { return ag::matmul(ctx, v[0], v[1]); });
}

TEST_CASE("conv2d: padded, strided, dilated, pointwise, with bias") {
  sk::Context ctx({.seed = 4});
  struct Case {
    sk::Shape x, w;
    ag::Conv2dOptions o;
    bool bias;
  };
  const Case cases[] = {
      {{2, 3, 5, 5}, {4, 3, 3, 3}, ag::Conv2dOptions::make(1, 1), false},
      {{2, 3, 7, 6}, {4, 3, 3, 3}, ag::Conv2dOptions::make(2, 1), true},
      {{1, 2, 9, 9}, {3, 2, 7, 7}, ag::Conv2dOptions::make(2, 3), false},     // ResNet stem shape
      {{2, 4, 4, 4}, {3, 4, 1, 1}, ag::Conv2dOptions::make(1, 0), true},      // pointwise fast path
      {{2, 4, 5, 5}, {3, 4, 1, 1}, ag::Conv2dOptions::make(2, 0), false},     // strided downsample
      {{1, 2, 7, 7}, {2, 2, 3, 3}, ag::Conv2dOptions::make(1, 2, 2), false},  // dilated
      {{1, 2, 6, 5}, {2, 2, 2, 3}, {2, 1, 0, 1, 1, 1}, true},                 // asymmetric
  };
  for (const auto& c : cases) {
    CAPTURE(sk::shape_str(c.x));
    CAPTURE(sk::shape_str(c.w));
    auto x = random_variable(ctx, c.x, -1, 1), w = random_variable(ctx, c.w, -1, 1);
    auto b = random_variable(ctx, {c.w[0]}, -1, 1);
    if (c.bias)
      expect_gradients(ctx, {x, w, b},
                       [&](const auto& v) { return ag::conv2d(ctx, v[0], v[1], v[2], c.o); });
    else
      expect_gradients(ctx, {x, w},
                       [&](const auto& v) { return ag::conv2d(ctx, v[0], v[1], Variable(), c.o); });
  }
}

TEST_CASE("batch_norm in training and evaluation mode, 2d and 1d") {
  sk::Context ctx({.seed = 5});
  auto w = random_variable(ctx, {3}, 0.5, 1.5), b = random_variable(ctx, {3}, -1, 1);
  ag::BatchNormOptions train;
  train.update_running_stats = false;  // finite differences run the forward many times
  auto x4 = random_variable(ctx, {4, 3, 3, 2}, -2, 2);
  expect_gradients(ctx, {x4, w, b}, [&](const auto& v) {
    return ag::batch_norm(ctx, v[0], v[1], v[2], sk::Tensor(), sk::Tensor(), train);
  });
  auto x2 = random_variable(ctx, {6, 3}, -2, 2);
  expect_gradients(ctx, {x2, w, b}, [&](const auto& v) {
    return ag::batch_norm(ctx, v[0], v[1], v[2], sk::Tensor(), sk::Tensor(), train);
  });
  auto mean = random_variable(ctx, {3}, -0.5, 0.5, false),
       var = random_variable(ctx, {3}, 0.5, 2, false);
  ag::BatchNormOptions eval;
  eval.training = false;
  expect_gradients(ctx, {x4, w, b}, [&](const auto& v) {
    return ag::batch_norm(ctx, v[0], v[1], v[2], mean.data(), var.data(), eval);
  });
  // With a fused ReLU (its mask applied inside the training backward's loops).
  train.relu = eval.relu = true;
  expect_gradients(ctx, {x4, w, b}, [&](const auto& v) {
    return ag::batch_norm(ctx, v[0], v[1], v[2], sk::Tensor(), sk::Tensor(), train);
  });
  expect_gradients(ctx, {x4, w, b}, [&](const auto& v) {
    return ag::batch_norm(ctx, v[0], v[1], v[2], mean.data(), var.data(), eval);
  });
}

TEST_CASE("pooling") {
  sk::Context ctx({.seed = 6});
  auto x = random_variable(ctx, {2, 2, 7, 7}, -1, 1);
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::max_pool2d(ctx, v[0], 3, 2, 1); });
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::max_pool2d(ctx, v[0], 2, 2, 0); });
  expect_gradients(ctx, {x},
                   [&](const auto& v) { return ag::adaptive_avg_pool2d(ctx, v[0], 1, 1); });
  expect_gradients(ctx, {x},
                   [&](const auto& v) { return ag::adaptive_avg_pool2d(ctx, v[0], 3, 4); });
}

TEST_CASE("softmax, log_softmax, l2_normalize, cross_entropy") {
  sk::Context ctx({.seed = 7});
  auto x = random_variable(ctx, {4, 5}, -2, 2);
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::softmax(ctx, v[0]); });
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::log_softmax(ctx, v[0]); });
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::l2_normalize(ctx, v[0]); });
  auto labels = sk::from_vector<std::int64_t>(ctx, {0, 4, 2, 2}, {4});
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::cross_entropy(ctx, v[0], labels); });
  // Soft targets: rows of probabilities (SwAV's codes), and rows that do not sum to one.
  auto soft = ag::softmax(ctx, random_variable(ctx, {4, 5}, -1, 1, false)).data();
  expect_gradients(ctx, {x}, [&](const auto& v) { return ag::cross_entropy(ctx, v[0], soft); });
  auto unnormalised = random_variable(ctx, {4, 5}, 0, 1, false).data();
  expect_gradients(ctx, {x},
                   [&](const auto& v) { return ag::cross_entropy(ctx, v[0], unnormalised); });
}

TEST_CASE("a small network end to end") {
  sk::Context ctx({.seed = 8});
  auto x = random_variable(ctx, {3, 2, 6, 6}, -1, 1);
  auto cw = random_variable(ctx, {4, 2, 3, 3}, -0.5, 0.5);
  auto bw = random_variable(ctx, {4}, 0.5, 1.5), bb = random_variable(ctx, {4}, -0.5, 0.5);
  auto lw = random_variable(ctx, {5, 4}, -1, 1), lb = random_variable(ctx, {5}, -1, 1);
  auto labels = sk::from_vector<std::int64_t>(ctx, {1, 3, 0}, {3});
  ag::BatchNormOptions train;
  train.update_running_stats = false;
  expect_gradients(ctx, {x, cw, bw, bb, lw, lb}, [&](const auto& v) {
    auto h = ag::conv2d(ctx, v[0], v[1], Variable(), ag::Conv2dOptions::make(1, 1));
    h = ag::batch_norm(ctx, h, v[2], v[3], sk::Tensor(), sk::Tensor(), train);
    h = ag::add(ctx, h, h);
    h = ag::adaptive_avg_pool2d(ctx, h, 1, 1);
    h = ag::linear(ctx, ag::flatten(ctx, h), v[4], v[5]);
    return ag::cross_entropy(ctx, h, labels);
  });
}
