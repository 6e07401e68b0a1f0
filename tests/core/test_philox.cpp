// Counter-based RNG: Random123's known answers, determinism, independence of strides and
// dtype, Box-Muller's own log and cos against long double, and the distributions' moments.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;

TEST_CASE("Philox4x32-10 matches Random123's known-answer vectors") {
  struct Case {
    sk::PhiloxBlock counter;
    std::uint32_t key0, key1;
    sk::PhiloxBlock expected;
  };
  const Case cases[] = {
      {{{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}},
       0xffffffff,
       0xffffffff,
       {{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}},
       0xa4093822,
       0x299f31d0,
       {{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}}},
  };
  for (const auto& c : cases) {
    const auto out = sk::philox4x32_10(c.counter, c.key0, c.key1);
    for (int i = 0; i < 4; ++i) CHECK(out.v[i] == c.expected.v[i]);
  }
}

// Contiguous fills draw sixteen blocks at once (two groups of AVX2 lanes where the build has
// them): the same words as one block at a time, also where a batch's counters carry into their
// high word, in either group.
TEST_CASE("a batch of Philox blocks equals the blocks drawn one at a time") {
  std::uint32_t words[4 * sk::detail::kPhiloxBatch];
  for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{0x9E3779B97F4A7C15}})
    for (const std::uint64_t first :
         {std::uint64_t{0}, std::uint64_t{1000}, std::uint64_t{0xFFFFFFFB},
          std::uint64_t{0xFFFFFFF5}, std::uint64_t{0x1FFFFFFFF},
          std::uint64_t{0xFFFFFFFFFFFFFFFC}}) {
      CAPTURE(seed);
      CAPTURE(first);
      sk::detail::philox_batch(seed, first, words);
      std::uint64_t wrong = 0;
      for (std::uint64_t j = 0; j < sk::detail::kPhiloxBatch; ++j) {
        const sk::PhiloxBlock block = sk::philox_block(seed, first + j);
        for (int w = 0; w < 4; ++w)
          wrong += words[4 * j + static_cast<std::uint64_t>(w)] != block.v[w];
      }
      CHECK(wrong == 0);
    }
}

// normal_ computes log and cos(2 pi u) itself (box_muller.hpp), so that CPU and GPU agree bit
// for bit: both within about an ulp of long double's, on the words' whole range and its edges
// (the quarter turns where cos_two_pi changes branch, and u next to 0 and 1).
TEST_CASE("Box-Muller's log and cos(2 pi u) are within an ulp of long double's") {
  std::vector<std::uint32_t> words = {
      0u,          1u,          2u,          0x1FFFFFFFu, 0x20000000u, 0x3FFFFFFFu, 0x40000000u,
      0x5FFFFFFFu, 0x60000000u, 0x7FFFFFFFu, 0x80000000u, 0xBFFFFFFFu, 0xC0000000u, 0xDFFFFFFFu,
      0xE0000000u, 0xB504F333u, 0x6A09E667u, 0xFFFFFFFEu, 0xFFFFFFFFu};
  std::mt19937 generator(2026);
  for (int i = 0; i < 1 << 21; ++i) words.push_back(generator());
  const long double two_pi = 6.283185307179586476925286766559005768L;
  double worst_log_ulps = 0, worst_cos_error = 0;
  for (const std::uint32_t word : words) {
    const double u = sk::word_to_unit(word);
    const long double log_u = std::log(static_cast<long double>(u));
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<double>(log_u)) - 52);
    const long double log_error = sk::detail::log_of_positive(u) - log_u;
    worst_log_ulps = std::max(worst_log_ulps, static_cast<double>(std::fabs(log_error)) / ulp);
    const long double cos_error =
        sk::detail::cos_two_pi(u) - std::cos(two_pi * static_cast<long double>(u));
    worst_cos_error = std::max(worst_cos_error, static_cast<double>(std::fabs(cos_error)));
  }
  MESSAGE("log: ", worst_log_ulps, " ulp; cos(2 pi u): ", worst_cos_error / 0x1p-53, " x 2^-53");
  CHECK(worst_log_ulps <= 1.25);
  CHECK(worst_cos_error <= 1.5 * 0x1p-53);
  // Exactly at the quarter turns' neighbours the reduction is exact, so the signs are right.
  CHECK(sk::detail::cos_two_pi(0.25) == 0.0);
  CHECK(sk::detail::cos_two_pi(0.5) == -1.0);
  CHECK(sk::detail::cos_two_pi(0.75) == 0.0);
  CHECK(sk::detail::cos_two_pi(1.0) == 1.0);
  CHECK(sk::detail::log_of_positive(1.0) == 0.0);
  CHECK(sk::detail::log_of_positive(0.5) == -0x1.62e42fefa39efp-1);
}

