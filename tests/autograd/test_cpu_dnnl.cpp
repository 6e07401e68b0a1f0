// The f32 CPU convolutions and GEMMs that run through oneDNN (autograd/cpu_dnnl.hpp) against
// the f64 Eigen path on the same random inputs, on 1, 2 and 3 threads; the same bits when run
// twice; and the reordered operands and scratchpad counted by the context's allocator.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "gradcheck.hpp"
#include "shardkit/autograd/autograd.hpp"
#include "shardkit/autograd/cpu_conv.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;

#if SK_WITH_DNNL

namespace {

struct Outputs {
  std::vector<double> y, gx, gw;
};

// conv2d forward and backward (gradient of sum(y * r) for a fixed random r) in `dtype`.
Outputs run_conv(sk::Context& ctx, const sk::Tensor& x64, const sk::Tensor& w64,
                 const sk::Tensor& r64, ag::Conv2dOptions o, sk::DType dtype) {
  Variable x(sk::cast(ctx, x64, dtype), true), w(sk::cast(ctx, w64, dtype), true);
  Variable y = ag::conv2d(ctx, x, w, Variable(), o);
  ag::backward(ctx, y, sk::cast(ctx, r64, dtype));
  auto as_f64 = [&](const sk::Tensor& t) {
    return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
  };
  return {as_f64(y.data()), as_f64(x.grad()), as_f64(w.grad())};
}

using ag::testing::scaled_error;

}  // namespace

TEST_CASE("oneDNN f32 convolutions equal the f64 reference on 1, 2 and 3 threads") {
  struct Case {
    sk::Shape x, w;
    ag::Conv2dOptions o;
  };
  const Case cases[] = {
      {{4, 16, 12, 12}, {32, 16, 3, 3}, ag::Conv2dOptions::make(1, 1)},  // a ResNet block's conv
      {{3, 8, 13, 11}, {16, 8, 3, 3}, ag::Conv2dOptions::make(2, 1)},    // strided, odd sizes
      {{2, 3, 20, 20}, {8, 3, 7, 7}, ag::Conv2dOptions::make(2, 3)},     // ImageNet stem shape
      {{4, 16, 8, 8}, {24, 16, 1, 1}, ag::Conv2dOptions::make(1, 0)},    // pointwise
      {{4, 16, 9, 9}, {32, 16, 1, 1}, ag::Conv2dOptions::make(2, 0)},    // strided downsample
      {{2, 4, 11, 11}, {6, 4, 3, 3}, ag::Conv2dOptions::make(1, 2, 2)},  // dilated
      {{2, 5, 9, 7}, {6, 5, 2, 3}, {2, 1, 0, 1, 1, 1}},                  // asymmetric
      {{4, 32, 10, 10}, {32, 4, 3, 3}, ag::Conv2dOptions::make(1, 1, 1, 8)},  // ResNeXt's 3 x 3
      {{2, 16, 9, 9}, {16, 1, 3, 3}, ag::Conv2dOptions::make(2, 1, 1, 16)},   // depthwise
  };
  for (int threads : {1, 2, 3}) {
    sk::Context ctx({.seed = 7, .cpu_threads = threads});
    for (const auto& c : cases) {
      CAPTURE(threads);
      CAPTURE(sk::shape_str(c.x));
      CAPTURE(sk::shape_str(c.w));
      sk::Tensor x = sk::empty(ctx, c.x, sk::DType::f64), w = sk::empty(ctx, c.w, sk::DType::f64);
      sk::uniform_(ctx, x, -1, 1);
      sk::uniform_(ctx, w, -1, 1);
      sk::Tensor r;
      {
        Variable probe = ag::conv2d(ctx, Variable(x), Variable(w), Variable(), c.o);
        r = sk::empty(ctx, probe.shape(), sk::DType::f64);
        sk::uniform_(ctx, r, -1, 1);
      }
      const Outputs reference = run_conv(ctx, x, w, r, c.o, sk::DType::f64);
      const Outputs ours = run_conv(ctx, x, w, r, c.o, sk::DType::f32);
      CHECK(scaled_error(ours.y, reference.y) < 2e-6);
      CHECK(scaled_error(ours.gx, reference.gx) < 2e-6);
      CHECK(scaled_error(ours.gw, reference.gw) < 2e-6);
      // Deterministic: the same shapes on the same threads give the same bits.
      const Outputs again = run_conv(ctx, x, w, r, c.o, sk::DType::f32);
      CHECK(again.y == ours.y);
      CHECK(again.gx == ours.gx);
      CHECK(again.gw == ours.gw);
    }
  }
}

TEST_CASE("oneDNN convolutions in bf16 (widened to f32) stay within bf16's rounding") {
  sk::Context ctx({.seed = 8});
  sk::Tensor x = sk::empty(ctx, {2, 8, 10, 10}, sk::DType::f64);
  sk::Tensor w = sk::empty(ctx, {8, 8, 3, 3}, sk::DType::f64);
  sk::Tensor r = sk::empty(ctx, {2, 8, 10, 10}, sk::DType::f64);
  for (auto* t : {&x, &w, &r}) sk::uniform_(ctx, *t, -1, 1);
  // The reference sees the same bf16-rounded inputs.
  auto round = [&](const sk::Tensor& t) {
    return sk::cast(ctx, sk::cast(ctx, t, sk::DType::bf16), sk::DType::f64);
  };
  const auto o = ag::Conv2dOptions::make(1, 1);
  const Outputs reference = run_conv(ctx, round(x), round(w), round(r), o, sk::DType::f64);
  const Outputs ours = run_conv(ctx, x, w, r, o, sk::DType::bf16);
  CHECK(scaled_error(ours.y, reference.y) < 1e-2);
  CHECK(scaled_error(ours.gx, reference.gx) < 1e-2);
  CHECK(scaled_error(ours.gw, reference.gw) < 1e-2);
}

