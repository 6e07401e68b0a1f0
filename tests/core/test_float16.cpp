// f16 and bf16 conversions, checked exhaustively: every one of the 65 536 bit patterns of each
// format (NaN, inf, subnormals included), every rounding midpoint between neighbours, and large
// samples of floats against independent references.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "shardkit/core/float16.hpp"
#include "shardkit/core/half_runs.hpp"

namespace sk = shardkit;

namespace {

// Value of a 16-bit float pattern (a sign bit, `exponent_bits` of exponent, the rest mantissa)
// from its fields, computed independently in double: binary16 has 5 exponent bits, bfloat16 8.
double reference_value(std::uint16_t bits, int exponent_bits) {
  const int mantissa_bits = 15 - exponent_bits;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int all_ones = (1 << exponent_bits) - 1;
  const int sign = (bits & 0x8000) ? -1 : 1;
  const int exponent = (bits >> mantissa_bits) & all_ones;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  if (exponent == all_ones)
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits);
}
double half_reference(std::uint16_t h) { return reference_value(h, 5); }
double bf16_reference(std::uint16_t b) { return reference_value(b, 8); }

}  // namespace

TEST_CASE("f16 -> f32 is exact for all 65536 patterns; f32 -> f16 gives the pattern back") {
  int nan_count = 0;
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float value = sk::half_bits_to_float(h);
    const double reference = half_reference(h);
    if (std::isnan(reference)) {
      ++nan_count;
      REQUIRE(std::isnan(value));
      REQUIRE(std::signbit(value) == bool(h & 0x8000));
      const auto back = sk::float_to_half_bits(value);
      REQUIRE(((back >> 10) & 0x1f) == 0x1f);  // still NaN,
      REQUIRE((back & 0x3ff) != 0);
      REQUIRE((back & 0x200) != 0);              // quiet,
      REQUIRE((back & 0x8000) == (h & 0x8000));  // same sign
      if (h & 0x200) REQUIRE(back == h);         // quiet NaNs keep their payload
      continue;
    }
    REQUIRE(static_cast<double>(value) == reference);
    REQUIRE(std::signbit(value) == bool(h & 0x8000));
    REQUIRE(sk::float_to_half_bits(value) == h);
  }
  CHECK(nan_count == 2 * 1023);
}

