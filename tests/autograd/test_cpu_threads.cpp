// The autograd layer's own CPU ops (batch-norm in training and evaluation, element-wise ops)
// run on the context's thread pool: the same bits on 1, 2, 3 and 5 threads, with running
// statistics updated alike, and an f32 batch-norm within rounding of the f64 one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/autograd/cpu_norm_pool.hpp"  // the pooling loops, called directly

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;

namespace {

struct BnRun {
  std::vector<double> y, gx, gw, gb, running_mean, running_var, eval_y;
};

// relu(batch_norm(x) + x) forward and backward in training mode, then the evaluation forward
// with the updated running statistics; every input drawn from one seed.
BnRun run_block(int threads, sk::DType dtype, sk::Shape shape) {
  sk::Context ctx({.seed = 21, .cpu_threads = threads});
  const std::int64_t channels = shape[1];
  auto draw = [&](sk::Shape s, double low, double high) {
    sk::Tensor t = sk::empty(ctx, std::move(s), sk::DType::f64);
    sk::uniform_(ctx, t, low, high);
    return sk::cast(ctx, t, dtype);
  };
  Variable x(draw(shape, -2, 3), true), w(draw({channels}, 0.5, 1.5), true),
      b(draw({channels}, -1, 1), true);
  sk::Tensor running_mean = draw({channels}, -0.1, 0.1), running_var = draw({channels}, 0.9, 1.1);
  sk::Tensor r = draw(shape, -1, 1);
  Variable y =
      ag::relu(ctx, ag::add(ctx, ag::batch_norm(ctx, x, w, b, running_mean, running_var), x));
  ag::backward(ctx, y, r);
  ag::BatchNormOptions eval;
  eval.training = false;
  Variable e = ag::batch_norm(ctx, Variable(x.data()), Variable(w.data()), Variable(b.data()),
                              running_mean, running_var, eval);
  auto f64 = [&](const sk::Tensor& t) {
    return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
  };
  return {f64(y.data()),     f64(x.grad()),    f64(w.grad()), f64(b.grad()),
          f64(running_mean), f64(running_var), f64(e.data())};
}

// Every field of two runs equal, bit for bit.
void check_same_bits(const BnRun& got, const BnRun& want) {
  CHECK(got.y == want.y);
  CHECK(got.gx == want.gx);
  CHECK(got.gw == want.gw);
  CHECK(got.gb == want.gb);
  CHECK(got.running_mean == want.running_mean);
  CHECK(got.running_var == want.running_var);
  CHECK(got.eval_y == want.eval_y);
}

}  // namespace

TEST_CASE("CPU batch-norm and element-wise ops give the same bits on any thread count") {
  // Planes of 81 (not a multiple of the 8 sum lanes) and of 4 (all tail), and enough elements
  // for several element-wise blocks.
  for (sk::Shape shape :
       {sk::Shape{6, 24, 9, 9}, sk::Shape{40, 32, 2, 2}, sk::Shape{3, 8, 64, 48}}) {
    CAPTURE(sk::shape_str(shape));
    const BnRun one = run_block(1, sk::DType::f32, shape);
    for (int threads : {2, 3, 5}) {
      CAPTURE(threads);
      check_same_bits(run_block(threads, sk::DType::f32, shape), one);
    }
    // And f32 follows the f64 computation of the same inputs (drawn in f64, rounded to f32).
    const BnRun reference = run_block(2, sk::DType::f64, shape);
    auto close = [](const std::vector<double>& a, const std::vector<double>& b) {
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, std::abs(a[i] - b[i]));
        scale = std::max(scale, std::abs(b[i]));
      }
      return worst <= 1e-5 * scale;
    };
    CHECK(close(one.y, reference.y));
    CHECK(close(one.gx, reference.gx));
    CHECK(close(one.gw, reference.gw));
    CHECK(close(one.running_var, reference.running_var));
    CHECK(close(one.eval_y, reference.eval_y));
  }
}