TEST_CASE("oneDNN GEMMs (linear, matmul) equal the f64 reference in every transpose") {
  for (int threads : {1, 2}) {
    sk::Context ctx({.seed = 9, .cpu_threads = threads});
    sk::Tensor x = sk::empty(ctx, {37, 50}, sk::DType::f64),
               w = sk::empty(ctx, {23, 50}, sk::DType::f64);
    sk::Tensor r = sk::empty(ctx, {37, 23}, sk::DType::f64);
    for (auto* t : {&x, &w, &r}) sk::uniform_(ctx, *t, -1, 1);
    auto run = [&](sk::DType dtype) {
      Variable xv(sk::cast(ctx, x, dtype), true), wv(sk::cast(ctx, w, dtype), true);
      // linear: x w^T (B transposed); its backward: r w (plain) and r^T x (A transposed).
      Variable y = ag::linear(ctx, xv, wv);
      ag::backward(ctx, y, sk::cast(ctx, r, dtype));
      auto as_f64 = [&](const sk::Tensor& t) {
        return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
      };
      return Outputs{as_f64(y.data()), as_f64(xv.grad()), as_f64(wv.grad())};
    };
    const Outputs reference = run(sk::DType::f64), ours = run(sk::DType::f32);
    CAPTURE(threads);
    CHECK(scaled_error(ours.y, reference.y) < 2e-6);
    CHECK(scaled_error(ours.gx, reference.gx) < 2e-6);
    CHECK(scaled_error(ours.gw, reference.gw) < 2e-6);
  }
}

TEST_CASE("oneDNN's reordered operands and scratchpad are counted and freed after the call") {
  sk::Context ctx({.seed = 10, .cpu_threads = 1});
  sk::Tensor x = sk::empty(ctx, {8, 16, 16, 16}, sk::DType::f32);
  sk::Tensor w = sk::empty(ctx, {32, 16, 3, 3}, sk::DType::f32);
  sk::uniform_(ctx, x, -1, 1);
  sk::uniform_(ctx, w, -1, 1);
  auto& stats = ctx.memory_stats();
  const auto before = stats.snapshot().current_of(sk::MemoryCategory::activations);
  stats.reset_peak();
  Variable y = ag::conv2d(ctx, Variable(x), Variable(w), Variable(), ag::Conv2dOptions::make(1, 1));
  const auto after = stats.snapshot();
  const std::int64_t output_bytes = y.numel() * 4;
  // The output stays; the blocked copies of input, weights and output came and went.
  CHECK(after.current_of(sk::MemoryCategory::activations) - before == output_bytes);
  CHECK(after.peak_of(sk::MemoryCategory::activations) - before > output_bytes);
}

#else

TEST_CASE("oneDNN: not in this build (Eigen serves the CPU convolutions)") {
  MESSAGE("built without oneDNN: install libdnnl-dev and reconfigure to test the oneDNN path");
}

#endif

// With or without oneDNN, a GEMM or convolution of integer tensors is the caller's mistake, named
// as one (the Eigen path is compiled for f64 only where oneDNN takes f32: the refusal must not
// turn into an internal error there).
TEST_CASE("CPU GEMMs and convolutions of integer tensors are refused as invalid arguments") {
  sk::Context ctx({.seed = 11, .cpu_threads = 1});
  for (sk::DType dtype : {sk::DType::i32, sk::DType::i64}) {
    CAPTURE(sk::dtype_name(dtype));
    Variable a(sk::full(ctx, {3, 4}, dtype, 2)), b(sk::full(ctx, {4, 5}, dtype, 3));
    CHECK_THROWS_AS(ag::matmul(ctx, a, b), sk::InvalidArgument);
    Variable x(sk::full(ctx, {1, 2, 5, 5}, dtype, 2)), w(sk::full(ctx, {3, 2, 3, 3}, dtype, 3));
    CHECK_THROWS_AS(ag::conv2d(ctx, x, w, Variable(), ag::Conv2dOptions::make(1, 1)),
                    sk::InvalidArgument);
  }
}

// A build configured with cpu_f64_products=false (the README's main job) refuses an f64 GEMM or
// convolution by name, saying which option brings them back, and leaves the other dtypes' verdicts
// as they were (visit_eigen_real's F64 parameter reaches both choices in any build).
TEST_CASE("CPU f64 products left out of a build are refused with the option that restores them") {
  namespace cpu = shardkit::autograd::cpu;
  int reached = 0;
  auto count = [&](auto) { ++reached; };
  try {
    cpu::visit_eigen_real<false>(sk::DType::f64, "conv2d", count);
    FAIL("an f64 convolution without f64 products was not refused");
  } catch (const sk::NotAvailable& e) {
    const std::string what = e.what();
    CHECK(what.find("conv2d in f64 on the CPU") != std::string::npos);
    CHECK(what.find("-Dcpu_f64_products=true") != std::string::npos);
  }
  CHECK(reached == 0);
  cpu::visit_eigen_real<true>(sk::DType::f64, "gemm", count);
  CHECK(reached == 1);
  CHECK_THROWS_AS(cpu::visit_eigen_real<false>(sk::DType::i32, "gemm", count), sk::InvalidArgument);
  if (SK_WITH_DNNL) {  // oneDNN serves f32: the Eigen path refuses it as an internal error
    CHECK_THROWS_AS(cpu::visit_eigen_real<false>(sk::DType::f32, "gemm", count), sk::StateError);
    CHECK(reached == 1);
  } else {  // Eigen serves f32 too: leaving f64 out does not touch it
    cpu::visit_eigen_real<false>(sk::DType::f32, "gemm", count);
    CHECK(reached == 2);
  }
}
