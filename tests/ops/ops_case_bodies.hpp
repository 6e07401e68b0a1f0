// Bodies of the fused-op test cases, templated over the backend (see ops_cases.hpp).
#pragma once

#include <algorithm>
#include <optional>

#include "ops_cases.hpp"

namespace ops_test {

// SGD over flat-buffer segments for `steps` steps against the float64 reference; new random
// gradients each step, the first step writes a NaN-poisoned momentum buffer.
// f32 values rounded to `dtype` (f16 / bf16) and back: what a low-precision buffer holds.
inline std::vector<float> rounded_to(sk::DType dtype, std::vector<float> values) {
  for (auto& v : values)
    v = dtype == sk::DType::f16 ? sk::half_bits_to_float(sk::float_to_half_bits(v))
                                : sk::bf16_bits_to_float(sk::float_to_bf16_bits(v));
  return values;
}

// With `low_grads`, the gradients are stored in `low` too (mixed precision).
template <class B>
void sgd_case(B& b, ops::SgdOptions o, sk::DType low, std::int64_t gap, int steps = 3,
              bool low_grads = false) {
  const Layout layout(edge_sizes(), gap);
  const auto n = layout.total;
  auto w0 = random_values(n, 1.0, 2.0, 1);
  Flat<B> w(b, w0, layout), buf(b, kNaNs(static_cast<std::size_t>(n)), layout);
  SgdReference ref{widen(w0), std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  const std::vector<double> grad_coef(layout.count(), o.inv_grad_scale),
      param_coef(layout.count(), o.weight_decay);
  for (int step = 0; step < steps; ++step) {
    o.first_step = step == 0;
    auto g0 = random_values(n, 0.5, 1.5, 100 + static_cast<std::uint32_t>(step));
    if (low_grads) g0 = rounded_to(low, g0);
    Flat<B> g(b, g0, layout, low_grads ? low : sk::DType::f32);
    Flat<B> copy(b, kNaNs(static_cast<std::size_t>(n)), layout,
                 low == sk::DType::f32 ? sk::DType::f16 : low);
    ops::SgdTensors t{w.views, g.views, buf.views, {}};
    if (low != sk::DType::f32) t.low_copies = copy.views;
    ops::sgd_step(b.ctx, o, t);
    ref.step(widen(g0), o, layout, grad_coef, param_coef);
    const auto got_w = w.values(b);
    const double err = check_close(got_w, ref.w, layout, "param");
    if (o.momentum != 0) check_close(buf.values(b), ref.buf, layout, "momentum");
    if (low != sk::DType::f32) {
      // The copy holds exactly the rounded bits of the updated f32 parameter.
      const auto bits = copy.bits16(b);
      for (std::size_t tsr = 0; tsr < layout.count(); ++tsr)
        for (std::int64_t i = 0; i < layout.sizes[tsr]; ++i) {
          const auto at = static_cast<std::size_t>(layout.offsets[tsr] + i);
          const auto want = low == sk::DType::f16 ? sk::float_to_half_bits(got_w[at])
                                                  : sk::float_to_bf16_bits(got_w[at]);
          REQUIRE(bits[at] == want);
        }
    }
    MESSAGE("sgd step " << step << " worst relative error " << err);
  }
}

// LARC-SGD, both as the fused step and as norms -> coefficients -> SGD; includes a tensor of
// zero parameters and one of zero gradients (the zero-norm rule).
template <class B>
void larc_case(B& b, ops::LarcOptions larc, bool composed, std::int64_t gap,
               std::vector<std::int64_t> sizes = edge_sizes(), float inv_scale = 0.25f) {
  sizes.push_back(77);  // zero parameters
  sizes.push_back(78);  // zero gradients
  const Layout layout(sizes, gap);
  const auto n = layout.total;
  const std::size_t zero_w = layout.count() - 2, zero_g = layout.count() - 1;
  auto w0 = random_values(n, 1.0, 2.0, 7);
  for (std::int64_t i = 0; i < layout.sizes[zero_w]; ++i)
    w0[static_cast<std::size_t>(layout.offsets[zero_w] + i)] = 0.0f;
  Flat<B> w(b, w0, layout), buf(b, kNaNs(static_cast<std::size_t>(n)), layout);
  SgdReference ref{widen(w0), std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  ops::SgdOptions o;
  o.lr = 0.5f;
  o.momentum = 0.9f;
  o.dampening = 0.1f;
  o.inv_grad_scale = inv_scale;
  for (int step = 0; step < 3; ++step) {
    o.first_step = step == 0;
    auto g0 = random_values(n, 0.5, 1.5, 200 + static_cast<std::uint32_t>(step));
    for (std::int64_t i = 0; i < layout.sizes[zero_g]; ++i)
      g0[static_cast<std::size_t>(layout.offsets[zero_g] + i)] = 0.0f;
    Flat<B> g(b, g0, layout);
    const ops::SgdTensors t{w.views, g.views, buf.views, {}};
    // Reference coefficients from the exact sums of the current values.
    std::vector<double> wsq, gsq, grad_coef(layout.count()), param_coef(layout.count());
    sums_reference(w.values(b), layout, wsq);
    sums_reference(g0, layout, gsq);
    for (std::size_t i = 0; i < layout.count(); ++i)
      larc_reference(wsq[i], gsq[i], larc, o.lr, inv_scale, grad_coef[i], param_coef[i]);
    if (step == 0) {  // later steps have moved the zero parameters off zero
      CHECK(grad_coef[zero_w] == inv_scale);
      CHECK(param_coef[zero_w] == 0.0);
    }
    CHECK(grad_coef[zero_g] == inv_scale);
    CHECK(param_coef[zero_g] == 0.0);
    if (composed) {
      const auto count = static_cast<std::int64_t>(layout.count());
      auto sums = b.zeros({2, count}, sk::DType::f64);
      auto coefficients = b.zeros({count, 2}, sk::DType::f32);
      ops::segment_sums_of_squares(b.ctx, w.views, g.views, sums);
      ops::larc_coefficients(b.ctx, larc, o.lr, inv_scale, sums, coefficients);
      ops::SgdOptions plain = o;
      plain.inv_grad_scale = 1.0f;
      ops::sgd_step(b.ctx, plain, t, coefficients);
    } else {
      ops::larc_sgd_step(b.ctx, o, larc, t);
    }
    ref.step(widen(g0), o, layout, grad_coef, param_coef);
    const double err = check_close(w.values(b), ref.w, layout, "param");
    check_close(buf.values(b), ref.buf, layout, "momentum");
    MESSAGE("larc step " << step << " worst relative error " << err);
  }
}

// larc_sgd_step with LarcParamSquares kept between steps: the same bits as without, for the
// same tensors, and kept sums equal to a fresh norms pass's bit for bit; recomputed for other
// tensors and after forget(); and a write the step cannot see, left unforgotten, changes the
// next step (so the kept sums are what the step uses). The params, grads, momentum buffers and
// bf16 copies (none when low_gap < 0) lie at their own offsets (`*_gap` elements before each
// segment). On the GPU the update squares the params it writes where it walks them as the
// (param, grad) pass does -- both aligned alike, or both unaligned with each other (then every
// pass walks them scalar) --, and a momentum or copy list aligned otherwise than the pair sends
// the squares to a pass of their own. `sizes`: the tensors (more than a GPU launch holds: the
// sums continue across launches).
template <class B>
void larc_param_squares_case(B& b, std::int64_t param_gap, std::int64_t grad_gap,
                             std::int64_t buf_gap, std::int64_t low_gap,
                             const std::vector<std::int64_t>& sizes = edge_sizes()) {
  const Layout layout(sizes, param_gap), grad_layout(sizes, grad_gap), buf_layout(sizes, buf_gap),
      low_layout(sizes, std::max<std::int64_t>(low_gap, 0));
  const auto w0 = random_values(layout.total, -2.0, 2.0, 41);
  const auto buf0 = random_values(buf_layout.total, -0.1, 0.1, 42);
  const auto low0 = random_values(low_layout.total, -1.0, 1.0, 43);
  // a: no sums kept; c, d: sums kept (d will be left stale).
  Flat<B> wa(b, w0, layout), wc(b, w0, layout), wd(b, w0, layout);
  Flat<B> ma(b, buf0, buf_layout), mc(b, buf0, buf_layout), md(b, buf0, buf_layout);
  Flat<B> la(b, low0, low_layout, sk::DType::bf16), lc(b, low0, low_layout, sk::DType::bf16),
      ld(b, low0, low_layout, sk::DType::bf16);
  const auto copies = [&](const Flat<B>& l) {
    return low_gap < 0 ? std::vector<sk::Tensor>{} : l.views;
  };
  ops::LarcParamSquares squares_c, squares_d;
  ops::LarcOptions larc;
  larc.weight_decay = 1e-4f;
  larc.trust_coefficient = 0.02f;
  ops::SgdOptions o;
  o.lr = 0.5f;
  o.momentum = 0.9f;
  o.first_step = false;
  o.inv_grad_scale = 0.5f;
  auto same_bits = [&](const Flat<B>& x, const Flat<B>& y) {
    const auto u = x.values(b), v = y.values(b);
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
  };
  std::optional<Flat<B>> last_grads;
  auto step = [&](std::uint32_t seed, bool forget_c) {
    last_grads.emplace(b, random_values(grad_layout.total, -1.0, 1.0, seed), grad_layout);
    const auto& g = last_grads->views;
    if (forget_c) squares_c.forget();
    ops::larc_sgd_step(b.ctx, o, larc, {wa.views, g, ma.views, copies(la)});
    ops::larc_sgd_step(b.ctx, o, larc, {wc.views, g, mc.views, copies(lc)}, &squares_c);
    ops::larc_sgd_step(b.ctx, o, larc, {wd.views, g, md.views, copies(ld)}, &squares_d);
  };
  for (std::uint32_t s = 0; s < 3; ++s) {
    CAPTURE(s);
    step(300 + s, false);
    REQUIRE(squares_c.holds());
    REQUIRE(same_bits(wa, wc));
    REQUIRE(same_bits(ma, mc));
    REQUIRE(same_bits(wa, wd));
    if (low_gap >= 0) {
      // Every copy holds the rounded bits of its updated parameter, and the gaps between the
      // copies keep theirs.
      const auto w = wa.values(b);
      const auto bits = la.bits16(b);
      std::vector<bool> in_tensor(bits.size(), false);
      for (std::size_t t = 0; t < layout.count(); ++t)
        for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
          const auto at = static_cast<std::size_t>(low_layout.offsets[t] + i);
          in_tensor[at] = true;
          REQUIRE(bits[at] ==
                  sk::float_to_bf16_bits(w[static_cast<std::size_t>(layout.offsets[t] + i)]));
        }
      for (std::size_t at = 0; at < bits.size(); ++at)
        if (!in_tensor[at]) REQUIRE(bits[at] == sk::float_to_bf16_bits(low0[at]));
      REQUIRE(lc.bits16(b) == bits);
      REQUIRE(ld.bits16(b) == bits);
    }
  }
  // The kept sums are the norms pass's sums of the params now, bit for bit -- a check the
  // params' bits alone could miss: a sum a few ulps off seldom moves an f32 trust ratio.
  const auto count = static_cast<std::int64_t>(layout.count());
  REQUIRE(squares_c.sums().numel() == count);
  sk::Context host;
  const auto kept = sk::to_vector<double>(host, b.download(squares_c.sums()));
  if (b.ctx.device().is_cpu()) {
    auto fresh = b.zeros({1, count}, sk::DType::f64);
    ops::segment_sums_of_squares(b.ctx, wc.views, std::span<const sk::Tensor>{}, fresh);
    const auto pass = sk::to_vector<double>(host, b.download(fresh));
    CHECK(std::memcmp(kept.data(), pass.data(), static_cast<std::size_t>(count) * 8) == 0);
  } else {  // in reverse span order, summed as the (param, grad) pair is walked
    auto fresh = b.zeros({2, count}, sk::DType::f64);
    ops::segment_sums_of_squares(b.ctx, wc.views, last_grads->views, fresh);
    const auto pass = sk::to_vector<double>(host, b.download(fresh));
    for (std::int64_t t = 0; t < count; ++t) {
      CAPTURE(t);
      CHECK(std::memcmp(&kept[static_cast<std::size_t>(count - 1 - t)],
                        &pass[static_cast<std::size_t>(t)], sizeof(double)) == 0);
    }
  }
  // A write of the caller's own to every param (a plain SGD step on other grads): forgotten for
  // c, not for d.
  {
    Flat<B> g(b, random_values(grad_layout.total, -1.0, 1.0, 350), grad_layout);
    ops::SgdOptions own;
    own.lr = 0.25f;
    for (auto* w : {&wa, &wc, &wd}) ops::sgd_step(b.ctx, own, {w->views, g.views, {}, {}});
  }
  step(351, true);
  CHECK(same_bits(wa, wc));
  CHECK(same_bits(ma, mc));
  CHECK_FALSE(same_bits(wa, wd));  // d's stale sums went into its trust ratios
  // Sums kept for other tensors are not used: c's sums passed with a's params.
  {
    Flat<B> g(b, random_values(grad_layout.total, -1.0, 1.0, 352), grad_layout);
    ops::larc_sgd_step(b.ctx, o, larc, {wa.views, g.views, ma.views, copies(la)}, &squares_c);
    ops::larc_sgd_step(b.ctx, o, larc, {wc.views, g.views, mc.views, copies(lc)});
    CHECK(same_bits(wa, wc));
    CHECK(same_bits(ma, mc));
  }
}

template <class B>
void sums_case(B& b, std::int64_t gap) {
  const Layout layout(edge_sizes(), gap);
  const auto x0 = random_values(layout.total, 0.5, 1.5, 31);
  const auto y0 = random_values(layout.total, 0.5, 1.5, 32);
  Flat<B> x(b, x0, layout), y(b, y0, layout);
  const auto count = static_cast<std::int64_t>(layout.count());
  auto one = b.zeros({1, count}, sk::DType::f64), two = b.zeros({2, count}, sk::DType::f64),
       again = b.zeros({2, count}, sk::DType::f64);
  b.fill(one, -1.0);
  b.fill(two, -1.0);
  ops::segment_sums_of_squares(b.ctx, x.views, std::span<const sk::Tensor>{}, one);
  ops::segment_sums_of_squares(b.ctx, x.views, y.views, two);
  ops::segment_sums_of_squares(b.ctx, x.views, y.views, again);
  sk::Context host;
  const auto s1 = sk::to_vector<double>(host, b.download(one));
  const auto s2 = sk::to_vector<double>(host, b.download(two));
  const auto s3 = sk::to_vector<double>(host, b.download(again));
  CHECK(std::memcmp(s2.data(), s3.data(), s2.size() * sizeof(double)) == 0);  // run to run
  std::vector<double> rx, ry;
  sums_reference(x0, layout, rx);
  sums_reference(y0, layout, ry);
  for (std::size_t t = 0; t < layout.count(); ++t) {
    CHECK(s1[t] == s2[t]);  // same order whether one or two lists are summed
    CHECK(rel_error(s2[t], rx[t]) <= 1e-13);
    CHECK(rel_error(s2[layout.count() + t], ry[t]) <= 1e-13);
  }
}

// Leaf sums (norm_tree.hpp) of every segment, leaf after leaf, against the host function
// (bitwise, on either device: Backend::leaf_tolerance) and against float64.
template <class B>
void leaf_sums_case(B& b, std::int64_t gap, double tolerance) {
  const Layout layout(edge_sizes(), gap);
  const auto x0 = random_values(layout.total, 0.25, 1.5, 33);
  Flat<B> x(b, x0, layout);
  std::int64_t total = 0;
  for (std::size_t t = 0; t < layout.count(); ++t) total += ops::norm_leaves(layout.sizes[t]);
  auto leaves = b.zeros({total}, sk::DType::f64);
  b.fill(leaves, -1.0);
  ops::leaf_sums_of_squares(b.ctx, x.views, leaves);
  sk::Context host;
  const auto got = sk::to_vector<double>(host, b.download(leaves));
  std::size_t at = 0;
  for (std::size_t t = 0; t < layout.count(); ++t) {
    const float* values = x0.data() + layout.offsets[t];
    for (std::int64_t lo = 0; lo < layout.sizes[t]; lo += ops::kNormLeaf, ++at) {
      const auto count = static_cast<int>(std::min(ops::kNormLeaf, layout.sizes[t] - lo));
      const double expected = ops::leaf_sum_of_squares(values + lo, count);
      double exact = 0;
      for (int i = 0; i < count; ++i) exact += static_cast<double>(values[lo + i]) * values[lo + i];
      CHECK(rel_error(got[at], expected) <= tolerance);
      CHECK(rel_error(got[at], exact) <= 4e-15);
    }
  }
  CHECK(at == got.size());
  // Two lists in one pass (params and grads): row 0 is x's leaves as above, bit for bit, and
  // row 1 another list's, as its own pass gives them.
  const auto y0 = random_values(layout.total, 0.5, 2.0, 34);
  Flat<B> y(b, y0, layout);
  auto y_leaves = b.zeros({total}, sk::DType::f64);
  ops::leaf_sums_of_squares(b.ctx, y.views, y_leaves);
  auto pair = b.zeros({2, total}, sk::DType::f64);
  b.fill(pair, -1.0);
  ops::leaf_sums_of_squares(b.ctx, x.views, y.views, pair);
  const auto both = sk::to_vector<double>(host, b.download(pair));
  const auto got_y = sk::to_vector<double>(host, b.download(y_leaves));
  CHECK(std::memcmp(both.data(), got.data(), got.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(both.data() + total, got_y.data(), got_y.size() * sizeof(double)) == 0);
  // The gradients' 16-bit dtypes (the host function over their values widened), each also over
  // a list of 203 tensors: more spans than one GPU launch's table holds (160), so the leaves
  // continue across launches.
  std::vector<std::int64_t> many;
  for (int t = 0; t < 203; ++t) many.push_back(1 + (t * 37) % 300);
  const Layout many_layout(many, gap);
  for (const sk::DType dtype : {sk::DType::bf16, sk::DType::f16, sk::DType::f32})
    for (const Layout* list : {&layout, &many_layout}) {
      const Layout& l = *list;
      CAPTURE(sk::dtype_name(dtype));
      CAPTURE(l.count());
      const Flat<B> z(b, random_values(l.total, 0.25, 1.5, 35), l, dtype);
      const auto z0 = z.values(b);  // (the values as stored, widened exactly)
      std::int64_t count = 0;
      for (auto size : l.sizes) count += ops::norm_leaves(size);
      auto z_leaves = b.zeros({count}, sk::DType::f64);
      b.fill(z_leaves, -1.0);
      ops::leaf_sums_of_squares(b.ctx, z.views, z_leaves);
      const auto z_got = sk::to_vector<double>(host, b.download(z_leaves));
      std::size_t k = 0;
      for (std::size_t t = 0; t < l.count(); ++t)
        for (std::int64_t lo = 0; lo < l.sizes[t]; lo += ops::kNormLeaf, ++k) {
          const auto n = static_cast<int>(std::min(ops::kNormLeaf, l.sizes[t] - lo));
          CHECK(rel_error(z_got[k], ops::leaf_sum_of_squares(z0.data() + l.offsets[t] + lo, n)) <=
                tolerance);
        }
      CHECK(k == z_got.size());
    }
}

// normalize_rows_by_leaves (SwAV's prototypes after a step): a [7, 48] parameter's pieces, cut
// on leaf boundaries inside rows as shards are, divided by their rows' norms from the whole
// parameter's leaf sums -- the same bits for every cut, within one f32 rounding of float64;
// nothing written when the step gate says skip; bad arguments refused by name.
template <class B>
void normalize_rows_case(B& b) {
  const std::int64_t rows = 7, cols = 48, n = rows * cols;
  const auto x0 = random_values(n, -1.0, 1.0, 61);
  sk::Context host;
  auto run = [&](const std::vector<std::int64_t>& cuts, const sk::Tensor& gate) {
    const auto leaves = b.zeros({n / ops::kNormLeaf}, sk::DType::f64);
    std::vector<sk::Tensor> pieces;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      pieces.push_back(b.upload(
          sk::from_vector(host, std::vector<float>(x0.begin() + cuts[i], x0.begin() + cuts[i + 1]),
                          {cuts[i + 1] - cuts[i]})));
      const std::int64_t first = cuts[i] / ops::kNormLeaf;
      ops::leaf_sums_of_squares(
          b.ctx, std::span<const sk::Tensor>(&pieces.back(), 1),
          leaves.slice(0, first, first + ops::norm_leaves(pieces.back().numel())));
    }
    std::vector<float> out;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      ops::normalize_rows_by_leaves(b.ctx, pieces[i], cuts[i], cols, leaves, 1e-12, gate);
      const auto v = sk::to_vector<float>(host, b.download(pieces[i]));
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  const auto whole = run({0, n}, sk::Tensor());
  CHECK(run({0, 16, 80, 96, 208, n}, sk::Tensor()) == whole);
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (std::int64_t c = 0; c < cols; ++c) sum += double(x0[r * cols + c]) * x0[r * cols + c];
    for (std::int64_t c = 0; c < cols; ++c)
      CHECK(rel_error(whole[r * cols + c], x0[r * cols + c] / std::sqrt(sum)) <= 1e-7);
  }
  auto gate_of = [&](float skip) {
    return b.upload(sk::from_vector(host, std::vector<float>{1.0f, skip, 3.0f, 0.1f}, {4}));
  };
  CHECK(run({0, 96, n}, gate_of(1.0f)) == x0);  // a skipped step: untouched
  CHECK(run({0, 96, n}, gate_of(0.0f)) == whole);
  const auto piece = b.upload(sk::from_vector(host, x0, {n}));
  const auto leaves = b.zeros({n / ops::kNormLeaf}, sk::DType::f64);
  CHECK_THROWS_WITH(ops::normalize_rows_by_leaves(b.ctx, piece, 0, 40, leaves, 1e-12),
                    doctest::Contains("rows of 40 columns"));
  CHECK_THROWS_WITH(
      ops::normalize_rows_by_leaves(b.ctx, piece, 0, cols, leaves.slice(0, 0, 20), 1e-12),
      doctest::Contains("do not cover the rows"));
}

// Tree nodes over leaf sums (norm_subtree_sums) against the host's norm_subtree, bit for bit:
// both add the same pairs in the same order. Values of widely spread magnitudes, so any other
// order of the additions would round differently (checked: a left-to-right sum does); nodes of
// every level up to 2^16 values, at offsets that are not multiples of their size; a 2-D buffer
// read flat.
template <class B>
void norm_subtrees_case(B& b) {
  constexpr std::int64_t kRows = 2, kCols = 70001;
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> mantissa(0.5, 1.5);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<double> values(static_cast<std::size_t>(kRows * kCols));
  for (auto& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
  sk::Context host;
  auto leaves = b.upload(sk::from_vector(host, values, {kRows, kCols}));
  std::vector<ops::NormSubtree> nodes;
  for (int level = 0; level <= 16; ++level) {
    const std::int64_t size = std::int64_t{1} << level;
    std::uniform_int_distribution<std::int64_t> first(0, kRows * kCols - size);
    nodes.push_back({first(rng), level});
    nodes.push_back({first(rng), level});
  }
  nodes.push_back({kRows * kCols - 1, 0});      // the last value alone
  nodes.push_back({kRows * kCols - 1024, 10});  // the last 1024
  auto out = b.zeros({static_cast<std::int64_t>(nodes.size())}, sk::DType::f64);
  b.fill(out, -1.0);
  ops::norm_subtree_sums(b.ctx, leaves, nodes, out);
  const auto got = sk::to_vector<double>(host, b.download(out));
  std::vector<double> scratch;
  bool order_matters = false;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    CAPTURE(nodes[i].first);
    CAPTURE(nodes[i].level);
    const double* x = values.data() + nodes[i].first;
    const std::int64_t size = std::int64_t{1} << nodes[i].level;
    const double want = ops::norm_subtree(x, size, scratch);
    CHECK(std::memcmp(&got[i], &want, sizeof want) == 0);
    double in_order = 0;
    for (std::int64_t j = 0; j < size; ++j) in_order += x[j];
    order_matters = order_matters || in_order != want;
  }
  CHECK(order_matters);
  // A node past the end is refused by name; no nodes is nothing to do.
  const std::vector<ops::NormSubtree> past{{kRows * kCols - 2, 2}};
  auto one = b.zeros({1}, sk::DType::f64);
  CHECK_THROWS_WITH(ops::norm_subtree_sums(b.ctx, leaves, past, one),
                    doctest::Contains("node 0 (first 140000, level 2) reaches past the 140002"));
  ops::norm_subtree_sums(b.ctx, leaves, {}, b.zeros({0}, sk::DType::f64));
}

// Trees finished where their cover values lie (norm_roots over a NormRootPlan) against the
// host's norm_root, bit for bit: tensors of 1 to 5000 leaves cut at random into 1 to 6
// pieces, the pieces' cover values stored in a shuffled order, leaf values of widely spread
// magnitudes (so another order of the additions rounds differently: checked); a tensor no
// piece reported and one of no leaves give 0; a leaf no piece covers is refused by name when
// the plan is written.
template <class B>
void norm_roots_case(B& b) {
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<double> mantissa(0.5, 1.5);
  std::uniform_int_distribution<int> exponent(-30, 30);
  struct Root {
    std::int64_t leaves;
    std::map<ops::NormNode, double> known;
  };
  std::vector<Root> roots;
  std::vector<double> scratch;
  for (std::int64_t leaves : {1, 2, 3, 7, 16, 17, 100, 1023, 1024, 1025, 4999, 5000}) {
    std::vector<double> leaf(static_cast<std::size_t>(leaves));
    for (auto& v : leaf) v = std::ldexp(mantissa(rng), exponent(rng));
    std::uniform_int_distribution<int> piece_count(1, 6);
    std::vector<std::int64_t> cuts{0, leaves};
    for (int c = 1; c < piece_count(rng); ++c)
      cuts.push_back(std::uniform_int_distribution<std::int64_t>(0, leaves)(rng));
    std::sort(cuts.begin(), cuts.end());
    Root root{leaves, {}};
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c)
      for (const auto& node : ops::norm_cover(cuts[c], cuts[c + 1]))
        root.known[node] = ops::norm_subtree(leaf.data() + (node.index << node.level),
                                             std::int64_t{1} << node.level, scratch);
    roots.push_back(std::move(root));
  }
  roots.push_back({12, {}});  // no piece reported
  roots.push_back({0, {}});   // no leaves
  // The values in a shuffled order; the plan indexes them.
  std::vector<std::pair<std::size_t, ops::NormNode>> slots;
  for (std::size_t r = 0; r < roots.size(); ++r)
    for (const auto& entry : roots[r].known) slots.push_back({r, entry.first});
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<double> values;
  std::vector<std::map<ops::NormNode, std::int64_t>> index(roots.size());
  for (const auto& [r, node] : slots) {
    index[r][node] = static_cast<std::int64_t>(values.size());
    values.push_back(roots[r].known.at(node));
  }
  ops::NormRootPlan plan;
  for (std::size_t r = 0; r < roots.size(); ++r) plan.add_root(roots[r].leaves, index[r]);
  plan.upload(b.ctx);
  sk::Context host;
  auto on_device =
      b.upload(sk::from_vector(host, values, {static_cast<std::int64_t>(values.size())}));
  auto out = b.zeros({static_cast<std::int64_t>(roots.size())}, sk::DType::f64);
  b.fill(out, -1.0);
  ops::norm_roots(b.ctx, on_device, plan, out);
  const auto got = sk::to_vector<double>(host, b.download(out));
  bool order_matters = false;
  for (std::size_t r = 0; r < roots.size(); ++r) {
    CAPTURE(roots[r].leaves);
    // (norm_root refuses an empty cover; the plan's empty program is 0, as ParamNorms' sums.)
    const double want =
        roots[r].known.empty() ? 0.0 : ops::norm_root(roots[r].leaves, roots[r].known);
    CHECK(std::memcmp(&got[r], &want, sizeof want) == 0);
    double in_order = 0;
    for (const auto& entry : roots[r].known) in_order += entry.second;
    order_matters = order_matters || in_order != want;
  }
  CHECK(got[roots.size() - 2] == 0.0);
  CHECK(got[roots.size() - 1] == 0.0);
  CHECK(order_matters);
  // A leaf covered by no piece; a plan not on this device; too few values.
  ops::NormRootPlan holes;
  CHECK_THROWS_WITH(holes.add_root(8, {{{2, 0}, 0}}),
                    doctest::Contains("leaf 4 of 8 is covered by no piece"));
  ops::NormRootPlan not_uploaded;
  not_uploaded.add_root(1, {{{0, 0}, 0}});
  CHECK_THROWS_WITH(ops::norm_roots(b.ctx, on_device, not_uploaded, out),
                    doctest::Contains("the plan must be uploaded"));
  CHECK_THROWS_WITH(ops::norm_roots(b.ctx, on_device.slice(0, 0, 3), plan, out),
                    doctest::Contains("values must be a contiguous f64 tensor of at least"));
}

// Gradient clipping on the device: NormRootPlan::add_sum adds finished sums in a host loop's
// order (widely spread magnitudes, so another order rounds differently: checked), and
// clip_norm_and_factor gives clip.hpp's norm and multiplies a factor by its coefficient, bit for
// bit; a norm under max_norm leaves the factor alone; a NaN total gives a NaN factor.
template <class B>
void clip_case(B& b) {
  std::mt19937_64 rng(91);
  std::uniform_real_distribution<double> mantissa(0.5, 1.5);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<double> sums(9);
  for (auto& v : sums) v = std::ldexp(mantissa(rng), exponent(rng));
  const std::vector<std::int64_t> order{4, 0, 8, 2, 7, 1, 6, 3, 5};
  ops::NormRootPlan plan;
  plan.add_sum(order);
  plan.add_sum({});
  plan.upload(b.ctx);
  sk::Context host;
  auto values = b.upload(sk::from_vector(host, sums, {9}));
  auto totals = b.zeros({2}, sk::DType::f64);
  ops::norm_roots(b.ctx, values, plan, totals);
  const auto got = sk::to_vector<double>(host, b.download(totals));
  double want = 0, forward = 0;
  for (auto k : order) want += sums[static_cast<std::size_t>(k)];
  for (double v : sums) forward += v;
  CHECK(std::memcmp(&got[0], &want, sizeof want) == 0);
  CHECK(forward != want);
  CHECK(got[1] == 0.0);
  const auto total = totals.slice(0, 0, 1);
  for (float inv : {1.0f, 1.0f / 1024.0f}) {
    for (double max_norm : {1e-9, 1e9}) {
      CAPTURE(inv);
      CAPTURE(max_norm);
      auto norm = b.zeros({1}, sk::DType::f64);
      auto factor = b.zeros({1}, sk::DType::f32);
      b.fill(factor, 0.75);
      ops::clip_norm_and_factor(b.ctx, total, max_norm, inv, norm, factor);
      const ops::ClipResult r = ops::clip_result(want, max_norm, inv);
      const double got_norm = sk::to_vector<double>(host, b.download(norm))[0];
      CHECK(std::memcmp(&got_norm, &r.norm, sizeof r.norm) == 0);
      CHECK(sk::to_vector<float>(host, b.download(factor))[0] == 0.75f * r.coefficient);
      CHECK((max_norm > 1 ? r.coefficient == 1.0f : r.coefficient < 1e-6f));
    }
  }
  auto nan_total = b.upload(sk::from_vector(host, std::vector<double>{NAN}, {1}));
  auto factor = b.zeros({1}, sk::DType::f32);
  b.fill(factor, 1.0);
  ops::clip_norm_and_factor(b.ctx, nan_total, 1.0, 1.0f, sk::Tensor(), factor);
  CHECK(std::isnan(sk::to_vector<float>(host, b.download(factor))[0]));
  CHECK_THROWS_WITH(ops::clip_norm_and_factor(b.ctx, total, 0.0, 1.0f, sk::Tensor(), factor),
                    doctest::Contains("max_norm must be > 0"));
}

template <class B>
void unscale_case(B& b, std::int64_t gap) {
  const Layout layout(edge_sizes(), gap);
  const float inv = 1.0f / 1024.0f;
  const auto g0 = random_values(layout.total, 0.5, 1.5, 41);
  const auto count = static_cast<std::int64_t>(layout.count());
  {
    Flat<B> g(b, g0, layout);
    auto found = b.zeros({1}, sk::DType::f32);
    auto sums = b.zeros({1, count}, sk::DType::f64);
    ops::unscale_and_check(b.ctx, inv, g.views, found, sums);
    sk::Context host;
    CHECK(sk::to_vector<float>(host, b.download(found))[0] == 0.0f);
    const auto got = g.values(b);
    std::vector<float> unscaled(g0.size());
    for (std::size_t i = 0; i < g0.size(); ++i) unscaled[i] = g0[i] * inv;
    for (std::size_t t = 0; t < layout.count(); ++t)
      for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
        const auto at = static_cast<std::size_t>(layout.offsets[t] + i);
        REQUIRE(got[at] == unscaled[at]);  // one f32 multiply, exactly as the reference
      }
    std::vector<double> want;
    sums_reference(unscaled, layout, want);
    const auto s = sk::to_vector<double>(host, b.download(sums));
    for (std::size_t t = 0; t < layout.count(); ++t) CHECK(rel_error(s[t], want[t]) <= 1e-13);
  }
  for (float bad : {INFINITY, -INFINITY, NAN, 3e38f}) {  // 3e38 / 1024 is finite: no flag
    auto poisoned = g0;
    poisoned[static_cast<std::size_t>(layout.offsets[10] + 5)] = bad;
    Flat<B> g(b, poisoned, layout);
    auto found = b.zeros({1}, sk::DType::f32);
    ops::unscale_and_check(b.ctx, inv, g.views, found);
    sk::Context host;
    CHECK(sk::to_vector<float>(host, b.download(found))[0] == (std::isfinite(bad) ? 0.0f : 1.0f));
  }
  // 16-bit gradients under a loss scale backed off below 1 (GradScaler has no floor): unscaling
  // multiplies, and a value finite in f32 can store as inf (f16 past 65504, bf16 past ~3.39e38).
  // The flag rises; without such a value it stays down and the sums are of the stored values.
  for (auto dtype : {sk::DType::f16, sk::DType::bf16}) {
    const std::string name(sk::dtype_name(dtype));
    CAPTURE(name);
    // f16: 40000 x 2 = 80000; bf16: its largest value below 2^127 x 2.005 = 3.398e38, over bf16's
    // largest finite value by more than half its last place, under f32's.
    const bool f16 = dtype == sk::DType::f16;
    const float big = f16 ? 40000.0f : 0x1.fep126f, inv_up = f16 ? 2.0f : 2.005f;
    for (bool overflow : {false, true}) {
      auto values = g0;
      if (overflow) values[static_cast<std::size_t>(layout.offsets[10] + 5)] = big;
      Flat<B> g(b, values, layout, dtype);
      auto found = b.zeros({1}, sk::DType::f32);
      auto sums = b.zeros({1, count}, sk::DType::f64);
      ops::unscale_and_check(b.ctx, inv_up, g.views, found, sums);
      sk::Context host;
      CHECK(sk::to_vector<float>(host, b.download(found))[0] == (overflow ? 1.0f : 0.0f));
      const auto got = g.values(b);
      if (overflow) {
        CHECK(std::isinf(got[static_cast<std::size_t>(layout.offsets[10] + 5)]));
        continue;
      }
      std::vector<double> want;
      sums_reference(got, layout, want);  // (of the values as stored)
      const auto s = sk::to_vector<double>(host, b.download(sums));
      for (std::size_t t = 0; t < layout.count(); ++t) CHECK(rel_error(s[t], want[t]) <= 1e-13);
    }
  }
}