// The f32 values normal_ writes are the values libm's log and cos give, rounded to f32, all but
// a rare few (where the two doubles straddle a rounding boundary of f32): its own functions do
// not change the distribution.
TEST_CASE("normal_'s f32 values are libm Box-Muller's, but for a rare few") {
  sk::Context ctx({.seed = 31});
  const std::int64_t n = 1 << 20;
  auto t = sk::empty(ctx, {n}, sk::DType::f32);
  const std::uint64_t base = 0;  // a fresh context draws from block 0
  sk::normal_(ctx, t, 0.0, 1.0);
  const auto values = sk::to_vector<float>(ctx, t);
  int differing = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const sk::PhiloxBlock block = sk::philox_block(31, base + static_cast<std::uint64_t>(i / 2));
    const std::uint32_t first = block.v[2 * (i % 2)], second = block.v[2 * (i % 2) + 1];
    const double radius = std::sqrt(-2.0 * std::log(sk::word_to_unit(first)));
    const double angle = 6.283185307179586476925286766559 * sk::word_to_unit(second);
    differing +=
        values[static_cast<std::size_t>(i)] != static_cast<float>(radius * std::cos(angle));
  }
  MESSAGE(differing, " of ", n, " differ");
  CHECK(differing <= 8);
}

TEST_CASE("uniform_ has the right range and moments, and a seed replays it") {
  sk::Context ctx({.seed = 1234});
  auto t = sk::empty(ctx, {1 << 18}, sk::DType::f64);
  sk::uniform_(ctx, t, -2.0, 3.0);
  auto values = sk::to_vector<double>(ctx, t);
  double sum = 0, sum_sq = 0;
  for (double v : values) {
    REQUIRE(v >= -2.0);
    REQUIRE(v < 3.0);
    sum += v;
    sum_sq += v * v;
  }
  const double n = static_cast<double>(values.size());
  const double mean = sum / n, variance = sum_sq / n - mean * mean;
  CHECK(mean == doctest::Approx(0.5).epsilon(0.01));
  CHECK(variance == doctest::Approx(25.0 / 12.0).epsilon(0.01));

  // Successive fills draw fresh numbers; re-seeding replays the stream.
  sk::uniform_(ctx, t, -2.0, 3.0);
  CHECK(sk::to_vector<double>(ctx, t) != values);
  ctx.manual_seed(1234);
  sk::uniform_(ctx, t, -2.0, 3.0);
  CHECK(sk::to_vector<double>(ctx, t) == values);
}

TEST_CASE("normal_ has the right moments") {
  sk::Context ctx({.seed = 99});
  auto t = sk::empty(ctx, {1 << 18}, sk::DType::f32);
  sk::normal_(ctx, t, 1.0, 0.5);
  double sum = 0, sum_sq = 0, sum_4 = 0;
  for (float v : sk::to_vector<float>(ctx, t)) {
    sum += v;
    sum_sq += (v - 1.0) * (v - 1.0);
    sum_4 += std::pow(v - 1.0, 4);
  }
  const double n = 1 << 18;
  CHECK(sum / n == doctest::Approx(1.0).epsilon(0.005));
  CHECK(sum_sq / n == doctest::Approx(0.25).epsilon(0.01));
  CHECK(sum_4 / n / (0.25 * 0.25) == doctest::Approx(3.0).epsilon(0.03));  // Gaussian kurtosis
}

