// Channels-last activations (core/channels_last.hpp) against the same computation in NCHW:
// the layout helpers; convolution, batch-norm (training, fused ReLU, evaluation), add, ReLU,
// max-pool and adaptive average pool kept channels-last, with their gradients; gradients of
// mixed layouts summed; a ResNet with ResNetOptions::channels_last against the plain one.
// Convolutions take other oneDNN kernels in the two layouts (equal to rounding), the im2col
// path the same arithmetic (equal bits); element-wise ops and pooling give the same bits in
// either layout.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "gradcheck.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;

namespace {

// (cl_: the tests of a layer build as one unit, beside other files' helpers)
sk::Tensor cl_random(sk::Context& ctx, const sk::Shape& shape, sk::DType dtype, double low = -1,
                     double high = 1) {
  sk::Tensor t = sk::empty(ctx, shape, dtype, sk::MemoryCategory::activations);
  sk::uniform_(ctx, t, low, high);
  return t;
}

std::vector<double> cl_values(sk::Context& ctx, const sk::Tensor& t) {
  return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
}

// A function run on NCHW inputs, or with its first `converted` inputs channels-last copies of
// the same values: its output and input gradients (of sum(y * r), r random), and whether the
// gradient reaching the first input was channels-last (seen by a hook: a leaf's own gradient
// is stored contiguous, whatever its data's layout).
struct ClRun {
  std::vector<double> y;
  std::vector<std::vector<double>> grads;
  bool y_channels_last = false;
  bool grad_channels_last = false;
  bool grads_contiguous = true;
};

template <class F>
ClRun cl_run(sk::Context& ctx, const std::vector<sk::Tensor>& inputs, bool channels_last, F&& f,
             std::uint64_t seed, std::size_t converted = 1) {
  std::vector<Variable> leaves, vars;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    leaves.emplace_back(channels_last && i < converted
                            ? sk::to_channels_last(ctx, sk::clone(ctx, inputs[i]))
                            : sk::clone(ctx, inputs[i]),
                        true);
  ClRun out;
  vars = leaves;
  vars[0] = ag::identity_with_hook(ctx, leaves[0], [&](const sk::Tensor& g) {
    out.grad_channels_last = sk::keeps_channels_last(g);
  });
  Variable y = f(vars);
  sk::Context rctx({.seed = seed});
  const sk::Tensor r = cl_random(rctx, y.shape(), y.dtype());
  ag::backward(ctx, y, r);
  out.y = cl_values(ctx, y.data());
  out.y_channels_last = sk::keeps_channels_last(y.data());
  for (const auto& v : leaves) {
    out.grads.push_back(cl_values(ctx, v.grad()));
    out.grads_contiguous = out.grads_contiguous && v.grad().is_contiguous();
  }
  return out;
}

}  // namespace

TEST_CASE("channels-last tensors: layout, copies and which tensors the ops keep so") {
  sk::Context ctx({.seed = 1});
  const sk::Tensor x = cl_random(ctx, {2, 3, 4, 5}, sk::DType::f32);
  const sk::Tensor c = sk::to_channels_last(ctx, x);
  CHECK(c.strides() == sk::Shape{60, 1, 15, 3});
  CHECK(sk::is_channels_last(c));
  CHECK_FALSE(c.is_contiguous());
  CHECK(sk::keeps_channels_last(c));
  CHECK(sk::to_vector<float>(ctx, c) == sk::to_vector<float>(ctx, x));  // same logical values
  CHECK(sk::to_channels_last(ctx, c).data_ptr() == c.data_ptr());       // already so: itself
  CHECK(sk::dense(ctx, c).data_ptr() == c.data_ptr());
  CHECK(sk::dense_as(ctx, x, c).strides() == c.strides());
  CHECK(sk::dense_as(ctx, c, x).is_contiguous());
  // One channel, or 1 x 1 planes: both layouts at once, and kept as contiguous.
  const sk::Tensor one = cl_random(ctx, {2, 1, 4, 5}, sk::DType::f32);
  CHECK(sk::is_channels_last(one));
  CHECK_FALSE(sk::keeps_channels_last(one));
  CHECK_FALSE(sk::is_channels_last(x));
  CHECK_FALSE(sk::is_channels_last(cl_random(ctx, {2, 3, 4}, sk::DType::f32)));
  // Half types go through contiguous f32 copies in the CPU's kernels: not kept.
  CHECK_FALSE(
      sk::keeps_channels_last(sk::to_channels_last(ctx, sk::cast(ctx, x, sk::DType::bf16))));
}

