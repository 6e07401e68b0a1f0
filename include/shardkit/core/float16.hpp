// Half (IEEE binary16) and BFloat16 storage types with round-to-nearest-even conversions.
//
// The conversions are plain integer code so that they give the same bits on every host and in
// device code; kernels may use the hardware instructions instead, which tests prove bit-equal.
#pragma once

#include <cstdint>
#include <cstring>

#include "shardkit/core/config.hpp"

namespace shardkit {

SK_HOST_DEVICE SK_INLINE std::uint32_t float_to_bits(float value) {
#if SK_DEVICE_CODE
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

SK_HOST_DEVICE SK_INLINE float bits_to_float(std::uint32_t bits) {
#if SK_DEVICE_CODE
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// float -> binary16 bits, round to nearest, ties to even; overflow -> inf; NaN stays NaN (quiet,
// sign and top payload bits kept).
SK_HOST_DEVICE SK_INLINE std::uint16_t float_to_half_bits(float value) {
  std::uint32_t x = float_to_bits(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // inf or NaN
    if (x == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  if (x >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (x < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (x <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25 ties to 0
    const std::uint32_t exponent = x >> 23;
    const std::uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24: value = mantissa >> shift halves
    std::uint32_t result = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits; a carry
  // rolls into the exponent, which is exactly right (up to inf for the largest values).
  const std::uint32_t rebased = x - 0x38000000u;
  std::uint32_t result = rebased >> 13;
  const std::uint32_t rest = rebased & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

// binary16 bits -> float (exact: every half is a float).
SK_HOST_DEVICE SK_INLINE float half_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  std::uint32_t exponent = (half >> 10) & 0x1fu;
  std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal: normalise. value = mantissa * 2^-24.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    return bits_to_float(sign | (static_cast<std::uint32_t>(113 - shift) << 23) | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
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

// 2-byte storage types. Arithmetic goes through float: these are for storing and moving data.
struct Half {
  std::uint16_t bits = 0;

  Half() = default;
  SK_HOST_DEVICE explicit Half(float value) : bits(float_to_half_bits(value)) {}
  SK_HOST_DEVICE static Half from_bits(std::uint16_t raw) {
    Half h;
    h.bits = raw;
    return h;
  }
  SK_HOST_DEVICE explicit operator float() const { return half_bits_to_float(bits); }
  SK_HOST_DEVICE float to_float() const { return half_bits_to_float(bits); }
};

struct BFloat16 {
  std::uint16_t bits = 0;

  BFloat16() = default;
  SK_HOST_DEVICE explicit BFloat16(float value) : bits(float_to_bf16_bits(value)) {}
  SK_HOST_DEVICE static BFloat16 from_bits(std::uint16_t raw) {
    BFloat16 b;
    b.bits = raw;
    return b;
  }
  SK_HOST_DEVICE explicit operator float() const { return bf16_bits_to_float(bits); }
  SK_HOST_DEVICE float to_float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "16-bit types must be 2 bytes");

}  // namespace shardkit