TEST_CASE("a random fill depends on element position only: strides and dtype do not matter") {
  sk::Context a({.seed = 5}), b({.seed = 5}), c({.seed = 5});
  auto contiguous = sk::empty(a, {6, 7}, sk::DType::f32);
  sk::uniform_(a, contiguous, 0.0, 1.0);
  // The same logical [6, 7] tensor laid out transposed in memory.
  auto backing = sk::empty(b, {7, 6}, sk::DType::f32);
  auto strided = backing.transpose(0, 1);
  sk::uniform_(b, strided, 0.0, 1.0);
  CHECK(sk::to_vector<float>(a, contiguous) == sk::to_vector<float>(b, strided));
  // A bf16 fill equals the f32 fill rounded (the value is made in double, rounded once to f32,
  // and f32 -> bf16 of that value is what we expect from a double -> bf16 through f32).
  auto low = sk::empty(c, {6, 7}, sk::DType::bf16);
  sk::uniform_(c, low, 0.0, 1.0);
  auto rounded = sk::to_vector<sk::BFloat16>(c, low);
  auto reference = sk::to_vector<float>(a, contiguous);
  for (std::size_t i = 0; i < reference.size(); ++i)
    CHECK(rounded[i].bits == sk::float_to_bf16_bits(reference[i]));
}

// Contiguous host fills draw each Philox block once for its 4 uniforms or 2 normals, in tasks
// on the rank's threads; strided ones call RandomSpec::value_at per element. Both must give
// every element the same value, also where a tensor ends inside a block (odd sizes).
TEST_CASE("contiguous and strided fills agree, for both kinds, on several threads") {
  for (const int threads : {1, 3}) {
    CAPTURE(threads);
    sk::Context a({.seed = 9, .cpu_threads = threads}), b({.seed = 9, .cpu_threads = threads});
    auto contiguous = sk::empty(a, {3, 65537}, sk::DType::f64);
    auto backing = sk::empty(b, {65537, 3}, sk::DType::f64);
    auto strided = backing.transpose(0, 1);
    sk::uniform_(a, contiguous, -1.0, 2.0);
    sk::uniform_(b, strided, -1.0, 2.0);
    CHECK(sk::to_vector<double>(a, contiguous) == sk::to_vector<double>(b, strided));
    sk::normal_(a, contiguous, 0.5, 3.0);
    sk::normal_(b, strided, 0.5, 3.0);
    CHECK(sk::to_vector<double>(a, contiguous) == sk::to_vector<double>(b, strided));
  }
  // Both paths share RandomSpec::value_in_block: check its lanes against the rule written out
  // (uniform: word i % 4 of block i / 4; normal: Box-Muller on words 2p and 2p + 1 of block i / 2).
  sk::RandomSpec uniform{sk::RandomKind::uniform, -1.0, 2.0, 77, 1000};
  sk::RandomSpec normal{sk::RandomKind::normal, 0.5, 3.0, 77, 1000};
  for (std::uint64_t i : {0u, 1u, 2u, 3u, 4u, 5u, 6u, 7u, 1001u, 65537u}) {
    const sk::PhiloxBlock u = sk::philox_block(77, 1000 + i / 4);
    CHECK(uniform.value_at(i) == std::fma(3.0, sk::word_to_unit(u.v[i % 4]), -1.0));
    const sk::PhiloxBlock n = sk::philox_block(77, 1000 + i / 2);
    const std::uint32_t first = n.v[2 * (i % 2)], second = n.v[2 * (i % 2) + 1];
    const double radius = std::sqrt(-2.0 * sk::detail::log_of_positive(sk::word_to_unit(first)));
    const double cosine = sk::detail::cos_two_pi(sk::word_to_unit(second));
    CHECK(normal.value_at(i) == std::fma(3.0, radius * cosine, 0.5));
  }
}

