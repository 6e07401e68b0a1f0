// Block quantisation to int8, the format of the quantised parameter all-gather (DeepSpeed
// ZeRO++'s qwZ; docs/semantics.md, "Quantised all-gather"). A run of n values (f32, f16 or
// bf16) is cut into blocks of `block` values, the last one shorter. Block b keeps
//
//   amax_b = the largest |x| of the block (NaN when the block holds a NaN)
//   scale_b = amax_b / 127                          (f32)
//   q = round-half-even(x * (127 / amax_b)), an int8 in [-127, 127]; 0 when amax_b is 0
//
// and a value comes back as x' = q * scale_b (f32, then rounded once to the destination's dtype):
// |x - x'| <= scale_b / 2 up to f32 rounding (tests/ops/quantize_cases.hpp holds it against a
// float64 reference). A block with an inf or a NaN comes back all NaN: a non-finite parameter
// stays visible, never a finite value in disguise.
//
// One run's payload, as the all-gather moves it: [scale_b: f32 x blocks][q: int8 x n], padded to
// a multiple of 16 bytes, so that runs laid end to end keep their scales aligned. Every step is
// IEEE f32 arithmetic that no compiler may contract (a division, products rounded to integers
// or stored), so the host and the device give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/core/config.hpp"
#include "shardkit/ops/element.hpp"

namespace shardkit::ops {

// Values per scale of DeepSpeed's qwZ (and this format's default).
inline constexpr std::int64_t kDefaultQuantBlock = 256;
// The largest block the format takes (2^24 values per scale).
inline constexpr std::int64_t kMaxQuantBlock = std::int64_t{1} << 24;

constexpr std::int64_t int8_block_count(std::int64_t n, std::int64_t block) {
  return (n + block - 1) / block;
}

// Bytes of one run's payload (scales, values, padding to 16).
constexpr std::int64_t int8_payload_bytes(std::int64_t n, std::int64_t block) {
  return (4 * int8_block_count(n, block) + n + 15) / 16 * 16;
}

// The running |x| maximum; a NaN, once seen, stays.
SK_HOST_DEVICE SK_INLINE float abs_max(float running, float x) {
  const float a = fabsf(x);
  return (a > running || a != a) ? a : running;
}

// 127 / amax for a finite, non-zero amax; else 0 (every q of the block is then 0, and the scale
// -- 0, inf or NaN -- decides what comes back: zeros, or NaN for a non-finite block).
SK_HOST_DEVICE SK_INLINE float int8_inverse_step(float amax) {
  return (amax > 0.0f && amax <= 0x1.fffffep127f) ? 127.0f / amax : 0.0f;
}

SK_HOST_DEVICE SK_INLINE std::int8_t int8_quantize(float x, float inverse_step) {
  // The product rounded to f32, then to the nearest integer, ties to even (rintf in the default
  // rounding mode: one instruction on x86-64-v3 and on the GPU). An add would not do: compilers
  // may fuse a product into the add that follows it (an FMA), which rounds once instead of twice.
  float y = rintf(x * inverse_step);
  y = y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y);
  return y == y ? static_cast<std::int8_t>(y) : std::int8_t{0};  // (inf x 0 on a NaN block)
}

SK_HOST_DEVICE SK_INLINE float int8_dequantize(std::int8_t q, float scale) {
  return static_cast<float>(q) * scale;
}

}  // namespace shardkit::ops
