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
// The same blocks may carry FP8 E4M3 (OCP's e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits,
// no infinities, 448 the largest finite value) instead of int8 (QuantFormat::f8_e4m3): scale_b =
// amax_b / 448, q = e4m3(x * (448 / amax_b)) rounded to nearest even (saturating at 448), and
// x' = value(q) * scale_b. A floating code keeps small values of a block relative, not absolute:
// |x - x'| <= max(|x| / 16, scale_b / 1024) up to f32 rounding (normal codes keep 3 mantissa
// bits; below 2^-6 the subnormal codes step by 2^-9).
//
// Or int4 (QuantFormat::int4, qgZ's narrower wire, as DeepSpeed's ZeRO++ quantises gradients):
// scale_b = amax_b / 7, q = round-half-even(x * (7 / amax_b)) in [-7, 7], two codes to a byte
// (the even element in the low nibble, two's complement), |x - x'| <= scale_b / 2 as for int8
// but with a step 18 times as coarse. A block must hold an even number of values, so that every
// block starts on a byte.
//
// One run's payload, as the wire moves it: [scale_b: f32 x blocks][q: n bytes, or (n + 1) / 2
// for int4], padded to a multiple of 16 bytes, so that runs laid end to end keep their scales
// aligned.
//
// Per-tensor scales (QuantScale::tensor; FSDP2's float8 all-gather): one scale per slot -- a
// whole parameter, wherever its elements lie -- instead of per block: amax_t = the largest |x|
// of the slot on every rank (each rank's maximum of its piece, then an all-reduce of the
// maxima), scale_t = amax_t / kMax, and each value's code as above with the slot's scale. The
// wire then carries the codes alone (every rank knows the scales), padded to 16 bytes per run.
// A run is cut into chunks of at most kSlotChunk values, each inside one slot (slot_chunks);
// the chunk table -- rows {first, size, slot}, first counted from the run's start -- lives on
// the device with the run, so that a launch needs no host work per tensor. One byte per code:
// int8 or E4M3 (a floating code keeps a tensor's small values relative, which is why FSDP2
// scales float8 per tensor; int8's uniform steps would flush them to 0).
//
// Every step is IEEE f32 arithmetic that no compiler may contract (a division,
// products rounded to integers or stored), so the host and the device give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "shardkit/core/bits.hpp"
#include "shardkit/core/config.hpp"
#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/ops/element.hpp"

namespace shardkit::ops {

// Values per scale of DeepSpeed's qwZ (and this format's default).
inline constexpr std::int64_t kDefaultQuantBlock = 256;
// The largest block the format takes (2^24 values per scale).
inline constexpr std::int64_t kMaxQuantBlock = std::int64_t{1} << 24;

// What a block's codes are.
enum class QuantFormat : std::uint8_t { int8, f8_e4m3, int4 };

inline constexpr EnumName<QuantFormat> kQuantFormatNames[] = {
    {QuantFormat::int8, "int8"}, {QuantFormat::f8_e4m3, "f8_e4m3"}, {QuantFormat::int4, "int4"}};

constexpr std::string_view quant_format_name(QuantFormat format) {
  return name_of(format, kQuantFormatNames);
}

// What a scale covers: a block of `block` values, or a whole tensor (a slot).
enum class QuantScale : std::uint8_t { block, tensor };

inline constexpr EnumName<QuantScale> kQuantScaleNames[] = {{QuantScale::block, "block"},
                                                            {QuantScale::tensor, "tensor"}};

constexpr std::string_view quant_scale_name(QuantScale scale) {
  return name_of(scale, kQuantScaleNames);
}

// Values per chunk of a per-tensor-scaled run at most (a launch's thread block each on a GPU).
inline constexpr std::int64_t kSlotChunk = 8192;

// Bits per value of a format's codes.
constexpr int quant_code_bits(QuantFormat format) { return format == QuantFormat::int4 ? 4 : 8; }

// Whether `format` takes blocks of `block` values: int4 packs two codes to a byte and a block
// must start on one, so its blocks are even.
constexpr bool quant_block_fits(QuantFormat format, std::int64_t block) {
  return quant_code_bits(format) == 8 || block % 2 == 0;
}

constexpr std::int64_t quant_block_count(std::int64_t n, std::int64_t block) {
  return (n + block - 1) / block;
}

// Bytes of one run's codes, and of its payload (scales, codes, padding to 16).
constexpr std::int64_t quant_code_bytes(std::int64_t n, QuantFormat format = QuantFormat::int8) {
  return quant_code_bits(format) == 4 ? (n + 1) / 2 : n;
}
constexpr std::int64_t quant_payload_bytes(std::int64_t n, std::int64_t block,
                                           QuantFormat format = QuantFormat::int8) {
  return (4 * quant_block_count(n, block) + quant_code_bytes(n, format) + 15) / 16 * 16;
}

// A per-tensor-scaled run of n codes on the wire: the codes padded to 16 bytes.
constexpr std::int64_t quant_codes_payload_bytes(std::int64_t n) { return (n + 15) / 16 * 16; }

// A slot of a flat buffer: elements [begin, end) share one scale, slot `slot`'s.
struct SlotRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t slot = 0;
};