TEST_CASE("a channels-last convolution equals the NCHW one, and keeps the layout") {
  sk::Context ctx({.seed = 2});
  struct Case {
    sk::Shape x, w;
    ag::Conv2dOptions o;
  };
  const Case cases[] = {
      {{4, 16, 10, 10}, {16, 16, 3, 3}, ag::Conv2dOptions::make(1, 1)},
      {{3, 8, 13, 11}, {16, 8, 3, 3}, ag::Conv2dOptions::make(2, 1)},
      {{4, 16, 9, 9}, {32, 16, 1, 1}, ag::Conv2dOptions::make(2, 0)},
      {{2, 3, 20, 20}, {8, 3, 7, 7}, ag::Conv2dOptions::make(2, 3)},
      {{4, 16, 10, 10}, {16, 4, 3, 3}, ag::Conv2dOptions::make(1, 1, 1, 4)},  // grouped
  };
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (const auto& c : cases) {
      CAPTURE(dtype);
      CAPTURE(c.x);
      const sk::Tensor x = cl_random(ctx, c.x, dtype), w = cl_random(ctx, c.w, dtype, -0.3, 0.3);
      auto f = [&](const std::vector<Variable>& v) { return ag::conv2d(ctx, v[0], v[1], {}, c.o); };
      const ClRun plain = cl_run(ctx, {x, w}, false, f, 7);
      const ClRun last = cl_run(ctx, {x, w}, true, f, 7);
      CHECK(last.y_channels_last);
      CHECK(last.grad_channels_last);
      CHECK(last.grads_contiguous);
      CHECK_FALSE(plain.y_channels_last);
      CHECK_FALSE(plain.grad_channels_last);
      const double bound = dtype == sk::DType::f32 ? 1e-5 : 1e-13;
      CHECK(ag::testing::scaled_error(last.y, plain.y) < bound);
      CHECK(ag::testing::scaled_error(last.grads[0], plain.grads[0]) < bound);
      CHECK(ag::testing::scaled_error(last.grads[1], plain.grads[1]) < bound);
      if (dtype == sk::DType::f64) {  // im2col on contiguous copies: the same arithmetic
        CHECK(last.y == plain.y);
        CHECK(last.grads[0] == plain.grads[0]);
      }
    }
  }
  // Asked for: an NCHW input (here of one channel, as a network's images) gives a channels-last
  // output, equal to the plain convolution's.
  const sk::Tensor x = cl_random(ctx, {4, 1, 12, 12}, sk::DType::f32);
  const sk::Tensor w = cl_random(ctx, {8, 1, 3, 3}, sk::DType::f32);
  ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1);
  const Variable plain = ag::conv2d(ctx, Variable(x), Variable(w), {}, o);
  o.channels_last = true;
  const Variable last = ag::conv2d(ctx, Variable(x), Variable(w), {}, o);
  CHECK(sk::keeps_channels_last(last.data()));
  CHECK(ag::testing::scaled_error(cl_values(ctx, last.data()), cl_values(ctx, plain.data())) <
        1e-5);
  // With a bias: its add and its gradient's sums read rows of channels.
  const sk::Tensor x3 = cl_random(ctx, {3, 4, 6, 6}, sk::DType::f64);
  const sk::Tensor w3 = cl_random(ctx, {5, 4, 3, 3}, sk::DType::f64);
  const sk::Tensor b3 = cl_random(ctx, {5}, sk::DType::f64);
  ClRun runs[2];
  for (int k = 0; k < 2; ++k) {
    Variable bias(sk::clone(ctx, b3), true);
    runs[k] = cl_run(
        ctx, {x3, w3}, k == 1,
        [&](const std::vector<Variable>& v) {
          return ag::conv2d(ctx, v[0], v[1], bias, ag::Conv2dOptions::make(1, 1));
        },
        9);
    runs[k].grads.push_back(cl_values(ctx, bias.grad()));
  }
  CHECK(runs[1].y_channels_last);
  CHECK(runs[1].y == runs[0].y);
  CHECK(runs[1].grads[2] == runs[0].grads[2]);  // the same values summed in the same order
}