// Casts f32 <-> f16/bf16, bit-exact against core/float16.hpp, including NaN payloads, infinities,
// subnormals, overflow and ties.
template <class B>
void cast_case(B& b, std::int64_t gap) {
  const Layout layout(edge_sizes(), gap);
  auto src = random_values(layout.total, 1e-9, 7e4, 51);
  const float specials[] = {0.0f,
                            -0.0f,
                            INFINITY,
                            -INFINITY,
                            NAN,
                            65504.0f,
                            65520.0f,
                            1e-8f,
                            5.9604645e-8f,
                            2.9802322e-8f,
                            1.0009765625f + 0x1p-11f,
                            3.4e38f,
                            sk::bits_to_float(0x7fa00001u),
                            sk::bits_to_float(0x3f808000u)};
  for (std::size_t i = 0; i < std::size(specials); ++i)
    src[static_cast<std::size_t>(layout.offsets[14]) + i] = specials[i];
  for (auto dtype : {sk::DType::f16, sk::DType::bf16}) {
    Flat<B> from(b, src, layout);
    Flat<B> to(b, kNaNs(src.size()), layout, dtype);
    ops::cast(b.ctx, from.views, to.views);
    const auto bits = to.bits16(b);
    for (std::size_t t = 0; t < layout.count(); ++t)
      for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
        const auto at = static_cast<std::size_t>(layout.offsets[t] + i);
        REQUIRE(bits[at] == (dtype == sk::DType::f16 ? sk::float_to_half_bits(src[at])
                                                     : sk::float_to_bf16_bits(src[at])));
      }
    // And back: every 16-bit pattern widens exactly.
    std::vector<std::int64_t> sizes{65536};
    const Layout all(sizes, gap);
    sk::Context host;
    std::vector<std::uint16_t> patterns(static_cast<std::size_t>(all.total), 0);
    for (std::uint32_t p = 0; p < 65536; ++p)
      patterns[static_cast<std::size_t>(all.offsets[0]) + p] = static_cast<std::uint16_t>(p);
    const sk::Tensor hp(
        sk::Storage::borrow(patterns.data(), patterns.size() * 2, sk::Device::cpu()), {all.total},
        dtype);
    const auto dev = b.upload(sk::clone(host, hp));
    Flat<B> wide(b, kNaNs(patterns.size()), all);
    const std::vector<sk::Tensor> narrow{dev.flat_view(all.offsets[0], {65536})};
    ops::cast(b.ctx, narrow, wide.views);
    const auto got = wide.values(b);
    for (std::uint32_t p = 0; p < 65536; ++p) {
      const float want = dtype == sk::DType::f16
                             ? sk::half_bits_to_float(static_cast<std::uint16_t>(p))
                             : sk::bf16_bits_to_float(static_cast<std::uint16_t>(p));
      REQUIRE(sk::float_to_bits(got[static_cast<std::size_t>(all.offsets[0]) + p]) ==
              sk::float_to_bits(want));
    }
  }
}