// The chunk table of the run [begin, end) of a buffer covered by `ranges` (sorted, not
// overlapping; elements outside every range are not in the table): rows {first - begin, size,
// slot}, each at most kSlotChunk values, in order, flattened.
inline std::vector<std::int64_t> slot_chunks(const std::vector<SlotRange>& ranges,
                                             std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> rows;
  for (const SlotRange& r : ranges) {
    check(r.begin <= r.end && r.slot >= 0, "slot_chunks: range [", r.begin, ", ", r.end,
          ") of slot ", r.slot, " is not a range of a slot");
    for (std::int64_t at = std::max(r.begin, begin), stop = std::min(r.end, end); at < stop;
         at += kSlotChunk)
      rows.insert(rows.end(), {at - begin, std::min(kSlotChunk, stop - at), r.slot});
  }
  return rows;
}

// Wire bytes per value, padding aside: the codes and a block's f32 scale shared by its values
// (what the memory and traffic plans count).
constexpr double quant_bytes_per_value(std::int64_t block, QuantFormat format) {
  return quant_code_bits(format) / 8.0 + 4.0 / static_cast<double>(block);
}

// The running |x| maximum; a NaN, once seen, stays.
SK_HOST_DEVICE SK_INLINE float abs_max(float running, float x) {
  const float a = fabsf(x);
  return (a > running || a != a) ? a : running;
}

// |x|'s bits. Non-negative floats order as their bits do, and every NaN's bits lie above
// infinity's, so the largest of these over a run is abs_max's verdict read as bits (a NaN if
// any value was one) -- an integer maximum, which the CPU loops vectorise where abs_max's float
// comparisons keep them scalar.
SK_HOST_DEVICE SK_INLINE std::uint32_t abs_bits(float x) { return float_to_bits(x) & 0x7fffffffu; }

// x · inverse_step as an integer code in [-max, max]: the product rounded to f32, then to the
// nearest integer, ties to even (rintf in the default rounding mode: one instruction on
// x86-64-v3 and on the GPU). An add would not do: compilers may fuse a product into the add
// that follows it (an FMA), which rounds once instead of twice. 0 for a NaN (inf x 0 on a
// non-finite block). The int8 and int4 codes' rounding.
SK_HOST_DEVICE SK_INLINE int round_to_code(float x, float inverse_step, float max) {
  float y = rintf(x * inverse_step);
  y = y > max ? max : (y < -max ? -max : y);
  return y == y ? static_cast<int>(y) : 0;
}

SK_HOST_DEVICE SK_INLINE std::int8_t int8_quantize(float x, float inverse_step) {
  return static_cast<std::int8_t>(round_to_code(x, inverse_step, 127.0f));
}

// (mul_rn: the product rounded on its own, so that a dequantise-and-add rounds twice, as a
// dequantise then an add does, even where nvcc would fuse them.)
SK_HOST_DEVICE SK_INLINE float int8_dequantize(std::int8_t q, float scale) {
  return mul_rn(static_cast<float>(q), scale);
}

// The largest finite E4M3 value, and the code of a NaN (S.1111.111; e4m3fn has no infinities).
inline constexpr float kE4m3Max = 448.0f;
inline constexpr std::uint8_t kE4m3Nan = 0x7f;