// A ReLU fused into batch-norm (BatchNormOptions::relu, as the ResNet blocks use it) against
// batch_norm followed by relu: the same bits forward and backward, in training and evaluation,
// f32 and f64, on one and three threads.
TEST_CASE("batch-norm with a fused ReLU equals batch-norm then ReLU, bit for bit") {
  const sk::Shape shape{6, 24, 9, 9};
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64})
    for (int threads : {1, 3})
      for (bool training : {true, false}) {
        CAPTURE(sk::dtype_name(dtype));
        CAPTURE(threads);
        CAPTURE(training);
        auto run = [&](bool fused) {
          sk::Context ctx({.seed = 23, .cpu_threads = threads});
          auto draw = [&](sk::Shape s, double low, double high) {
            sk::Tensor t = sk::empty(ctx, std::move(s), sk::DType::f64);
            sk::uniform_(ctx, t, low, high);
            return sk::cast(ctx, t, dtype);
          };
          Variable x(draw(shape, -2, 3), true), w(draw({24}, 0.5, 1.5), true),
              b(draw({24}, -1, 1), true);
          sk::Tensor running_mean = draw({24}, -0.1, 0.1), running_var = draw({24}, 0.9, 1.1);
          sk::Tensor r = draw(shape, -1, 1);
          ag::BatchNormOptions o;
          o.training = training;
          o.relu = fused;
          Variable y = ag::batch_norm(ctx, x, w, b, running_mean, running_var, o);
          if (!fused) y = ag::relu(ctx, y);
          ag::backward(ctx, y, r);
          auto f64 = [&](const sk::Tensor& t) {
            return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
          };
          return BnRun{f64(y.data()),
                       f64(x.grad()),
                       f64(w.grad()),
                       f64(b.grad()),
                       f64(running_mean),
                       f64(running_var),
                       {}};
        };
        const BnRun fused = run(true), separate = run(false);
        const auto zeros = std::count(fused.y.begin(), fused.y.end(), 0.0);
        CHECK(zeros > 0);  // the ReLU cut some outputs and passed others
        CHECK(zeros < static_cast<std::ptrdiff_t>(fused.y.size()));
        check_same_bits(fused, separate);  // (eval_y: empty in both)
      }
}

// A NaN activation stays NaN through the ReLU -- plain, after an add, fused into batch-norm
// over planes and over rows of channels -- as PyTorch's relu keeps it: an f16 inf - inf then
// reaches the loss, and the loss scaler skips the step instead of training on a zero. -0 still
// gives +0, and the backward passes the gradient where the output is NaN, as PyTorch's does.
TEST_CASE("a NaN stays NaN through the ReLU: plain, after an add, fused into batch-norm") {
  sk::Context ctx;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> v{1.5f, -2.0f, nan, -0.0f, 0.25f, -nan};
  const auto check_relu = [&](const std::vector<float>& got, const std::vector<float>& in) {
    REQUIRE(got.size() == in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      CAPTURE(i);
      if (std::isnan(in[i])) {
        CHECK(std::isnan(got[i]));
      } else {
        CHECK(got[i] == (in[i] > 0 ? in[i] : 0.0f));
        CHECK_FALSE(std::signbit(got[i]));
      }
    }
  };
  // The backward passes the gradient where the output is NaN (PyTorch's threshold_backward:
  // zero where the output is <= 0).
  const auto check_grad = [&](const std::vector<float>& got, const std::vector<float>& in) {
    REQUIRE(got.size() == in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i] == (std::isnan(in[i]) || in[i] > 0 ? 1.0f : 0.0f));
    }
  };
  const sk::Tensor ones = sk::from_vector(ctx, std::vector<float>(6, 1.0f), {6});
  {
    const Variable x(sk::from_vector(ctx, v, {6}), true);
    const Variable y = ag::relu(ctx, x);
    check_relu(sk::to_vector<float>(ctx, y.data()), v);
    ag::backward(ctx, y, ones);
    check_grad(sk::to_vector<float>(ctx, x.grad()), v);
  }
  {
    const Variable x(sk::from_vector(ctx, v, {6}), true);
    const Variable zero(sk::from_vector(ctx, std::vector<float>(6, 0.0f), {6}));
    const Variable y = ag::add_relu(ctx, x, zero);
    check_relu(sk::to_vector<float>(ctx, y.data()), v);
    ag::backward(ctx, y, ones);
    check_grad(sk::to_vector<float>(ctx, x.grad()), v);
  }
  // Evaluation with statistics 0 and 1, weight 1, bias 0: y = x / sqrt(1 + eps), NaN where x is.
  for (const sk::Shape& shape : {sk::Shape{2, 3, 2, 2}, sk::Shape{8, 3}}) {
    CAPTURE(sk::shape_str(shape));
    std::vector<float> in(static_cast<std::size_t>(sk::shape_numel(shape)));
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = v[i % v.size()] * (1.0f + 0.1f * i);
    const Variable bx(sk::from_vector(ctx, in, shape));
    const Variable w(sk::from_vector(ctx, std::vector<float>(3, 1.0f), {3}));
    const Variable b(sk::from_vector(ctx, std::vector<float>(3, 0.0f), {3}));
    sk::Tensor mean = sk::from_vector(ctx, std::vector<float>(3, 0.0f), {3});
    sk::Tensor var = sk::from_vector(ctx, std::vector<float>(3, 1.0f), {3});
    ag::BatchNormOptions o;
    o.training = false;
    o.relu = true;
    o.eps = 0;
    check_relu(sk::to_vector<float>(ctx, ag::batch_norm(ctx, bx, w, b, mean, var, o).data()), in);
  }
}