template <class B>
void adam_case(B& b, bool adamw, sk::DType low, std::int64_t gap, bool low_grads = false) {
  const Layout layout(edge_sizes(), gap);
  const auto n = static_cast<std::size_t>(layout.total);
  auto w0 = random_values(layout.total, 1.0, 2.0, 61);
  Flat<B> w(b, w0, layout), m(b, std::vector<float>(n, 0.0f), layout),
      v(b, std::vector<float>(n, 0.0f), layout);
  std::vector<double> rw = widen(w0), rm(n, 0.0), rv(n, 0.0);
  ops::AdamOptions o;
  o.lr = 1e-2f;
  o.weight_decay = 0.05f;
  o.decoupled_weight_decay = adamw;
  o.inv_grad_scale = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    o.step = step;
    auto g0 = random_values(layout.total, 0.5, 1.5, 300 + static_cast<std::uint32_t>(step));
    if (low_grads) g0 = rounded_to(low, g0);
    Flat<B> g(b, g0, layout, low_grads ? low : sk::DType::f32);
    Flat<B> copy(b, kNaNs(n), layout, low == sk::DType::f32 ? sk::DType::f16 : low);
    ops::AdamTensors t{w.views, g.views, m.views, v.views, {}};
    if (low != sk::DType::f32) t.low_copies = copy.views;
    ops::adam_step(b.ctx, o, t);
    const double bc1 = 1 - std::pow(double(o.beta1), step),
                 bc2 = 1 - std::pow(double(o.beta2), step);
    for (std::size_t tsr = 0; tsr < layout.count(); ++tsr)
      for (std::int64_t i = 0; i < layout.sizes[tsr]; ++i) {
        const auto at = static_cast<std::size_t>(layout.offsets[tsr] + i);
        double gg = g0[at] * double(o.inv_grad_scale);
        if (adamw)
          rw[at] *= 1 - double(o.lr) * o.weight_decay;
        else
          gg += double(o.weight_decay) * rw[at];
        rm[at] = o.beta1 * rm[at] + (1 - double(o.beta1)) * gg;
        rv[at] = o.beta2 * rv[at] + (1 - double(o.beta2)) * gg * gg;
        rw[at] -= double(o.lr) / bc1 * rm[at] / (std::sqrt(rv[at]) / std::sqrt(bc2) + o.eps);
      }
    const auto got_w = w.values(b);
    const double err = check_close(got_w, rw, layout, "param");
    check_close(m.values(b), rm, layout, "exp_avg");
    check_close(v.values(b), rv, layout, "exp_avg_sq");
    if (low != sk::DType::f32) {
      const auto bits = copy.bits16(b);
      for (std::size_t tsr = 0; tsr < layout.count(); ++tsr)
        for (std::int64_t i = 0; i < layout.sizes[tsr]; ++i) {
          const auto at = static_cast<std::size_t>(layout.offsets[tsr] + i);
          REQUIRE(bits[at] == (low == sk::DType::f16 ? sk::float_to_half_bits(got_w[at])
                                                     : sk::float_to_bf16_bits(got_w[at])));
        }
    }
    MESSAGE("adam step " << step << " worst relative error " << err);
  }
}