TEST_CASE("f32 -> f16 rounds every midpoint between neighbouring halves to even") {
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double low = half_reference(static_cast<std::uint16_t>(h));
    const double high =
        (h + 1 == 0x7c00) ? 65536.0 : half_reference(static_cast<std::uint16_t>(h + 1));
    const auto midpoint = static_cast<float>((low + high) / 2);  // exact in float
    REQUIRE(static_cast<double>(midpoint) == (low + high) / 2);
    const std::uint16_t even =
        (h & 1) ? static_cast<std::uint16_t>(h + 1) : static_cast<std::uint16_t>(h);
    for (std::uint16_t sign : {std::uint16_t{0}, std::uint16_t{0x8000}}) {
      const float m = sign ? -midpoint : midpoint;
      REQUIRE(sk::float_to_half_bits(m) == (even | sign));
      const float above = std::nextafter(m, sign ? -INFINITY : INFINITY);
      const float below = std::nextafter(m, 0.0f);
      REQUIRE(sk::float_to_half_bits(above) == ((h + 1) | sign));
      REQUIRE(sk::float_to_half_bits(below) == (h | sign));
    }
  }
  CHECK(sk::float_to_half_bits(65519.996f) == 0x7bff);
  CHECK(sk::float_to_half_bits(65520.0f) == 0x7c00);
  CHECK(sk::float_to_half_bits(std::numeric_limits<float>::max()) == 0x7c00);
  CHECK(sk::float_to_half_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(sk::float_to_half_bits(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(sk::float_to_half_bits(-0.0f) == 0x8000);
}

#if defined(__FLT16_MAX__) && !defined(__CUDACC__)
TEST_CASE("f32 -> f16 equals the compiler's _Float16 conversion on 4.3 million floats") {
  for (std::uint64_t bits = 0; bits <= 0xffffffffull; bits += 997) {
    const float value = sk::bits_to_float(static_cast<std::uint32_t>(bits));
    if (std::isnan(value)) continue;
    const _Float16 reference = static_cast<_Float16>(value);
    std::uint16_t reference_bits;
    std::memcpy(&reference_bits, &reference, 2);
    REQUIRE(sk::float_to_half_bits(value) == reference_bits);
  }
}

// float_to_half_bits rounds these with a float addition (the FPU's rounding), not with integer
// code: every float from 2^-25 to the smallest normal half, both signs.
TEST_CASE("f32 -> f16 equals _Float16 on every float of the subnormal halves' range") {
  std::int64_t mismatches = 0;
  for (std::uint32_t bits = 0x33000000u; bits <= 0x38800000u; ++bits)
    for (const std::uint32_t sign : {0u, 0x80000000u}) {
      const float value = sk::bits_to_float(bits | sign);
      const _Float16 reference = static_cast<_Float16>(value);
      std::uint16_t reference_bits;
      std::memcpy(&reference_bits, &reference, 2);
      mismatches += sk::float_to_half_bits(value) != reference_bits;
    }
  CHECK(mismatches == 0);
}
#endif

TEST_CASE("bf16 -> f32 is exact for all 65536 patterns; f32 -> bf16 gives the pattern back") {
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto b = static_cast<std::uint16_t>(bits);
    const float value = sk::bf16_bits_to_float(b);
    const double reference = bf16_reference(b);
    if (std::isnan(reference)) {
      REQUIRE(std::isnan(value));
      const auto back = sk::float_to_bf16_bits(value);
      REQUIRE(((back >> 7) & 0xff) == 0xff);
      REQUIRE((back & 0x40) != 0);  // quiet
      REQUIRE((back & 0x8000) == (b & 0x8000));
      continue;
    }
    REQUIRE(static_cast<double>(value) == reference);
    REQUIRE(sk::float_to_bf16_bits(value) == b);
  }
}

TEST_CASE("f32 -> bf16 rounds every midpoint to even, and random floats to nearest") {
  for (std::uint32_t b = 0; b < 0x7f80; ++b) {
    const double low = bf16_reference(static_cast<std::uint16_t>(b));
    const double high = (b + 1 == 0x7f80) ? std::ldexp(1.0, 128)
                                          : bf16_reference(static_cast<std::uint16_t>(b + 1));
    const auto midpoint = static_cast<float>((low + high) / 2);
    REQUIRE(static_cast<double>(midpoint) == (low + high) / 2);
    const std::uint32_t even = (b & 1) ? b + 1 : b;
    REQUIRE(sk::float_to_bf16_bits(midpoint) == even);
    REQUIRE(sk::float_to_bf16_bits(-midpoint) == (even | 0x8000));
    REQUIRE(sk::float_to_bf16_bits(std::nextafter(midpoint, INFINITY)) == b + 1);
    REQUIRE(sk::float_to_bf16_bits(std::nextafter(midpoint, 0.0f)) == b);
  }
  // Random floats against "the nearer of the two neighbours, ties to even", done in double.
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) {
    const std::uint32_t bits = rng();
    const float value = sk::bits_to_float(bits);
    if (std::isnan(value) || std::isinf(value)) continue;
    const auto truncated = static_cast<std::uint16_t>(bits >> 16);
    const double a = std::fabs(bf16_reference(truncated));
    const double b = std::fabs(((truncated & 0x7fff) + 1 == 0x7f80)
                                   ? std::ldexp(1.0, 128)
                                   : bf16_reference(static_cast<std::uint16_t>(truncated + 1)));
    const double x = std::fabs(static_cast<double>(value));
    std::uint16_t expected = truncated;
    if (x - a > b - x || (x - a == b - x && (truncated & 1)))
      expected = static_cast<std::uint16_t>(truncated + 1);
    REQUIRE(sk::float_to_bf16_bits(value) == expected);
  }
}

