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
  auto wide = random_variable(ctx, {2, 3, 4}, -6, 6);  // (both tails of the sigmoid)
  expect_gradients(ctx, {wide}, [&](const auto& v) { return ag::sigmoid(ctx, v[0]); });
}

TEST_CASE("channel_scale: each plane times its gate, as a squeeze-and-excitation layer") {
  sk::Context ctx({.seed = 21});
  auto x = random_variable(ctx, {2, 3, 4, 5}, -1, 1),
       gate = random_variable(ctx, {2, 3, 1, 1}, -1, 1);
  expect_gradients(ctx, {x, gate},
                   [&](const auto& v) { return ag::channel_scale(ctx, v[0], v[1]); });
  // A gate that is not a leaf, and 1 x 1 planes (a last stage at small images).
  auto y = random_variable(ctx, {3, 4, 1, 1}, -1, 1), w = random_variable(ctx, {3, 4, 1, 1}, -1, 1);
  expect_gradients(ctx, {y, w}, [&](const auto& v) {
    return ag::channel_scale(ctx, v[0], ag::sigmoid(ctx, v[1]));
  });
  // The values: x[n, c, h, w] * gate[n, c] exactly.
  ag::NoGradGuard no_grad(ctx);
  const Variable out = ag::channel_scale(ctx, x, gate);
  const auto xv = sk::to_vector<double>(ctx, x.data()),
             gv = sk::to_vector<double>(ctx, gate.data());
  const auto ov = sk::to_vector<double>(ctx, out.data());
  for (std::size_t i = 0; i < ov.size(); ++i) CHECK(ov[i] == xv[i] * gv[i / 20]);
  CHECK_THROWS_WITH_AS(ag::channel_scale(ctx, x, random_variable(ctx, {2, 3}, -1, 1)),
                       doctest::Contains("give x as [N, C, H, W] and the gate as [N, C, 1, 1]"),
                       sk::InvalidArgument);
}