// inf/NaN in gradients: plain SGD spoils exactly the elements it touches; LARC, whose rate
// depends on the whole tensor's norm, spoils the tensor as apex does (reference the same rule).
template <class B>
void nonfinite_case(B& b, bool with_larc) {
  const Layout layout({5, 9000, 33, 4}, 1);
  const auto n = layout.total;
  const auto w0 = random_values(n, 1.0, 2.0, 71);
  auto g0 = random_values(n, 0.5, 1.5, 72);
  g0[static_cast<std::size_t>(layout.offsets[1] + 17)] = INFINITY;
  g0[static_cast<std::size_t>(layout.offsets[2] + 3)] = NAN;
  Flat<B> w(b, w0, layout), g(b, g0, layout), buf(b, kNaNs(static_cast<std::size_t>(n)), layout);
  ops::SgdOptions o;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  SgdReference ref{widen(w0), std::vector<double>(static_cast<std::size_t>(n), 0.0)};
  std::vector<double> grad_coef(layout.count(), 1.0), param_coef(layout.count(), 0.0);
  const ops::SgdTensors t{w.views, g.views, buf.views, {}};
  if (with_larc) {
    ops::LarcOptions larc;
    larc.weight_decay = 1e-4f;
    std::vector<double> wsq, gsq;
    sums_reference(w0, layout, wsq);
    sums_reference(g0, layout, gsq);
    for (std::size_t i = 0; i < layout.count(); ++i)
      larc_reference(wsq[i], gsq[i], larc, o.lr, 1.0, grad_coef[i], param_coef[i]);
    ops::larc_sgd_step(b.ctx, o, larc, t);
  } else {
    o.weight_decay = 1e-4f;
    std::fill(param_coef.begin(), param_coef.end(), 1e-4);
    ops::sgd_step(b.ctx, o, t);
  }
  ref.step(widen(g0), o, layout, grad_coef, param_coef);
  const auto got = w.values(b);
  for (std::size_t tsr = 0; tsr < layout.count(); ++tsr)
    for (std::int64_t i = 0; i < layout.sizes[tsr]; ++i) {
      const auto at = static_cast<std::size_t>(layout.offsets[tsr] + i);
      REQUIRE(std::isnan(got[at]) == std::isnan(ref.w[at]));
      REQUIRE(std::isinf(got[at]) == std::isinf(ref.w[at]));
      if (std::isfinite(ref.w[at])) REQUIRE(rel_error(got[at], ref.w[at]) <= kF32Tolerance);
    }
}