// y (already scaled into [-448, 448]; larger magnitudes saturate) as an E4M3 code, rounded to
// nearest even. Integer work on y's bits, no branch (the CPU loops vectorise it, as they did not
// through frexpf/ldexpf; bench_ops' BM_quantize_blocks times it), and exact, so the host and the
// device give the same code:
// - normal codes (|y| >= 2^-6) round y's 23-bit mantissa to 3 bits by adding half a step less
//   one plus the kept bits' last bit (ties to even); a carry moves up the exponent, as rounding
//   up to the next power of two must, and the exponent's bias moves from 127 to 7;
// - subnormal codes (steps of 2^-9) are |y| x 512 rounded to an integer, which adding 2^23
//   does in the sum's low bits;
// - 448 and above saturate to 448 (round to nearest even would take (448, 464) there too); a
//   NaN is the NaN code; -0 and values that round to 0 keep the sign of y < 0.
SK_HOST_DEVICE SK_INLINE std::uint8_t e4m3_encode(float y) {
  const std::uint32_t raw = float_to_bits(y);
  const std::uint32_t bits = abs_bits(y);
  const std::uint32_t normal = ((bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20) - (120u << 3);
  const std::uint32_t subnormal =
      float_to_bits(mul_rn(bits_to_float(bits), 512.0f) + 0x1p23f) & 0xfu;
  std::uint32_t code = pick_bits(bits < float_to_bits(0x1p-6f), subnormal, normal);
  code = pick_bits(bits >= float_to_bits(kE4m3Max), 0x7eu, code);
  code |= pick_bits(raw > 0x80000000u, 0x80u, 0u);  // y < 0 (-0 is not)
  return static_cast<std::uint8_t>(pick_bits(bits > 0x7f800000u, kE4m3Nan, code));
}

// A code's value, built from its bits (exact; the same on the host and the device).
SK_HOST_DEVICE SK_INLINE float e4m3_value(std::uint8_t code) {
  const std::uint32_t c = code, exponent = (c >> 3) & 0xfu, mantissa = c & 7u;
  const std::uint32_t normal = ((exponent + 120u) << 23) | (mantissa << 20);
  const std::uint32_t subnormal = float_to_bits(static_cast<float>(mantissa) * 0x1p-9f);
  const std::uint32_t bits = pick_bits(exponent == 0, subnormal, normal) | ((c & 0x80u) << 24);
  return bits_to_float(pick_bits((c & 0x7fu) == 0x7fu, 0x7fc00000u, bits));  // S.1111.111: NaN
}

// The codes as the kernels see them: the largest code magnitude, codes per byte, a value's code
// for an inverse step, and a code's value for a scale.
struct Int8Code {
  static constexpr float kMax = 127.0f;
  static constexpr int kPerByte = 1;
  SK_HOST_DEVICE SK_INLINE static std::uint8_t encode(float x, float inverse_step) {
    return static_cast<std::uint8_t>(int8_quantize(x, inverse_step));
  }
  SK_HOST_DEVICE SK_INLINE static float decode(std::uint8_t q, float scale) {
    return int8_dequantize(static_cast<std::int8_t>(q), scale);
  }
};

struct E4m3Code {
  static constexpr float kMax = kE4m3Max;
  static constexpr int kPerByte = 1;
  SK_HOST_DEVICE SK_INLINE static std::uint8_t encode(float x, float inverse_step) {
    // A NaN product -- 0 x inf when a block's amax is so small that 448 / amax overflows, or a
    // non-finite block's x x 0 -- is code 0, as int8_quantize makes it 0: a non-finite block
    // still comes back NaN through its scale (inf or NaN), a tiny one comes back finite.
    const float y = x * inverse_step;
    return static_cast<std::uint8_t>(pick_bits(abs_bits(y) > 0x7f800000u, 0u, e4m3_encode(y)));
  }
  SK_HOST_DEVICE SK_INLINE static float decode(std::uint8_t q, float scale) {
    return mul_rn(e4m3_value(q), scale);
  }
};

// A 4-bit two's complement code in a byte's low nibble (the kernels pack two to a byte).
struct Int4Code {
  static constexpr float kMax = 7.0f;
  static constexpr int kPerByte = 2;
  SK_HOST_DEVICE SK_INLINE static std::uint8_t encode(float x, float inverse_step) {
    return static_cast<std::uint8_t>(round_to_code(x, inverse_step, kMax) & 0xf);
  }
  SK_HOST_DEVICE SK_INLINE static float decode(std::uint8_t q, float scale) {
    return mul_rn(static_cast<float>(((q & 0xf) ^ 8) - 8), scale);  // sign-extended
  }
};

// Value i's code in a run's codes (Code::kPerByte to a byte, the even value in the low nibble).
template <class Code>
SK_HOST_DEVICE SK_INLINE std::uint8_t code_at(const std::uint8_t* q, std::int64_t i) {
  if constexpr (Code::kPerByte == 1)
    return q[i];
  else
    return static_cast<std::uint8_t>(q[i >> 1] >> ((i & 1) * 4)) & 0xf;
}

// The stored scale, amax / kMax; a NaN amax gives the one quiet NaN 0x7fc00000 on both devices
// (x86's division passes the input NaN's payload on, the GPU's gives its own NaN: the payload's
// scale bytes would differ). A non-finite block's decoded values are NaN on both devices, their
// payloads each device's own.
template <class Code>
SK_HOST_DEVICE SK_INLINE float block_scale(float amax) {
  return amax == amax ? amax / Code::kMax : bits_to_float(0x7fc00000u);
}

// kMax / amax for a finite, non-zero amax; else 0 (every q of the block is then 0, and the scale
// -- 0, inf or NaN -- decides what comes back: zeros, or NaN for a non-finite block).
template <class Code>
SK_HOST_DEVICE SK_INLINE float inverse_step(float amax) {
  return (amax > 0.0f && amax <= 0x1.fffffep127f) ? Code::kMax / amax : 0.0f;
}

// f(Code) for the format's code type.
template <class F>
decltype(auto) visit_quant_format(QuantFormat format, F&& f) {
  switch (format) {
    case QuantFormat::int8:
      return f.template operator()<Int8Code>();
    case QuantFormat::f8_e4m3:
      return f.template operator()<E4m3Code>();
    case QuantFormat::int4:
      return f.template operator()<Int4Code>();
  }
  fail<InvalidArgument>("quantisation format ", static_cast<int>(format), " is not known");
}

}  // namespace shardkit::ops
