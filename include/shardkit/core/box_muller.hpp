// The two elementary functions of Box-Muller -- log(u) and cos(2 pi u) for u in (0, 1) -- written
// out in double arithmetic that every IEEE machine rounds alike: each product that meets a sum is
// an explicit fma, nothing else is left to the compiler to contract, and the reductions are exact.
// So the host and the device compute the same bits for a normal fill (libm's and CUDA's log and
// cos differ in the last bit now and then), and a loop of them vectorises: no calls, no branches,
// no tables (g++ turns the selects into blends).
//
// Accuracy, against long double references (tests/core/test_philox.cpp): log within 1 ulp,
// cos(2 pi u) within 2^-53 absolute. Both are short Taylor series where the reduced argument is
// small enough that the first dropped term is below half an ulp.
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/core/bits.hpp"
#include "shardkit/core/config.hpp"

namespace shardkit::detail {

// The polynomial with these coefficients (the highest power's first) at z, by Horner's rule:
// one fma a coefficient, in this order, so every machine rounds it alike.
template <class... Rest>
SK_HOST_DEVICE SK_INLINE double horner(double z, double highest, Rest... rest) {
  double p = highest;
  ((p = fma(p, z, rest)), ...);
  return p;
}

// log(x) for a positive, finite, normal x.
SK_HOST_DEVICE SK_INLINE double log_of_positive(double x) {
  // x = 2^e * m with m in [sqrt(1/2), sqrt(2)), so that f = m - 1 (exact) stays within 0.42 of
  // zero: subtracting sqrt(1/2)'s bits from x's borrows from the exponent field exactly when x's
  // mantissa lies below sqrt(2) (e = x's exponent), and not otherwise (e one higher, m halved).
  // In integer arithmetic only, so that a loop of it has no branch or select; e + 1024 lies in
  // the field's 11 bits and becomes a double exactly as the low bits of 2^52.
  const std::uint64_t bits = double_to_bits(x);
  const std::uint64_t e_field = (bits - 0x3FE6A09E667F3BCDull + (1024ull << 52)) >> 52;
  const double m = bits_to_double(bits - (e_field << 52) + (1024ull << 52));
  const double e = bits_to_double(e_field | 0x4330000000000000ull) - (0x1p52 + 1024.0);
  const double f = m - 1.0;
  // log(1 + f) = 2 atanh(s) with s = f / (2 + f), |s| < 0.1716: 2 atanh(s) = 2s + s R(s^2),
  // R(z) = sum_k 2 z^k / (2k + 1), and since 2s = f - s f, log(1 + f) = f - (f^2/2 - s (f^2/2 +
  // R)), where the rounding errors fall on the small correction. Terms to z^9: the next is below
  // 2^-55 of the result.
  const double s = f / (2.0 + f);
  const double z = s * s;
  const double p = horner(z, 2.0 / 19.0, 2.0 / 17.0, 2.0 / 15.0, 2.0 / 13.0, 2.0 / 11.0, 2.0 / 9.0,
                          2.0 / 7.0, 2.0 / 5.0, 2.0 / 3.0);
  const double half_f_squared = (0.5 * f) * f;
  const double log_m = f - fma(-s, fma(p, z, half_f_squared), half_f_squared);
  // + e ln 2, with ln 2 in two parts (the fma takes e times the high part exactly).
  return fma(e, 0x1.62e42fefa39efp-1, fma(e, 0x1.abc9e3b39803fp-56, log_m));
}

// cos(2 pi u) for u in [0, 1], u a multiple of 2^-40 or coarser (a word_to_unit value is).
SK_HOST_DEVICE SK_INLINE double cos_two_pi(double u) {
  // u = n/4 + r with n the nearest quarter turn and |r| <= 1/8: 4u + 2^52 rounds 4u to an
  // integer (no floor: g++ vectorises floor only without trapping math), and both steps are
  // exact for such u.
  const double rounded = fma(u, 4.0, 0x1p52);
  const double n = rounded - 0x1p52;
  const double r = fma(n, -0.25, u);
  // t = 2 pi r (2 pi in two parts), |t| <= pi/4, then cos t and sin t by Taylor series: with
  // t^2 <= 0.62 the first terms left out (t^18 / 18!, t^19 / 19!) are below 2^-58.
  const double t = fma(r, 0x1.921fb54442d18p+2, r * 0x1.1a62633145c07p-52);
  const double z = t * t;
  // cos t = 1 - z (1/2! - z/4! + ... - z^7/16!), sin t = t + t z (-1/3! + z/5! - ... + z^7/17!).
  const double c = horner(z, -1.0 / 20922789888000.0, 1.0 / 87178291200.0, -1.0 / 479001600.0,
                          1.0 / 3628800.0, -1.0 / 40320.0, 1.0 / 720.0, -1.0 / 24.0, 0.5);
  const double cosine = fma(-z, c, 1.0);
  const double s =
      horner(z, 1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0,
             -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0);
  const double sine = fma(t * z, s, t);
  // cos(t + q pi/2) for the quarter q = n mod 4: cos t, -sin t, -cos t, sin t; picked and signed
  // with integer masks (the low bits of `rounded` are n's), not selects the vectoriser would
  // stop at.
  const std::uint64_t q = double_to_bits(rounded) & 3u;
  const std::uint64_t take_sine = 0 - (q & 1u);      // all ones for q = 1, 3
  const std::uint64_t sign = ((q + 1u) & 2u) << 62;  // the sign bit for q = 1, 2
  return bits_to_double(
      ((double_to_bits(sine) & take_sine) | (double_to_bits(cosine) & ~take_sine)) ^ sign);
}

}  // namespace shardkit::detail