template <class B>
void argument_errors_case(B& b) {
  const Layout layout({10, 20}, 0);
  Flat<B> w(b, random_values(layout.total, 1, 2, 1), layout),
      g(b, random_values(layout.total, 1, 2, 2), layout);
  Flat<B> half(b, random_values(layout.total, 1, 2, 3), layout, sk::DType::f16);
  ops::SgdOptions o;
  CHECK_THROWS_AS(ops::sgd_step(b.ctx, o, ops::SgdTensors{w.views, half.views, {}, {}}),
                  sk::InvalidArgument);
  const std::vector<sk::Tensor> one{w.views[0]};
  CHECK_THROWS_AS(ops::sgd_step(b.ctx, o, ops::SgdTensors{one, g.views, {}, {}}),
                  sk::InvalidArgument);
  const std::vector<sk::Tensor> swapped{w.views[1], w.views[0]};
  CHECK_THROWS_AS(ops::sgd_step(b.ctx, o, ops::SgdTensors{swapped, g.views, {}, {}}),
                  sk::InvalidArgument);
  o.momentum = 0.9f;
  CHECK_THROWS_AS(ops::sgd_step(b.ctx, o, ops::SgdTensors{w.views, g.views, {}, {}}),
                  sk::InvalidArgument);
  o.nesterov = true;
  o.dampening = 0.1f;
  CHECK_THROWS_AS(ops::sgd_step(b.ctx, o, ops::SgdTensors{w.views, g.views, w.views, {}}),
                  sk::InvalidArgument);
  ops::SgdOptions decayed;
  decayed.weight_decay = 0.1f;
  CHECK_THROWS_AS(ops::larc_sgd_step(b.ctx, decayed, ops::LarcOptions{},
                                     ops::SgdTensors{w.views, g.views, {}, {}}),
                  sk::InvalidArgument);
  CHECK_THROWS_AS(ops::cast(b.ctx, w.views, g.views),
                  sk::InvalidArgument);  // f32 -> f32 is no fused cast
  // Empty lists are a no-op.
  ops::sgd_step(b.ctx, ops::SgdOptions{}, ops::SgdTensors{});
}

