// The fused-op test cases as doctest cases over `Backend` (defined by the including file), so
// the CPU and the CUDA executables run the same list. Gap 0: aligned segments; gap 1: every
// segment at an unaligned offset inside its flat buffer.
#pragma once

#include "ops_case_bodies.hpp"
#include "quantize_cases.hpp"

namespace ops_test {

TEST_CASE("SGD without momentum, with weight decay and unscale, matches float64") {
  Backend b;
  const ops::SgdOptions o{.lr = 0.1f, .weight_decay = 0.01f, .inv_grad_scale = 0.125f};
  for (std::int64_t gap : {0, 1}) sgd_case(b, o, sk::DType::f32, gap);
}

TEST_CASE("SGD with momentum and dampening: first-step rule, then running buffer") {
  Backend b;
  const ops::SgdOptions o{.lr = 0.05f, .momentum = 0.9f, .dampening = 0.25f, .weight_decay = 1e-3f};
  for (std::int64_t gap : {0, 1, 3}) sgd_case(b, o, sk::DType::f32, gap);
}

TEST_CASE("SGD with nesterov and low-precision copies written in the same pass") {
  Backend b;
  const ops::SgdOptions o{.lr = 0.05f, .momentum = 0.8f, .nesterov = true, .inv_grad_scale = 2.0f};
  for (auto low : {sk::DType::f16, sk::DType::bf16})
    for (std::int64_t gap : {0, 1}) sgd_case(b, o, low, gap, 2);
}

TEST_CASE("mixed precision: SGD and Adam read f16/bf16 gradients, update the f32 master") {
  Backend b;
  const ops::SgdOptions o{
      .lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-3f, .inv_grad_scale = 0.25f};
  for (auto low : {sk::DType::f16, sk::DType::bf16})
    for (std::int64_t gap : {0, 1}) {
      CAPTURE(sk::dtype_name(low));
      sgd_case(b, o, low, gap, 3, /*low_grads=*/true);
      adam_case(b, /*adamw=*/true, low, gap, /*low_grads=*/true);
    }
  // Low-precision gradients without a copy of their dtype are refused by name.
  Flat<Backend> w(b, std::vector<float>(8, 1.0f), Layout({8}, 0));
  Flat<Backend> g(b, std::vector<float>(8, 1.0f), Layout({8}, 0), sk::DType::bf16);
  Flat<Backend> m(b, std::vector<float>(8, 0.0f), Layout({8}, 0));
  CHECK_THROWS_WITH(ops::sgd_step(b.ctx, o, {w.views, g.views, m.views, {}}),
                    doctest::Contains("gradients in bf16 go with low-precision copies of the same "
                                      "dtype"));
}

TEST_CASE("leaf sums of squares (split-invariant norms): every leaf, short last leaves") {
  Backend b;
  for (std::int64_t gap : {0, 1, 5}) leaf_sums_case(b, gap, Backend::leaf_tolerance);
}

TEST_CASE("rows divided by their norms from leaf sums: every cut alike, gated, float64") {
  Backend b;
  normalize_rows_case(b);
}

TEST_CASE("norm tree nodes over leaf sums equal norm_subtree bit for bit") {
  Backend b;
  norm_subtrees_case(b);
}

TEST_CASE("norm trees finished where the values lie equal norm_root bit for bit") {
  Backend b;
  norm_roots_case(b);
}

TEST_CASE("gradient clipping's total, norm and factor on the device: the host's bits") {
  Backend b;
  clip_case(b);
}

TEST_CASE("LARC-SGD, fused and composed, scale and clip modes, zero-norm tensors") {
  Backend b;
  for (bool clip : {false, true})
    for (bool composed : {false, true}) {
      const ops::LarcOptions larc{
          .trust_coefficient = clip ? 0.02f : 0.001f, .clip = clip, .weight_decay = 1e-4f};
      CAPTURE(clip);
      CAPTURE(composed);
      larc_case(b, larc, composed, composed ? 1 : 0);
    }
}

TEST_CASE("LARC-SGD keeping the params' squares: the same bits, recomputed when not theirs") {
  Backend b;
  // (params, grads, momentum, bf16 copies) gaps, -1: no copies. All aligned alike; unaligned
  // alike; params and grads aligned otherwise than each other; momentum or copies aligned
  // otherwise than the pair (on the GPU: the squares in a pass of their own).
  const std::int64_t gaps[][4] = {{0, 0, 0, -1}, {1, 1, 1, 1}, {0, 1, 0, -1},
                                  {0, 0, 1, -1}, {0, 0, 0, 1}, {1, 0, 2, 3}};
  for (const auto& gap : gaps) {
    CAPTURE(gap[0]);
    CAPTURE(gap[1]);
    CAPTURE(gap[2]);
    CAPTURE(gap[3]);
    larc_param_squares_case(b, gap[0], gap[1], gap[2], gap[3]);
  }
  // 130 tensors: more than one GPU launch's spans for the update (79) and the norms (123).
  std::vector<std::int64_t> many;
  for (int t = 0; t < 130; ++t) many.push_back(1 + (t * 37) % 300);
  larc_param_squares_case(b, 0, 0, 0, -1, many);
  larc_param_squares_case(b, 0, 0, 1, 0, many);
}

TEST_CASE("LARC-SGD over 300 small tensors: several launches per pass") {
  Backend b;
  std::vector<std::int64_t> sizes;
  std::mt19937 gen(5);
  for (int i = 0; i < 300; ++i) sizes.push_back(1 + static_cast<std::int64_t>(gen() % 400));
  const ops::LarcOptions larc{.weight_decay = 1e-3f};
  larc_case(b, larc, false, 1, sizes, 1.0f);
  larc_case(b, larc, true, 0, sizes, 1.0f);
}

TEST_CASE("segmented sums of squares are deterministic and exact to double rounding") {
  Backend b;
  for (std::int64_t gap : {0, 1}) sums_case(b, gap);
}

TEST_CASE("unscale + finite check: exact unscale, norms, inf and NaN raise the flag") {
  Backend b;
  for (std::int64_t gap : {0, 1}) unscale_case(b, gap);
}

TEST_CASE("casts f32 <-> f16/bf16 are bit-exact with the host conversions") {
  Backend b;
  for (std::int64_t gap : {0, 1}) cast_case(b, gap);
}

TEST_CASE("Adam and AdamW match float64, with and without low-precision copies") {
  Backend b;
  adam_case(b, false, sk::DType::f32, 0);
  adam_case(b, true, sk::DType::f32, 1);
  adam_case(b, false, sk::DType::bf16, 1);
  adam_case(b, true, sk::DType::f16, 0);
}

TEST_CASE("a gated SGD, Adam or LARC pass: the host-decided bits, nothing written when skipped") {
  Backend b;
  gated_step_case(b, GatedRule::sgd, sk::DType::f32, 1);
  gated_step_case(b, GatedRule::sgd, sk::DType::bf16, 0);
  gated_step_case(b, GatedRule::adam, sk::DType::f32, 0);
  gated_step_case(b, GatedRule::adam, sk::DType::f16, 1);
  gated_step_case(b, GatedRule::larc, sk::DType::f32, 0);
  gated_step_case(b, GatedRule::larc, sk::DType::f16, 1);
}

TEST_CASE("the loss scale state advances on the device by GradScaler's rules") {
  Backend b;
  loss_scale_case(b);
}

TEST_CASE("inf and NaN gradients propagate as in PyTorch/apex") {
  Backend b;
  nonfinite_case(b, false);
  nonfinite_case(b, true);
}

TEST_CASE("bad arguments throw InvalidArgument naming the problem") {
  Backend b;
  argument_errors_case(b);
}

}  // namespace ops_test
