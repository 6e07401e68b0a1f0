// Runs of f32 -> f16 conversions, eight at a time with the F16C instruction where the host
// compiler targets it (x86-64-v3 builds do).
//
// float_to_half_bits (float16.hpp) computes every case of a conversion and selects one, so a
// loop of it vectorises, but a dozen integer operations per element left the cast at about half
// of the bf16 cast's rate, whose rounding is a single addition. vcvtps2ph with its rounding
// given as round-to-nearest-even in the instruction (not taken from MXCSR) rounds exactly as
// float_to_half_bits does, overflows to inf alike, and keeps a NaN's sign and top payload bits
// with the quiet bit set, as float_to_half_bits does: the same bits for every input (the test
// covers every exponent and sign with the rounding boundaries of the dropped bits, and NaNs).
// f32 subnormals round to zero either way, so MXCSR's denormals-are-zero changes nothing.
//
// (The other way, vcvtph2ps quiets a signalling NaN where half_bits_to_float keeps its bits, so
// f16 -> f32 stays with the vectorised portable loop, which already runs near copy speed.)
#pragma once

#include <cstdint>

#include "shardkit/core/float16.hpp"

// Intrinsics for the host compiler only, as in transpose_blocks.hpp.
#if defined(__F16C__) && defined(__AVX__) && !defined(__CUDACC__)
#define SK_F16C 1
#include <immintrin.h>
#else
#define SK_F16C 0
#endif

namespace shardkit::detail {

// dst[i] = Half(src[i]) for i in [0, n).
inline void floats_to_halves(const float* src, Half* dst, std::int64_t n) {
  std::int64_t i = 0;
#if SK_F16C
  static_assert(sizeof(Half) == 2, "Half is its 16 bits");
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     halves);  // (an unaligned, may-alias store)
  }
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

}  // namespace shardkit::detail