TEST_CASE("channels-last batch-norm equals the NCHW one: training, fused ReLU, evaluation") {
  sk::Context ctx({.seed = 3});
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (bool relu : {false, true}) {
      for (bool training : {true, false}) {
        CAPTURE(dtype);
        CAPTURE(relu);
        CAPTURE(training);
        const sk::Shape shape{6, 12, 7, 5};
        const sk::Tensor x = cl_random(ctx, shape, dtype, -2, 3);
        const sk::Tensor w = cl_random(ctx, {12}, dtype, 0.5, 1.5), b = cl_random(ctx, {12}, dtype);
        const sk::Tensor rm = cl_random(ctx, {12}, dtype), rv = cl_random(ctx, {12}, dtype, 0.5, 2);
        std::vector<double> running[2];
        ClRun runs[2];
        for (int k = 0; k < 2; ++k) {
          const sk::Tensor mean = sk::clone(ctx, rm), var = sk::clone(ctx, rv);
          runs[k] = cl_run(
              ctx, {x}, k == 1,
              [&](const std::vector<Variable>& v) {
                ag::BatchNormOptions o;
                o.training = training;
                o.relu = relu;
                return ag::batch_norm(ctx, v[0], Variable(w), Variable(b), mean, var, o);
              },
              11);
          running[k] = cl_values(ctx, mean);
          const auto rvar = cl_values(ctx, var);
          running[k].insert(running[k].end(), rvar.begin(), rvar.end());
        }
        CHECK(runs[1].y_channels_last);
        CHECK(runs[1].grad_channels_last);
        const double bound = dtype == sk::DType::f32 ? 2e-6 : 1e-12;
        CHECK(ag::testing::scaled_error(runs[1].y, runs[0].y) < bound);
        CHECK(ag::testing::scaled_error(runs[1].grads[0], runs[0].grads[0]) < bound * 10);
        CHECK(ag::testing::scaled_error(running[1], running[0]) < bound);
      }
    }
  }
}

