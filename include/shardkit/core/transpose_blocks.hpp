// The inner kernel of a transposing copy between tensors of one dtype: out[i][j] = in[j][i]
// over a rows x cols block, both sides unit-stride along their own rows.
//
// Element by element, every read of a transpose lands on another cache line and the compiler
// cannot vectorise either side; here square blocks are loaded as whole rows of `in`, transposed
// in SIMD registers, and stored as whole rows of `out` (8 x 8 four-byte elements with AVX, 4 x 4
// with SSE, 8 x 8 two-byte elements with SSE2): about 3x the element loop on a 4096 x 4096 f32
// transpose (benchmarks/core/bench_core). Only bytes move, so the result is the element loop's
// bit for bit; the edges of a block that do not fill a SIMD square go element by element.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// Intrinsics for the host compiler only: nvcc's passes (device and host) see the scalar
// loop, as cpu_apply.hpp's lanes do -- host loops in .cu files are not hot, and GCC's whole
// immintrin.h is best kept away from nvcc. The results are the same bytes either way.
#if defined(__SSE2__) && !defined(__CUDACC__)
#define SK_TRANSPOSE_SIMD 1
#include <immintrin.h>
#else
#define SK_TRANSPOSE_SIMD 0
#endif

namespace shardkit::detail {

// Whether transpose_block has a SIMD kernel for elements of this many bytes on this build.
inline constexpr bool has_transpose_kernel(std::size_t element_bytes) {
#if SK_TRANSPOSE_SIMD
  return element_bytes == 4 || element_bytes == 2;
#else
  (void)element_bytes;
  return false;
#endif
}

#if SK_TRANSPOSE_SIMD
namespace transpose_simd {

#if defined(__AVX__)
inline constexpr std::int64_t kSide4 = 8;
// 8 x 8 four-byte elements: rows of `in` (ld_in apart) become rows of `out` (ld_out apart).
inline void square4(const float* in, std::int64_t ld_in, float* out, std::int64_t ld_out) {
  __m256 r[8], t[8], s[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(in + k * ld_in);
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    s[4 * k + 0] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    s[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    s[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    s[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(out + k * ld_out, _mm256_permute2f128_ps(s[k], s[k + 4], 0x20));
    _mm256_storeu_ps(out + (k + 4) * ld_out, _mm256_permute2f128_ps(s[k], s[k + 4], 0x31));
  }
}
#else
inline constexpr std::int64_t kSide4 = 4;
// 4 x 4 four-byte elements with SSE.
inline void square4(const float* in, std::int64_t ld_in, float* out, std::int64_t ld_out) {
  __m128 r0 = _mm_loadu_ps(in), r1 = _mm_loadu_ps(in + ld_in), r2 = _mm_loadu_ps(in + 2 * ld_in),
         r3 = _mm_loadu_ps(in + 3 * ld_in);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(out, r0);
  _mm_storeu_ps(out + ld_out, r1);
  _mm_storeu_ps(out + 2 * ld_out, r2);
  _mm_storeu_ps(out + 3 * ld_out, r3);
}
#endif

inline constexpr std::int64_t kSide2 = 8;
// 8 x 8 two-byte elements with SSE2: interleaving 16-, then 32-, then 64-bit lanes of row
// pairs, row quads and row halves leaves column k of the square in register k.
inline void square2(const std::uint16_t* in, std::int64_t ld_in, std::uint16_t* out,
                    std::int64_t ld_out) {
  __m128i r[8], a[8], b[8];
  for (int k = 0; k < 8; ++k)
    r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + k * ld_in));
  for (int k = 0; k < 4; ++k) {  // a[2k]: columns 0-3 of rows 2k, 2k + 1; a[2k + 1]: 4-7
    a[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h)  // b[4h + q]: columns 2q, 2q + 1 of rows 4h .. 4h + 3
    for (int m = 0; m < 2; ++m) {
      b[4 * h + 2 * m] = _mm_unpacklo_epi32(a[4 * h + m], a[4 * h + m + 2]);
      b[4 * h + 2 * m + 1] = _mm_unpackhi_epi32(a[4 * h + m], a[4 * h + m + 2]);
    }
  for (int m = 0; m < 4; ++m) {  // columns 2m and 2m + 1 of all eight rows
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * m * ld_out),
                     _mm_unpacklo_epi64(b[m], b[m + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * m + 1) * ld_out),
                     _mm_unpackhi_epi64(b[m], b[m + 4]));
  }
}

}  // namespace transpose_simd
#endif

// out[i * ld_out + j] = in[j * ld_in + i] for i < rows, j < cols, elements of `Bytes` bytes
// (4 or 2; has_transpose_kernel). `in` and `out` do not overlap.
template <std::size_t Bytes>
void transpose_block(const void* in_bytes, std::int64_t ld_in, void* out_bytes, std::int64_t ld_out,
                     std::int64_t rows, std::int64_t cols) {
  static_assert(Bytes == 4 || Bytes == 2, "transpose_block: 4- or 2-byte elements");
  using Word = std::conditional_t<Bytes == 4, float, std::uint16_t>;
  const auto* in = static_cast<const Word*>(in_bytes);
  auto* out = static_cast<Word*>(out_bytes);
  std::int64_t full_rows = 0, full_cols = 0;
#if SK_TRANSPOSE_SIMD
  constexpr std::int64_t side = Bytes == 4 ? transpose_simd::kSide4 : transpose_simd::kSide2;
  full_rows = rows - rows % side;
  full_cols = cols - cols % side;
  for (std::int64_t j = 0; j < full_cols; j += side)
    for (std::int64_t i = 0; i < full_rows; i += side) {
      if constexpr (Bytes == 4)
        transpose_simd::square4(in + j * ld_in + i, ld_in, out + i * ld_out + j, ld_out);
      else
        transpose_simd::square2(in + j * ld_in + i, ld_in, out + i * ld_out + j, ld_out);
    }
#endif
  // The edges: columns past the last whole square on every row, rows past it on the rest.
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = i < full_rows ? full_cols : 0; j < cols; ++j)
      std::memcpy(out + i * ld_out + j, in + j * ld_in + i, Bytes);
}

}  // namespace shardkit::detail
