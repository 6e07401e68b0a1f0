// Sixteen consecutive Philox4x32-10 blocks at once, on the host: what a contiguous random fill
// draws. With AVX2 each eight counters run in the lanes of four 256-bit registers (the two
// 32 x 32 -> 64-bit products of a round take two vpmuludq each, on the even and the odd lanes),
// about 4x philox_block one block at a time (bench_core's uniform_); the words are the same as
// philox_block's, bit for bit.
#pragma once

#include <cstdint>

#include "shardkit/core/philox.hpp"

// (Intrinsics for the host compiler only, as in transpose_blocks.hpp: nvcc's passes take the
// loop of philox_block, which gives the same words.)
#if defined(__AVX2__) && !defined(__CUDACC__)
#define SK_PHILOX_AVX2 1
#include <immintrin.h>
#else
#define SK_PHILOX_AVX2 0
#endif

namespace shardkit::detail {

// Blocks per batch: two groups of eight lanes, whose rounds are independent, so the core overlaps
// one group's multiplies with the other's (one group alone waits on each round's latency).
inline constexpr std::uint64_t kPhiloxBatch = 16;

#if SK_PHILOX_AVX2
// Eight blocks' counters in the lanes of four registers: register w holds word w of each.
struct PhiloxLanes {
  __m256i c0, c1, c2, c3;
};

// The counters of blocks first .. first + 7. Lane j's low word is low(first) + j, and its high
// word gains 1 where that addition wrapped (the lane's low word then compares below low(first)).
SK_INLINE PhiloxLanes philox_lanes(std::uint64_t first) {
  const auto low = static_cast<std::uint32_t>(first);
  const __m256i bias = _mm256_set1_epi32(static_cast<int>(0x80000000u));  // unsigned compare
  const __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(low)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i wrapped =
      _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(low)), bias),
                         _mm256_xor_si256(c0, bias));  // -1 where wrapped
  const __m256i c1 = _mm256_sub_epi32(
      _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(first >> 32))), wrapped);
  return {c0, c1, _mm256_setzero_si256(), _mm256_setzero_si256()};
}

// One Philox4x32 round on eight blocks.
SK_INLINE void philox_round(PhiloxLanes& x, __m256i key0, __m256i key1) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  // 64-bit products of the even lanes, then of the odd ones (shifted down).
  const __m256i even0 = _mm256_mul_epu32(x.c0, mul0);
  const __m256i odd0 = _mm256_mul_epu32(_mm256_srli_epi64(x.c0, 32), mul0);
  const __m256i even1 = _mm256_mul_epu32(x.c2, mul1);
  const __m256i odd1 = _mm256_mul_epu32(_mm256_srli_epi64(x.c2, 32), mul1);
  const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
  const __m256i lo0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
  const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
  const __m256i lo1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
  // philox4x32_10's round: {hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0}.
  x = {_mm256_xor_si256(_mm256_xor_si256(hi1, x.c1), key0), lo1,
       _mm256_xor_si256(_mm256_xor_si256(hi0, x.c3), key1), lo0};
}

// Word w of lane j is in register w; interleaved so that each block's four words lie together.
SK_INLINE void store_blocks(const PhiloxLanes& x, std::uint32_t* words) {
  const __m256i t0 = _mm256_unpacklo_epi32(x.c0, x.c1), t1 = _mm256_unpackhi_epi32(x.c0, x.c1);
  const __m256i t2 = _mm256_unpacklo_epi32(x.c2, x.c3), t3 = _mm256_unpackhi_epi32(x.c2, x.c3);
  const __m256i b04 = _mm256_unpacklo_epi64(t0, t2), b15 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i b26 = _mm256_unpacklo_epi64(t1, t3), b37 = _mm256_unpackhi_epi64(t1, t3);
  auto* out = reinterpret_cast<__m256i*>(words);
  _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(b04, b15, 0x20));  // blocks 0, 1
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(b26, b37, 0x20));  // blocks 2, 3
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(b04, b15, 0x31));  // blocks 4, 5
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(b26, b37, 0x31));  // blocks 6, 7
}
#endif

// words[4 * j + w] = philox_block(seed, first + j).v[w] for j < kPhiloxBatch: the blocks' words
// in the order a fill consumes them.
inline void philox_batch(std::uint64_t seed, std::uint64_t first, std::uint32_t* words) {
#if SK_PHILOX_AVX2
  PhiloxLanes low = philox_lanes(first), high = philox_lanes(first + 8);
  auto key0 = static_cast<std::uint32_t>(seed), key1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key0));
    const __m256i k1 = _mm256_set1_epi32(static_cast<int>(key1));
    philox_round(low, k0, k1);
    philox_round(high, k0, k1);
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
  store_blocks(low, words);
  store_blocks(high, words + 32);
#else
  for (std::uint64_t j = 0; j < kPhiloxBatch; ++j) {
    const PhiloxBlock block = philox_block(seed, first + j);
    for (int w = 0; w < 4; ++w) words[4 * j + static_cast<std::uint64_t>(w)] = block.v[w];
  }
#endif
}

}  // namespace shardkit::detail