TEST_CASE("add and relu keep channels-last operands; mixed layouts give the NCHW bits") {
  sk::Context ctx({.seed = 4});
  const sk::Tensor a = cl_random(ctx, {3, 5, 4, 6}, sk::DType::f32);
  const sk::Tensor b = cl_random(ctx, {3, 5, 4, 6}, sk::DType::f32);
  // relu(a + b) + a: a is used twice, so its gradient is a sum of two.
  auto f = [&](const std::vector<Variable>& v) {
    return ag::add(ctx, ag::relu(ctx, ag::add(ctx, v[0], v[1])), v[0]);
  };
  const ClRun plain = cl_run(ctx, {a, b}, false, f, 13, 2);
  const ClRun last = cl_run(ctx, {a, b}, true, f, 13, 2);
  CHECK(last.y_channels_last);
  CHECK(last.y == plain.y);
  CHECK(last.grads[0] == plain.grads[0]);
  CHECK(last.grads[1] == plain.grads[1]);
  // One operand of each layout: the second is brought to the first's.
  const Variable ca(sk::to_channels_last(ctx, a), true), pb(sk::clone(ctx, b), true);
  const Variable mixed = ag::add(ctx, ca, pb);
  CHECK(sk::keeps_channels_last(mixed.data()));
  const Variable other = ag::add(ctx, pb, ca);
  CHECK(other.data().is_contiguous());
  CHECK(cl_values(ctx, mixed.data()) == cl_values(ctx, other.data()));
  ag::backward(ctx, ag::add(ctx, mixed, other), cl_random(ctx, a.shape(), sk::DType::f32));
  CHECK(cl_values(ctx, ca.grad()) == cl_values(ctx, pb.grad()));
  // A second operand of another dtype (the CPU widens a bf16 one into a contiguous f32 copy):
  // brought to the first's layout and dtype first.
  const sk::Tensor half = sk::cast(ctx, b, sk::DType::bf16);
  const auto expected = cl_values(ctx, ag::fn::add(ctx, a, half));
  CHECK(cl_values(ctx, ag::fn::add(ctx, ca.data(), half)) == expected);
  CHECK(cl_values(ctx, ag::fn::add(ctx, ca.data(), sk::to_channels_last(ctx, half))) == expected);
}

TEST_CASE("channels-last max-pool and adaptive average pool give the NCHW bits, kept so") {
  sk::Context ctx({.seed = 4});
  auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
    return true;
  };
  struct Pool {
    std::int64_t kernel, stride, padding;
  };
  struct Adaptive {
    std::int64_t h, w;
  };
  // 5 channels: no group of 16, each alone; 16: one group; 21: a group and 5 alone; 32: two.
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (std::int64_t channels : {5, 16, 21, 32}) {
      CAPTURE(dtype);
      CAPTURE(channels);
      // Values on a coarse grid (ties in most windows) and a NaN in a few planes.
      sk::Tensor x = cl_random(ctx, {3, channels, 13, 11}, sk::DType::f64, -4, 4);
      std::vector<double> v = sk::to_vector<double>(ctx, x);
      for (double& e : v) e = std::round(e);
      for (std::size_t i = 7; i < v.size(); i += 1543) v[i] = std::nan("");
      x = sk::cast(ctx, sk::from_vector<double>(ctx, v, x.shape()), dtype);
      for (const Pool& pool : {Pool{3, 2, 1}, Pool{2, 2, 0}, Pool{3, 1, 1}, Pool{5, 3, 2}}) {
        CAPTURE(pool.kernel);
        CAPTURE(pool.stride);
        auto f = [&](const std::vector<Variable>& in) {
          return ag::max_pool2d(ctx, in[0], pool.kernel, pool.stride, pool.padding);
        };
        const ClRun plain = cl_run(ctx, {x}, false, f, 11);
        const ClRun last = cl_run(ctx, {x}, true, f, 11);
        CHECK(last.y_channels_last);
        CHECK(last.grad_channels_last);
        CHECK(last.grads_contiguous);
        CHECK(same(last.y, plain.y));
        CHECK(same(last.grads[0], plain.grads[0]));
      }
      // (Without NaNs: an average over a NaN is a NaN wherever it is summed.)
      const sk::Tensor smooth = cl_random(ctx, {3, channels, 13, 11}, dtype);
      for (const Adaptive& a : {Adaptive{1, 1}, Adaptive{3, 2}, Adaptive{5, 4}, Adaptive{13, 11}}) {
        CAPTURE(a.h);
        CAPTURE(a.w);
        auto f = [&](const std::vector<Variable>& in) {
          return ag::adaptive_avg_pool2d(ctx, in[0], a.h, a.w);
        };
        const ClRun plain = cl_run(ctx, {smooth}, false, f, 12);
        const ClRun last = cl_run(ctx, {smooth}, true, f, 12);
        CHECK(last.y_channels_last == (a.h * a.w > 1));  // (1 x 1: both layouts, kept as NCHW)
        CHECK(last.grad_channels_last);
        CHECK(last.y == plain.y);
        CHECK(last.grads[0] == plain.grads[0]);
        CHECK(last.grads_contiguous);
      }
      // A 1 x 1 max-pool output (both layouts at once) from a channels-last x.
      const sk::Tensor small = cl_random(ctx, {3, channels, 3, 3}, dtype);
      auto f = [&](const std::vector<Variable>& in) { return ag::max_pool2d(ctx, in[0], 3, 2); };
      const ClRun plain = cl_run(ctx, {small}, false, f, 13);
      const ClRun last = cl_run(ctx, {small}, true, f, 13);
      CHECK(last.grad_channels_last);
      CHECK(last.y == plain.y);
      CHECK(last.grads[0] == plain.grads[0]);
    }
  }
  // The output gradient arriving channels-last, or in f16 for an f32 pool (cast before the
  // kernels read it beside a channels-last grad_x): the NCHW bits still.
  const sk::Tensor x = cl_random(ctx, {2, 21, 9, 9}, sk::DType::f32);
  for (bool max_pool : {true, false}) {
    for (bool half_gradient : {false, true}) {
      CAPTURE(max_pool);
      CAPTURE(half_gradient);
      std::vector<double> y[2], gx[2];
      for (int last = 0; last < 2; ++last) {
        const Variable leaf(
            last == 1 ? sk::to_channels_last(ctx, sk::clone(ctx, x)) : sk::clone(ctx, x), true);
        const Variable out = max_pool ? ag::max_pool2d(ctx, leaf, 3, 2, 1)
                                      : ag::adaptive_avg_pool2d(ctx, leaf, 4, 3);
        sk::Context rctx({.seed = 14});
        const sk::Tensor r = cl_random(rctx, out.shape(), sk::DType::f32);
        ag::backward(
            ctx, out,
            half_gradient ? sk::cast(ctx, r, sk::DType::f16) : sk::to_channels_last(ctx, r));
        y[last] = cl_values(ctx, out.data());
        gx[last] = cl_values(ctx, leaf.grad());
      }
      CHECK(y[1] == y[0]);
      CHECK(gx[1] == gx[0]);
    }
  }
}