// A range of a fill, made alone (a rank's shard of a deferred parameter, core/deferred_init.hpp):
// from_element(first) starts inside a block as well as at its start, and the contiguous path
// (head element by element, then whole blocks on the threads) equals the whole fill's slice.
TEST_CASE("a fill's range made alone equals the whole fill's elements, from any element") {
  const std::int64_t n = 70001;
  for (const sk::RandomKind kind : {sk::RandomKind::uniform, sk::RandomKind::normal}) {
    for (const int threads : {1, 3}) {
      CAPTURE(threads);
      sk::Context ctx({.seed = 4, .cpu_threads = threads});
      const sk::RandomSpec spec{kind, -0.5, 1.5, 123, 4096};
      auto whole = sk::empty(ctx, {n}, sk::DType::f32);
      sk::detail::tensor_kernels_for(ctx, whole).random(ctx, whole, spec);
      const auto expected = sk::to_vector<float>(ctx, whole);
      for (const std::int64_t first : {0, 1, 2, 3, 5, 4097, 30001}) {
        for (const std::int64_t count : {1, 2, 3, 7, 33333}) {
          if (first + count > n) continue;
          CAPTURE(first);
          CAPTURE(count);
          auto part = sk::empty(ctx, {count}, sk::DType::f32);
          sk::detail::tensor_kernels_for(ctx, part).random(
              ctx, part, spec.from_element(static_cast<std::uint64_t>(first)));
          const auto got = sk::to_vector<float>(ctx, part);
          CHECK(std::equal(got.begin(), got.end(), expected.begin() + first));
          // twice: from_element composes (a range of a range)
          const sk::RandomSpec twice =
              spec.from_element(static_cast<std::uint64_t>(first / 2))
                  .from_element(static_cast<std::uint64_t>(first - first / 2));
          CHECK(twice.value_at(0) == spec.value_at(static_cast<std::uint64_t>(first)));
        }
      }
    }
  }
}

// A uniform value is below `high` in double, but rounding it to the tensor's dtype may reach
// `high` (bf16 on [0, 1): about 0.2% of the elements): those take the dtype's largest value
// below it, so every fill keeps to [low, high).
TEST_CASE("uniform_ keeps below high in every floating dtype") {
  sk::Context ctx({.seed = 99});
  for (auto dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::f16}) {
    auto t = sk::empty(ctx, {1 << 20}, dtype);
    sk::uniform_(ctx, t, 0.0, 1.0);
    const auto values = sk::to_vector<float>(ctx, sk::cast(ctx, t, sk::DType::f32));
    INFO(sk::dtype_name(dtype));
    CHECK(*std::max_element(values.begin(), values.end()) < 1.0f);
    CHECK(*std::min_element(values.begin(), values.end()) >= 0.0f);
  }
  // The largest word, which rounds to `high` in f32 too; ceilings at and around zero.
  const sk::RandomSpec unit{sk::RandomKind::uniform, 0.0, 1.0, 0, 0};
  const double top = unit.uniform_value(0xFFFFFFFFu);
  REQUIRE(static_cast<float>(top) == 1.0f);
  CHECK(unit.stored_as<float>(top, unit.uniform_ceiling<float>()) == std::nextafter(1.0f, 0.0f));
  CHECK(unit.stored_as<double>(top, unit.uniform_ceiling<double>()) == top);
  CHECK(unit.uniform_ceiling<sk::BFloat16>().bits == 0x3f7f);  // 1 - 2^-8
  CHECK(unit.uniform_ceiling<sk::Half>().bits == 0x3bff);      // 1 - 2^-11
  const sk::RandomSpec below_zero{sk::RandomKind::uniform, -1.0, 0.0, 0, 0};
  CHECK(below_zero.uniform_ceiling<sk::Half>().bits == 0x8001);  // the smallest negative
  const sk::RandomSpec below_minus_one{sk::RandomKind::uniform, -2.0, -1.0, 0, 0};
  CHECK(below_minus_one.uniform_ceiling<sk::BFloat16>().bits == 0xbf81);  // -(1 + 2^-7)
  // Normal values and a [low, low] fill are left as they round.
  const sk::RandomSpec normal{sk::RandomKind::normal, 0.0, 1.0, 0, 0};
  CHECK(normal.stored_as<float>(1.0, normal.uniform_ceiling<float>()) == 1.0f);
  auto flat = sk::empty(ctx, {64}, sk::DType::bf16);
  sk::uniform_(ctx, flat, 0.5, 0.5);
  for (auto v : sk::to_vector<sk::BFloat16>(ctx, flat)) CHECK(v.to_float() == 0.5f);
}

TEST_CASE("random fills refuse integer tensors") {
  sk::Context ctx;
  auto t = sk::empty(ctx, {4}, sk::DType::i32);
  CHECK_THROWS_AS(sk::uniform_(ctx, t, 0, 1), sk::InvalidArgument);
}