TEST_CASE("channel_scale of an empty batch: an empty result and empty gradients") {
  sk::Context ctx({.seed = 22});
  for (const sk::Shape& shape : {sk::Shape{0, 3, 4, 5}, sk::Shape{2, 3, 0, 5}}) {
    Variable x(sk::empty(ctx, shape, sk::DType::f64), true);
    Variable gate(sk::empty(ctx, {shape[0], 3, 1, 1}, sk::DType::f64), true);
    const Variable y = ag::channel_scale(ctx, x, ag::sigmoid(ctx, gate));
    CHECK(y.shape() == shape);
    ag::backward(ctx, y, sk::empty(ctx, shape, sk::DType::f64));
    CHECK(x.grad().shape() == shape);
    const auto gate_grad = sk::to_vector<double>(ctx, gate.grad());
    CHECK(std::all_of(gate_grad.begin(), gate_grad.end(), [](double g) { return g == 0; }));
  }
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
      {{2, 4, 5, 5}, {6, 2, 3, 3}, ag::Conv2dOptions::make(1, 1, 1, 2), true},   // 2 groups
      {{2, 6, 5, 5}, {6, 1, 3, 3}, ag::Conv2dOptions::make(2, 1, 1, 6), false},  // depthwise
      {{2, 6, 4, 4}, {9, 2, 1, 1}, ag::Conv2dOptions::make(1, 0, 1, 3), false},  // pointwise, 3
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

TEST_CASE("conv2d with groups: each group's output is its own convolution of its channels") {
  // ResNeXt's 3 x 3 (4 groups of 3 channels, strided), a depthwise one, a grouped pointwise one:
  // forward and gradients against each group's ungrouped convolution on copies of its slices,
  // in f64 (the same arithmetic: the same bits) and f32 (oneDNN's grouped kernels where the
  // build has them: to rounding).
  struct Case {
    sk::Shape x, w;
    ag::Conv2dOptions o;
  };
  const Case cases[] = {
      {{3, 12, 9, 9}, {8, 3, 3, 3}, ag::Conv2dOptions::make(2, 1, 1, 4)},
      {{2, 8, 7, 7}, {8, 1, 3, 3}, ag::Conv2dOptions::make(1, 1, 1, 8)},
      {{2, 6, 5, 5}, {9, 2, 1, 1}, ag::Conv2dOptions::make(1, 0, 1, 3)},
  };
  for (const sk::DType dtype : {sk::DType::f64, sk::DType::f32}) {
    sk::Context ctx({.seed = 9});
    for (const auto& c : cases) {
      CAPTURE(dtype);
      CAPTURE(sk::shape_str(c.w));
      const std::int64_t groups = c.o.groups, ci = c.x[1] / groups, co = c.w[0] / groups;
      Variable x(sk::cast(ctx, random_variable(ctx, c.x, -1, 1).data(), dtype), true);
      Variable w(sk::cast(ctx, random_variable(ctx, c.w, -1, 1).data(), dtype), true);
      const Variable y = ag::conv2d(ctx, x, w, Variable(), c.o);
      const sk::Tensor r = sk::cast(ctx, random_variable(ctx, y.shape(), -1, 1).data(), dtype);
      ag::backward(ctx, y, r);
      const auto y_all = sk::to_vector<double>(ctx, sk::cast(ctx, y.data(), sk::DType::f64));
      const auto gx_all = sk::to_vector<double>(ctx, sk::cast(ctx, x.grad(), sk::DType::f64));
      const auto gw_all = sk::to_vector<double>(ctx, sk::cast(ctx, w.grad(), sk::DType::f64));
      const std::int64_t batch = c.x[0], plane_in = c.x[2] * c.x[3];
      const std::int64_t plane_out = y.size(2) * y.size(3), patch = c.w[1] * c.w[2] * c.w[3];
      std::vector<double> y_ref(y_all.size()), gx_ref(gx_all.size()), gw_ref(gw_all.size());
      for (std::int64_t g = 0; g < groups; ++g) {
        // The group's channels as tensors of their own (`rows` runs of `channels` planes, the
        // first `count` from `first` of each), and its run of r.
        auto slice = [&](const sk::Tensor& t, std::int64_t rows, std::int64_t channels,
                         std::int64_t first, std::int64_t count, std::int64_t plane,
                         sk::Shape shape) {
          const auto all = sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
          std::vector<double> part;
          for (std::int64_t n = 0; n < rows; ++n)
            part.insert(part.end(), all.begin() + (n * channels + first) * plane,
                        all.begin() + (n * channels + first + count) * plane);
          return sk::cast(ctx, sk::from_vector(ctx, part, shape), dtype);
        };
        Variable xg(
            slice(x.data(), batch, c.x[1], g * ci, ci, plane_in, {batch, ci, c.x[2], c.x[3]}),
            true);
        Variable wg(slice(w.data(), 1, c.w[0], g * co, co, patch, {co, c.w[1], c.w[2], c.w[3]}),
                    true);
        ag::Conv2dOptions one = c.o;
        one.groups = 1;
        const Variable yg = ag::conv2d(ctx, xg, wg, Variable(), one);
        ag::backward(
            ctx, yg,
            slice(r, batch, c.w[0], g * co, co, plane_out, {batch, co, y.size(2), y.size(3)}));
        auto place = [&](const sk::Tensor& part, std::vector<double>& whole, std::int64_t channels,
                         std::int64_t first, std::int64_t count, std::int64_t plane,
                         std::int64_t rows) {
          const auto values = sk::to_vector<double>(ctx, sk::cast(ctx, part, sk::DType::f64));
          for (std::int64_t n = 0; n < rows; ++n)
            std::copy(values.begin() + n * count * plane, values.begin() + (n + 1) * count * plane,
                      whole.begin() + (n * channels + first) * plane);
        };
        place(yg.data(), y_ref, c.w[0], g * co, co, plane_out, batch);
        place(xg.grad(), gx_ref, c.x[1], g * ci, ci, plane_in, batch);
        place(wg.grad(), gw_ref, c.w[0], g * co, co, patch, 1);
      }
      if (dtype == sk::DType::f64) {
        CHECK(y_all == y_ref);
        CHECK(gx_all == gx_ref);
        CHECK(gw_all == gw_ref);
      } else {
        CHECK(ag::testing::scaled_error(y_all, y_ref) < 2e-6);
        CHECK(ag::testing::scaled_error(gx_all, gx_ref) < 2e-6);
        CHECK(ag::testing::scaled_error(gw_all, gw_ref) < 2e-6);
      }
    }
  }
  // What does not fit is refused by name.
  sk::Context ctx({.seed = 1});
  const Variable x = random_variable(ctx, {1, 6, 5, 5}, -1, 1);
  CHECK_THROWS_WITH(ag::conv2d(ctx, x, random_variable(ctx, {4, 3, 3, 3}, -1, 1), Variable(),
                               ag::Conv2dOptions::make(1, 1, 1, 4)),
                    doctest::Contains("groups 4 does not divide the input's 6 channels"));
  CHECK_THROWS_WITH(ag::conv2d(ctx, x, random_variable(ctx, {4, 6, 3, 3}, -1, 1), Variable(),
                               ag::Conv2dOptions::make(1, 1, 1, 2)),
                    doctest::Contains("the weight must be [out, 3, kh, kw]"));
  CHECK_THROWS_WITH(ag::conv2d(ctx, x, random_variable(ctx, {5, 3, 3, 3}, -1, 1), Variable(),
                               ag::Conv2dOptions::make(1, 1, 1, 2)),
                    doctest::Contains("does not divide weight"));
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
  // Running statistics that are strided views (a column of a [3, 2] buffer): the kernels wrote
  // them as dense rows, the update landing on the other column. Refused by name.
  ag::BatchNormOptions tracking;
  const sk::Tensor columns = sk::zeros(ctx, {3, 2}, sk::DType::f64);
  CHECK_THROWS_WITH(
      ag::batch_norm(ctx, x4, w, b, columns.select(1, 0), columns.select(1, 1), tracking),
      doctest::Contains("must be dense tensors on the input's device"));
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
  // An input narrower than the kernel is refused, as PyTorch's floor of a negative size does:
  // C++'s truncation gave width 1 there, and the CPU's windows read (and their backward wrote)
  // past each row into the next plane. A width of exactly the kernel's is one window.
  auto narrow = random_variable(ctx, {1, 2, 3, 2}, -1, 1);
  CHECK_THROWS_WITH(
      ag::max_pool2d(ctx, narrow, 3, 2, 0),
      doctest::Contains("max_pool2d: input [1, 2, 3, 2] is smaller than the kernel 3"));
  CHECK_THROWS_WITH(ag::max_pool2d(ctx, random_variable(ctx, {1, 2, 2, 1}, -1, 1), 2, 2, 0),
                    doctest::Contains("is smaller than the kernel 2"));
  CHECK(ag::max_pool2d(ctx, random_variable(ctx, {1, 2, 3, 3}, -1, 1), 3, 2, 0).shape() ==
        sk::Shape{1, 2, 1, 1});
  expect_gradients(ctx, {narrow},
                   [&](const auto& v) { return ag::max_pool2d(ctx, v[0], 3, 2, 1); });
  // Channel blocks in and channels-last out: oneDNN was told the blocked input was NCHW and
  // read it scrambled. One layout at a time.
  {
    auto blocked_in = ag::to_channel_blocks(
        ctx,
        Variable(sk::cast(ctx, random_variable(ctx, {2, 16, 5, 5}, -1, 1).data(), sk::DType::f32)),
        8);
    ag::Conv2dOptions both = ag::Conv2dOptions::make(1, 1);
    both.channel_blocks = both.channels_last = true;
    CHECK_THROWS_WITH(
        ag::conv2d(ctx, blocked_in, Variable(sk::zeros(ctx, {12, 16, 3, 3}, sk::DType::f32)),
                   Variable(sk::zeros(ctx, {12}, sk::DType::f32)), both),
        doctest::Contains("channel blocks and channels_last together"));
  }
  // No pixels in a row or column: a padded window found none to take its maximum from, and
  // the backward added its gradient past the end of grad_x's plane; no average either.
  for (const sk::Shape& empty : {sk::Shape{1, 1, 3, 0}, sk::Shape{1, 1, 0, 3}}) {
    const Variable none(sk::zeros(ctx, empty, sk::DType::f64), true);
    CHECK_THROWS_WITH(ag::max_pool2d(ctx, none, 2, 1, 1), doctest::Contains("max_pool2d: input"));
    CHECK_THROWS_WITH(ag::adaptive_avg_pool2d(ctx, none, 1, 1),
                      doctest::Contains("has no pixels to average"));
  }
  // The same floor for a convolution: a dilated 3 x 3 spans 7 of a 5-wide input.
  CHECK_THROWS_WITH(ag::conv2d(ctx, random_variable(ctx, {1, 2, 5, 5}, -1, 1),
                               random_variable(ctx, {4, 2, 3, 3}, -1, 1), Variable(),
                               ag::Conv2dOptions::make(4, 0, 3)),
                    doctest::Contains("is smaller than the kernel [4, 2, 3, 3]"));
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