TEST_CASE("Half and BFloat16 wrap the conversions") {
  CHECK(sk::Half(1.0f).bits == 0x3c00);
  CHECK(sk::Half::from_bits(0xc000).to_float() == -2.0f);
  CHECK(static_cast<float>(sk::BFloat16(3.0f)) == 3.0f);
  CHECK(sk::BFloat16::from_bits(0x3f80).to_float() == 1.0f);
}

// convert_run takes vcvtps2ph to f16 where the build targets F16C, AVX2 lanes to bf16 lanes
// (x86-64-v3 has both): every sign and exponent with the top 10 mantissa bits each way, and the
// 13 dropped bits at each of f16's rounding boundaries (0, 1, just below, at and above the
// midpoint, all ones) or random; bf16's boundaries in the low 16 bits likewise; then NaNs with
// random payloads and random bits. Odd lengths and offsets cover the scalar tails.
TEST_CASE("runs of f32 -> f16 and f32 -> bf16 conversions give the scalar bits for every class") {
  std::vector<float> src;
  std::mt19937 engine(17);
  auto gen = [&] { return static_cast<std::uint32_t>(engine()); };
  const std::uint32_t half_low[] = {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu};
  const std::uint32_t bf16_low[] = {0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x18000u};
  for (std::uint32_t high = 0; high < (1u << 19); ++high) {
    for (std::uint32_t low : half_low) src.push_back(std::bit_cast<float>(high << 13 | low));
    src.push_back(std::bit_cast<float>(high << 13 | (gen() & 0x1fffu)));
  }
  for (std::uint32_t high = 0; high < (1u << 16); ++high)
    for (std::uint32_t low : bf16_low) src.push_back(std::bit_cast<float>(high << 16 ^ low));
  for (int k = 0; k < 100000; ++k) {
    const std::uint32_t payload = (gen() & 0x7fffffu) | 1u;  // never 0: that is inf
    src.push_back(std::bit_cast<float>((gen() & 0x80000000u) | 0x7f800000u | payload));
    src.push_back(std::bit_cast<float>(gen()));
  }
  for (std::size_t offset : {0, 3}) {
    CAPTURE(offset);
    const std::size_t n = src.size() - offset - 5;
    std::vector<sk::Half> halves(n);
    std::vector<sk::BFloat16> bf16s(n);
    sk::detail::convert_run(src.data() + offset, halves.data(), static_cast<std::int64_t>(n));
    sk::detail::convert_run(src.data() + offset, bf16s.data(), static_cast<std::int64_t>(n));
    for (std::size_t i = 0; i < n; ++i) {
      const float value = src[offset + i];
      if (halves[i].bits != sk::float_to_half_bits(value) ||
          bf16s[i].bits != sk::float_to_bf16_bits(value)) {
        CAPTURE(std::bit_cast<std::uint32_t>(value));
        REQUIRE(halves[i].bits == sk::float_to_half_bits(value));
        REQUIRE(bf16s[i].bits == sk::float_to_bf16_bits(value));
      }
    }
  }
#if defined(__F16C__)
  CHECK(SK_F16C == 1);  // a build that targets F16C (-march=x86-64-v3) takes that path
#endif
#if defined(__AVX2__)
  CHECK(SK_BF16_AVX2 == 1);
#endif
}

// convert_run from f16 to f32 (vcvtph2ps where the build targets F16C, with signalling NaNs kept
// signalling) against half_bits_to_float for all 65536 patterns, from two offsets.
TEST_CASE("runs of f16 -> f32 conversions give half_bits_to_float's bits for all patterns") {
  std::vector<sk::Half> src;
  for (std::uint32_t h = 0; h < 65536; ++h)
    src.push_back(sk::Half::from_bits(static_cast<std::uint16_t>(h)));
  for (std::size_t offset : {0, 5}) {
    const std::size_t n = src.size() - offset;
    std::vector<float> out(n);
    sk::detail::convert_run(src.data() + offset, out.data(), static_cast<std::int64_t>(n));
    std::int64_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      wrong += std::bit_cast<std::uint32_t>(out[i]) !=
               std::bit_cast<std::uint32_t>(sk::half_bits_to_float(src[offset + i].bits));
    CHECK(wrong == 0);
  }
}