TEST_CASE("a channels-last ResNet equals the NCHW one to rounding") {
  for (bool small_stem : {true, false}) {
    CAPTURE(small_stem);
    sk::nn::ResNetOptions options;
    options.num_classes = 10;
    options.small_image_stem = small_stem;
    options.base_channels = 8;
    options.in_channels = small_stem ? 1 : 3;
    double losses[2];
    std::vector<std::vector<double>> grads[2];
    for (int k = 0; k < 2; ++k) {
      sk::Context ctx({.seed = 5});
      options.channels_last = k == 1;
      const auto net = sk::nn::resnet18(ctx, options);
      const sk::Tensor pixels =
          cl_random(ctx, {4, options.in_channels, small_stem ? 12 : 32, small_stem ? 12 : 32},
                    sk::DType::f32);
      const sk::Tensor labels = sk::from_vector<std::int64_t>(ctx, {3, 7, 1, 0}, {4});
      const Variable loss = ag::cross_entropy(ctx, (*net)(ctx, Variable(pixels)), labels);
      ag::backward(ctx, loss);
      losses[k] = cl_values(ctx, loss.data())[0];
      for (const auto& [name, p] : net->named_parameters())
        grads[k].push_back(cl_values(ctx, p.grad()));
    }
    CHECK(losses[1] == doctest::Approx(losses[0]).epsilon(1e-5));
    REQUIRE(grads[0].size() == grads[1].size());
    for (std::size_t i = 0; i < grads[0].size(); ++i) {
      CAPTURE(i);
      CHECK(ag::testing::scaled_error(grads[1][i], grads[0][i]) < 1e-3);
    }
  }
}