// The step gate (ops/step_gate.hpp): a gated SGD, Adam or LARC-SGD pass gives the bits of the
// one decided on the host -- its gradients unscaled by the gate's factor (times the options'
// own; LARC's coefficients read it on the device, then the gate's factor is set to 1 for the
// pass, as the optimizer does), its step numbered by the gate's count of applied steps -- and
// a pass the gate skips writes nothing, the count staying, so the first applied step takes
// SGD's first-step rule whatever was skipped before it. The rate changes at every step (a
// schedule): the gated pass reads it from the gate (AdamW's decay factor formed there too).
// Host-decided (h) and gated (d) copies of every operand, compared bit for bit.
enum class GatedRule { sgd, adam, larc };

template <class B>
void gated_step_case(B& b, GatedRule rule, sk::DType low, std::int64_t gap) {
  const bool adam = rule == GatedRule::adam;
  CAPTURE(static_cast<int>(rule));
  CAPTURE(sk::dtype_name(low));
  const Layout layout(edge_sizes(), gap);
  const auto n = static_cast<std::size_t>(layout.total);
  const auto w0 = random_values(layout.total, 1.0, 2.0, 7);
  const std::vector<float> zero(n, 0.0f);  // state buffers start at 0, as the optimizer's
  const sk::DType copy_dtype = low == sk::DType::f32 ? sk::DType::f16 : low;
  Flat<B> wh(b, w0, layout), wd(b, w0, layout), ah(b, zero, layout), ad(b, zero, layout),
      vh(b, zero, layout), vd(b, zero, layout), ch(b, kNaNs(n), layout, copy_dtype),
      cd(b, kNaNs(n), layout, copy_dtype);
  const Layout slots({ops::kGateSlots}, 0);
  Flat<B> gate(b, std::vector<float>(static_cast<std::size_t>(slots.total), 0.0f), slots);
  const sk::Tensor g8 = gate.views[0];
  const ops::SgdOptions sgd{
      .lr = 0.05f, .momentum = 0.9f, .dampening = 0.25f, .weight_decay = 1e-3f};
  ops::AdamOptions adam_options;
  adam_options.lr = 1e-2f;
  adam_options.weight_decay = 1e-2f;
  adam_options.decoupled_weight_decay = true;
  struct Step {
    bool overflow;
    float inv_scale;
  };
  const Step steps[] = {
      {true, 0.5f}, {false, 0.25f}, {true, 0.25f}, {false, 0.125f}, {false, 0.125f}};
  const float clip = 0.75f;  // the options' own factor (a clip coefficient)
  const ops::LarcOptions larc{.trust_coefficient = 0.02f, .clip = true, .weight_decay = 1e-3f};
  std::int64_t applied = 0;
  for (std::uint32_t s = 0; s < 5; ++s) {
    CAPTURE(s);
    auto g0 = random_values(layout.total, 0.5, 1.5, 400 + s);
    if (steps[s].overflow) g0[static_cast<std::size_t>(layout.offsets[2])] = INFINITY;
    Flat<B> g(b, g0, layout);
    b.fill(g8.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1), steps[s].inv_scale);
    b.fill(g8.slice(0, ops::kGateSkip, ops::kGateSkip + 1), steps[s].overflow ? 1.0 : 0.0);
    // A schedule: the gated pass takes the rate from the gate (its options' lr is a wrong one).
    const float decay = 1.0f - 0.1f * static_cast<float>(s);
    const float rate = (adam ? adam_options.lr : sgd.lr) * decay;
    b.fill(g8.slice(0, ops::kGateRate, ops::kGateRate + 1), rate);
    const auto run = [&](Flat<B>& w, Flat<B>& a, Flat<B>& v, Flat<B>& c, bool gated) {
      const std::vector<sk::Tensor> copies =
          low != sk::DType::f32 ? c.views : std::vector<sk::Tensor>{};
      const float factor = gated ? clip : clip * steps[s].inv_scale;
      const float options_lr = gated ? 7.0f : rate;
      if (adam) {
        ops::AdamOptions o = adam_options;
        o.lr = options_lr;
        o.inv_grad_scale = factor;
        o.step = applied + 1;
        if (gated) o.gate = g8;
        ops::adam_step(b.ctx, o, ops::AdamTensors{w.views, g.views, a.views, v.views, copies});
      } else if (rule == GatedRule::larc) {
        const auto count = static_cast<std::int64_t>(layout.count());
        auto sums = b.zeros({2, count}, sk::DType::f64);
        auto coefficients = b.zeros({count, 2}, sk::DType::f32);
        ops::segment_sums_of_squares(b.ctx, w.views, g.views, sums);
        ops::larc_coefficients(b.ctx, larc, options_lr, factor, sums, coefficients,
                               gated ? g8 : sk::Tensor());
        ops::SgdOptions o = ops::sgd_options_under_larc(sgd);
        o.lr = options_lr;
        o.first_step = applied == 0;
        if (gated) {
          b.fill(g8.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1), 1.0);
          o.gate = g8;
        }
        ops::sgd_step(b.ctx, o, ops::SgdTensors{w.views, g.views, a.views, copies}, coefficients);
      } else {
        ops::SgdOptions o = sgd;
        o.lr = options_lr;
        o.inv_grad_scale = factor;
        o.first_step = applied == 0;
        if (gated) o.gate = g8;
        ops::sgd_step(b.ctx, o, ops::SgdTensors{w.views, g.views, a.views, copies});
      }
    };
    run(wd, ad, vd, cd, true);
    ops::count_applied_step(b.ctx, g8);
    if (!steps[s].overflow) {
      run(wh, ah, vh, ch, false);
      ++applied;
    }
    const auto same_bits = [&](const std::vector<float>& x, const std::vector<float>& y,
                               const char* what) {
      INFO(what);
      REQUIRE(x.size() == y.size());
      CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
    };
    same_bits(wd.values(b), wh.values(b), "params");
    same_bits(ad.values(b), ah.values(b), adam ? "exp_avg" : "momentum");
    if (adam) same_bits(vd.values(b), vh.values(b), "exp_avg_sq");
    if (low != sk::DType::f32) CHECK(cd.bits16(b) == ch.bits16(b));
    CHECK(gate.values(b)[ops::kGateStepsBefore] == static_cast<float>(applied));
  }
  // (After a skipped step the gated copies equal the host's, which did not run: nothing was
  // written, the f16/bf16 copies' NaN poison included.)
  CHECK(applied == 3);
}