// Max-pool runs one (n, c) plane per task: the same output, indices and input gradient on any
// thread count, and each output the largest input of its window (padding never chosen).
TEST_CASE("CPU max-pool gives the same bits on any thread count") {
  const sk::Shape shape{3, 5, 17, 13};
  struct PoolRun {
    std::vector<float> y, gx;
  };
  auto run = [&](int threads) {
    sk::Context ctx({.seed = 24, .cpu_threads = threads});
    sk::Tensor x = sk::empty(ctx, shape, sk::DType::f32);
    sk::uniform_(ctx, x, -2, 3);
    Variable in(x, true);
    Variable y = ag::max_pool2d(ctx, in, 3, 2, 1);
    sk::Tensor g = sk::empty(ctx, y.shape(), sk::DType::f32);
    sk::uniform_(ctx, g, -1, 1);
    ag::backward(ctx, y, g);
    PoolRun r{sk::to_vector<float>(ctx, y.data()), sk::to_vector<float>(ctx, in.grad())};
    if (threads == 1) {  // the window maxima, directly
      const auto xs = sk::to_vector<float>(ctx, x);
      const std::int64_t H = shape[2], W = shape[3], OH = y.size(2), OW = y.size(3);
      for (std::int64_t q = 0; q < shape[0] * shape[1]; ++q)
        for (std::int64_t oh = 0; oh < OH; ++oh)
          for (std::int64_t ow = 0; ow < OW; ++ow) {
            float best = -INFINITY;
            for (std::int64_t ih = std::max<std::int64_t>(2 * oh - 1, 0);
                 ih < std::min(2 * oh + 2, H); ++ih)
              for (std::int64_t iw = std::max<std::int64_t>(2 * ow - 1, 0);
                   iw < std::min(2 * ow + 2, W); ++iw)
                best = std::max(best, xs[static_cast<std::size_t>((q * H + ih) * W + iw)]);
            REQUIRE(r.y[static_cast<std::size_t>((q * OH + oh) * OW + ow)] == best);
          }
    }
    return r;
  };
  const PoolRun one = run(1);
  for (int threads : {2, 3, 5}) {
    CAPTURE(threads);
    const PoolRun other = run(threads);
    CHECK(other.y == one.y);
    CHECK(other.gx == one.gx);
  }
}

// PyTorch's rule: a window's output is its first maximum (which alone takes the gradient), and a
// NaN in the window wins over any number (the last NaN, when there are several).
TEST_CASE("CPU max-pool: the first of tied maxima takes the gradient, and a NaN wins") {
  sk::Context ctx({.seed = 25});
  const float nan = std::nanf(""), inf = INFINITY;
  // Four 2x2 windows of a 4x4 plane: ties at 1 and 4; NaNs at 3 and 7; all -inf; all equal.
  const std::vector<float> xs{1,    3,    5, nan,  //
                              3,    2,    7, nan,  //
                              -inf, -inf, 2, 2,    //
                              -inf, -inf, 2, 2};
  Variable in(sk::from_vector(ctx, xs, {1, 1, 4, 4}), true);
  Variable y = ag::max_pool2d(ctx, in, 2, 2, 0);
  ag::backward(ctx, y, sk::from_vector(ctx, std::vector<float>{10, 20, 30, 40}, {1, 1, 2, 2}));
  const auto ys = sk::to_vector<float>(ctx, y.data());
  CHECK(ys[0] == 3);
  CHECK(std::isnan(ys[1]));
  CHECK(ys[2] == -inf);
  CHECK(ys[3] == 2);
  std::vector<float> expected(16, 0.0f);
  expected[1] = 10;   // the first 3, not the one below it
  expected[7] = 20;   // the last NaN
  expected[8] = 30;   // the first of four -inf
  expected[10] = 40;  // the first of four 2s
  CHECK(sk::to_vector<float>(ctx, in.grad()) == expected);
}

