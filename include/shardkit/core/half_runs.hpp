// Runs of f32 -> f16, f32 -> bf16 and f16 -> f32 conversions, eight or sixteen at a time with
// F16C and AVX2 where the host compiler targets them (x86-64-v3 builds do).
//
// float_to_half_bits (float16.hpp) computes every case of a conversion and selects one, so a
// loop of it vectorises, but its dozen integer operations per element left the f16 cast at
// about 70% of the bf16 cast's rate (bench_ops and bench_core on the Xeon VM), whose rounding
// is one addition. vcvtps2ph, with round-to-nearest-even given in the instruction (not taken
// from MXCSR), rounds as float_to_half_bits does in the default rounding mode, overflows to
// inf alike, and keeps a NaN's sign and top payload bits with the quiet bit set, as
// float_to_half_bits does: the same bits for every input (the test covers every exponent and
// sign with the rounding boundaries of the dropped bits, and NaNs). f32 subnormals round to
// zero either way, so MXCSR's denormals-are-zero changes nothing. Unlike the integer code, the
// instruction raises the floating-point flags (overflow, underflow, inexact, invalid on a
// signalling NaN): a program that traps FE_OVERFLOW sees the trap on a cast of 65520 or more.
//
// bf16: GCC vectorises float_to_bf16_bits' loop too; the lanes below take fewer instructions
// (the NaN case as a mask on the rounding bias; one pack and one permute narrow sixteen lanes),
// the same arithmetic: 14.9 -> 13.2 ms on one thread over ResNet-50's tensors (bench_ops).
//
// f16 -> f32 with vcvtph2ps is exact as half_bits_to_float is, except that the instruction
// quiets a signalling NaN where half_bits_to_float keeps its bits: those lanes get the quiet bit
// (bit 22) cleared again, so the result is half_bits_to_float's for every pattern (the test
// runs all 65536).
#pragma once

#include <cstdint>

#include "shardkit/core/float16.hpp"

// Intrinsics for the host compiler only, as in transpose_blocks.hpp.
#if defined(__F16C__) && defined(__AVX2__) && !defined(__CUDACC__)
#define SK_F16C 1
#else
#define SK_F16C 0
#endif
#if defined(__AVX2__) && !defined(__CUDACC__)
#define SK_BF16_AVX2 1
#else
#define SK_BF16_AVX2 0
#endif
#if SK_F16C || SK_BF16_AVX2
#include <immintrin.h>
#endif

namespace shardkit::detail {

// convert_run(src, dst, n): dst[i] = To(src[i]) for i in [0, n), one overload per pair of
// element types with a run (has_convert_run says which); callers dispatch on it.

// f32 -> f16.
inline void convert_run(const float* src, Half* dst, std::int64_t n) {
  std::int64_t i = 0;
#if SK_F16C
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    // (storeu: an unaligned store through a type that may alias Half)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), halves);
  }
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

// f16 -> f32.
inline void convert_run(const Half* src, float* dst, std::int64_t n) {
  std::int64_t i = 0;
#if SK_F16C
  const __m256i exponent = _mm256_set1_epi32(0x7c00), quiet = _mm256_set1_epi32(0x200);
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i h = _mm256_cvtepu16_epi32(halves);
    // A signalling NaN: exponent all ones, quiet bit clear, some other mantissa bit set.
    const __m256i all_ones = _mm256_cmpeq_epi32(_mm256_and_si256(h, exponent), exponent);
    const __m256i not_quiet =
        _mm256_cmpeq_epi32(_mm256_and_si256(h, quiet), _mm256_setzero_si256());
    const __m256i some_bit = _mm256_xor_si256(
        _mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x1ff)), _mm256_setzero_si256()),
        _mm256_set1_epi32(-1));
    const __m256i signalling = _mm256_and_si256(all_ones, _mm256_and_si256(not_quiet, some_bit));
    const __m256i bits =
        _mm256_andnot_si256(_mm256_and_si256(signalling, _mm256_set1_epi32(1 << 22)),
                            _mm256_castps_si256(_mm256_cvtph_ps(halves)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bits);
  }
#endif
  for (; i < n; ++i) dst[i] = src[i].to_float();
}

#if SK_BF16_AVX2
// float_to_bf16_bits of eight floats, in the low 16 bits of each 32-bit lane: x + 0x7fff + odd
// rounds to nearest even; a NaN adds nothing (its top bits stay) and gets the quiet bit. NaNs
// are found by comparing the bits as integers, as float_to_bf16_bits does, so no floating-point
// flag is raised (a float compare would flag a signalling NaN as invalid).
inline __m256i bf16_bits_in_lanes(__m256i x) {
  // |x| above inf's bits (a signed compare is right: both sides are below 2^31).
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_andnot_si256(nan, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
  return _mm256_or_si256(rounded, _mm256_and_si256(nan, _mm256_set1_epi32(0x40)));
}
#endif

// f32 -> bf16.
inline void convert_run(const float* src, BFloat16* dst, std::int64_t n) {
  std::int64_t i = 0;
#if SK_BF16_AVX2
  for (; i + 16 <= n; i += 16) {
    const __m256i low =
        bf16_bits_in_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m256i high =
        bf16_bits_in_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
    // packus narrows per 128-bit half (values fit in 16 bits, so nothing saturates): the
    // permute puts the four 64-bit groups back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
#endif
  for (; i < n; ++i) dst[i] = BFloat16(src[i]);
}

// Whether convert_run has an overload from From to To.
template <class From, class To>
inline constexpr bool has_convert_run = requires(const From* src, To* dst) {
  convert_run(src, dst, std::int64_t{0});
};

}  // namespace shardkit::detail