// The loss scale state on the device (ops/step_gate.hpp, LossScaleFunctor) follows
// torch.cuda.amp.GradScaler's rules: begin sets the inverse and clears the flag; update backs
// off on an overflow and grows after growth_interval finite steps; follow_loss_scale scales
// kept values by the change, or zeroes them (inf too) after an overflow.
template <class B>
void loss_scale_case(B& b) {
  const Layout slots({ops::kLossScaleSlots}, 0);
  Flat<B> state(b, {1024.0f, 0.0f, 0.0f, 0.0f, 0.0f}, slots);
  const sk::Tensor st = state.views[0];
  const ops::LossScaleRule rule{
      .growth_factor = 2.0f, .backoff_factor = 0.5f, .growth_interval = 3.0f};
  double scale = 1024;  // the host's model of GradScaler
  int tracker = 0;
  const Layout kept_layout({3}, 1);
  for (bool overflow : {false, false, true, false, false, false, false, true}) {
    CAPTURE(overflow);
    ops::loss_scale_phase(b.ctx, ops::LossScaleFunctor::Phase::begin, rule, st);
    auto v = state.values(b);
    CHECK(v[ops::kLossInvScale] == static_cast<float>(1.0 / scale));
    CHECK(v[ops::kLossFoundInf] == 0.0f);
    if (overflow) b.fill(st.slice(0, ops::kLossFoundInf, ops::kLossFoundInf + 1), 1.0);
    ops::loss_scale_phase(b.ctx, ops::LossScaleFunctor::Phase::update, rule, st);
    const double before = scale;
    if (overflow) {
      scale *= 0.5;
      tracker = 0;
    } else if (++tracker == 3) {
      scale *= 2;
      tracker = 0;
    }
    v = state.values(b);
    CHECK(v[ops::kLossScale] == static_cast<float>(scale));
    CHECK(v[ops::kLossGrowthTracker] == static_cast<float>(tracker));
    Flat<B> kept(b, {0.0f, 1.5f, -3.0f, INFINITY, 0.0f}, kept_layout);
    ops::follow_loss_scale(b.ctx, kept.views, st);
    const auto k = kept.values(b);
    if (overflow) {
      CHECK((k[1] == 0.0f && k[2] == 0.0f && k[3] == 0.0f));
    } else {
      const auto factor = static_cast<float>(scale / before);
      CHECK((k[1] == 1.5f * factor && k[2] == -3.0f * factor && std::isinf(k[3])));
    }
  }
  // The whole-tensor LARC entries refuse a gate by name: their trust ratios need the scale
  // before the pass (the optimizer composes larc_coefficients, which reads it, with sgd_step).
  Flat<B> w(b, {1.0f, 2.0f}, Layout({1}, 0)), g(b, {1.0f, 2.0f}, Layout({1}, 0));
  ops::SgdOptions o;
  o.gate = Flat<B>(b, {1.0f, 0.0f, 0.0f, 0.0f}, Layout({3}, 0)).views[0];
  CHECK_THROWS_WITH(
      ops::larc_sgd_step(b.ctx, o, ops::LarcOptions{}, ops::SgdTensors{w.views, g.views, {}, {}}),
      doctest::Contains("LARC-SGD entry takes no step gate"));
}

}  // namespace ops_test