// The 3 x 3 / 2 and 2 x 2 / 2 pools take the windows wholly inside the plane by a loop GCC
// vectorises across outputs: its maxima and indices must be the window-by-window loop's, with
// ties (ReLU's zeros) and NaNs, in f32 and f64, at sizes where the vector body runs.
TEST_CASE("CPU max-pool: the vectorised inside windows equal the window-by-window loop") {
  struct Pool {
    std::int64_t kernel, stride, pad;
  };
  for (const Pool pool : {Pool{3, 2, 1}, Pool{3, 2, 0}, Pool{2, 2, 0}, Pool{3, 1, 1}})
    for (const auto dtype : {sk::DType::f32, sk::DType::f64})
      for (const std::int64_t width : {57, 64}) {
        CAPTURE(pool.kernel);
        CAPTURE(pool.stride);
        CAPTURE(pool.pad);
        CAPTURE(sk::dtype_name(dtype));
        CAPTURE(width);
        sk::Context ctx({.seed = 26, .cpu_threads = 2});
        const std::int64_t planes = 3, H = 41, W = width;
        sk::Tensor x = sk::empty(ctx, {1, planes, H, W}, sk::DType::f64);
        sk::normal_(ctx, x, 0, 1);
        auto xs = sk::to_vector<double>(ctx, x);
        for (std::size_t i = 0; i < xs.size(); ++i) {
          xs[i] = std::max(xs[i], 0.0);                    // many tied zeros
          if (i % 97 == 5) xs[i] = std::nan("");           // NaNs, sometimes two in a window
          if (i % 89 == 3) xs[i] = std::round(xs[i] * 2);  // tied positive values
        }
        x = sk::cast(ctx, sk::from_vector(ctx, xs, {1, planes, H, W}), dtype);
        const ag::cpu::PoolGeometry g{pool.kernel, pool.kernel, pool.stride,
                                      pool.stride, pool.pad,    pool.pad};
        const std::int64_t OH = (H + 2 * pool.pad - pool.kernel) / pool.stride + 1;
        const std::int64_t OW = (W + 2 * pool.pad - pool.kernel) / pool.stride + 1;
        sk::Tensor y = sk::empty(ctx, {1, planes, OH, OW}, dtype);
        sk::Tensor argmax = sk::empty(ctx, {1, planes, OH, OW}, sk::DType::i64);
        ag::cpu::max_pool_forward(ctx.cpu_pool(), x, y, argmax, g);
        const auto got = sk::to_vector<double>(ctx, sk::cast(ctx, y, sk::DType::f64));
        const auto got_at = sk::to_vector<std::int64_t>(ctx, argmax);
        const auto values = sk::to_vector<double>(ctx, sk::cast(ctx, x, sk::DType::f64));
        for (std::int64_t q = 0; q < planes; ++q)
          for (std::int64_t oh = 0; oh < OH; ++oh)
            for (std::int64_t ow = 0; ow < OW; ++ow) {
              const std::int64_t top = oh * pool.stride - pool.pad,
                                 left = ow * pool.stride - pool.pad;
              double want = 0;
              std::int64_t want_at = 0;
              ag::cpu::detail::max_window(
                  values.data() + q * H * W, W, std::max<std::int64_t>(top, 0),
                  std::min(top + pool.kernel, H), std::max<std::int64_t>(left, 0),
                  std::min(left + pool.kernel, W), &want, &want_at);
              const auto o = static_cast<std::size_t>((q * OH + oh) * OW + ow);
              CHECK(got_at[o] == want_at);
              CHECK((std::isnan(want) ? std::isnan(got[o]) : got[o] == want));
            }
      }
}
