// Half (IEEE binary16) and BFloat16 storage types with round-to-nearest-even conversions.
//
// The conversions are plain integer code (and, for f16 subnormals, one exact or correctly rounded
// float addition) so that they give the same bits on every host and in device code; kernels may
// use the hardware instructions instead, which tests prove bit-equal.
#pragma once

#include <cstdint>

#include "shardkit/core/bits.hpp"
#include "shardkit/core/config.hpp"

namespace shardkit {

// `when ? a : b` as a mask, so that the conversions below stay branch-free: GCC if-converts the
// ternaries of a conversion only in part and then leaves the loop around it scalar; with masks a
// loop of conversions vectorises (16 per iteration with AVX2, 6x the integer cases' speed).
SK_HOST_DEVICE SK_INLINE std::uint32_t select_bits(bool when, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(when);
  return (a & mask) | (b & ~mask);
}

// float -> binary16 bits, round to nearest, ties to even; overflow -> inf; NaN stays NaN (quiet,
// sign and top payload bits kept). Every case is computed and the right one selected.
SK_HOST_DEVICE SK_INLINE std::uint16_t float_to_half_bits(float value) {
  const std::uint32_t x = float_to_bits(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t magnitude = x & 0x7fffffffu;
  // Normal halves: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to
  // nearest even (add 0xfff, plus 1 when the kept part is odd); a carry rolls into the
  // exponent, which is exactly right, up to inf for values from 65520 on.
  const std::uint32_t normal = (magnitude - 0x38000000u + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
  // Below 2^-14 (subnormal halves and zero): adding 0.5 puts 2^-24, the smallest subnormal
  // half, at the last mantissa bit of the sum, so the FPU's own round-to-nearest-even drops
  // exactly the bits a subnormal half cannot hold; the sum's mantissa is the half. (The sum is
  // a normal float and an f32 subnormal input rounds to 0 either way, so flush-to-zero and
  // denormals-are-zero modes change nothing; a non-default rounding mode would.) Other inputs
  // add 0 instead: no inf or NaN ever reaches the addition (under -ffinite-math-only that would
  // be undefined) and only a genuinely rounded subnormal raises the inexact flag.
  const std::uint32_t small = select_bits(magnitude < 0x38800000u, magnitude, 0u);
  const std::uint32_t subnormal = float_to_bits(bits_to_float(small) + 0.5f) - 0x3f000000u;
  const std::uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
  std::uint32_t result = select_bits(magnitude < 0x38800000u, subnormal, normal);
  result = select_bits(magnitude >= 0x477ff000u, 0x7c00u, result);  // >= 65520 and inf: inf
  result = select_bits(magnitude > 0x7f800000u, nan, result);
  return static_cast<std::uint16_t>(sign | result);
}

// binary16 bits -> float (exact: every half is a float). Branch-free as above.
SK_HOST_DEVICE SK_INLINE float half_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = half & 0x7c00u;
  const std::uint32_t shifted = static_cast<std::uint32_t>(half & 0x7fffu) << 13;
  const std::uint32_t normal = shifted + 0x38000000u;   // rebias the exponent 15 -> 127
  const std::uint32_t special = shifted | 0x7f800000u;  // inf, NaN with its payload as it is
  // Subnormal halves, mantissa * 2^-24: as the float 2^-14 + mantissa * 2^-24 (the bits with
  // the smallest normal half's exponent) less 2^-14, which is exact (other halves subtract
  // 2^-14 from itself, so no addition ever rounds).
  const std::uint32_t small = select_bits(exponent == 0, shifted, 0u);
  const std::uint32_t subnormal =
      float_to_bits(bits_to_float(small + 0x38800000u) - bits_to_float(0x38800000u));
  std::uint32_t result = select_bits(exponent == 0x7c00u, special, normal);
  result = select_bits(exponent == 0, subnormal, result);
  return bits_to_float(sign | result);
}

// float -> bfloat16 bits, round to nearest, ties to even; NaN stays NaN (quiet).
SK_HOST_DEVICE SK_INLINE std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t x = float_to_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

SK_HOST_DEVICE SK_INLINE float bf16_bits_to_float(std::uint16_t bf16) {
  return bits_to_float(static_cast<std::uint32_t>(bf16) << 16);
}

// The two 2-byte formats' conversions, named for Float16Storage.
struct HalfFormat {
  SK_HOST_DEVICE static std::uint16_t encode(float value) { return float_to_half_bits(value); }
  SK_HOST_DEVICE static float decode(std::uint16_t bits) { return half_bits_to_float(bits); }
};
struct BFloat16Format {
  SK_HOST_DEVICE static std::uint16_t encode(float value) { return float_to_bf16_bits(value); }
  SK_HOST_DEVICE static float decode(std::uint16_t bits) { return bf16_bits_to_float(bits); }
};

// 2-byte storage types. Arithmetic goes through float: these are for storing and moving data.
template <class Format>
struct Float16Storage {
  std::uint16_t bits = 0;

  Float16Storage() = default;
  SK_HOST_DEVICE explicit Float16Storage(float value) : bits(Format::encode(value)) {}
  SK_HOST_DEVICE static Float16Storage from_bits(std::uint16_t raw) {
    Float16Storage value;
    value.bits = raw;
    return value;
  }
  SK_HOST_DEVICE explicit operator float() const { return Format::decode(bits); }
  SK_HOST_DEVICE float to_float() const { return Format::decode(bits); }
};

using Half = Float16Storage<HalfFormat>;
using BFloat16 = Float16Storage<BFloat16Format>;

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "16-bit types must be 2 bytes");

}  // namespace shardkit
