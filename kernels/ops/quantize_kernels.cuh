// quantize.hpp's blocks (int8, E4M3 or int4 codes) on the GPU, with the element rules the CPU loops
// use (the same bits). Quantising the default 256-value blocks: a warp per block, 8 consecutive
// values a lane read 128 bits at a time and kept in registers, the |x| maximum formed by shuffles
// (a maximum is exact, so its order changes nothing), the codes written 4 bytes at a time. Other
// block sizes, or memory not aligned for that: a thread block per quantisation block, its values
// strided over the threads, the maximum formed in shared memory. (The thread-block form on
// 256-value blocks -- one value a thread, a barrier per halving -- reached 15% of copy on an H200.)
// Dequantising: 8 consecutive values a thread, or a thread per value where not aligned.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/ops/multi_tensor_apply.cuh"
#include "shardkit/ops/quantize.hpp"

namespace shardkit::ops::cuda {

// Whether `p` may be read or written `bytes` at a time.
inline bool aligned(const void* p, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// The |x| maximum of `m` over the thread block (blockDim.x == kThreads), formed in shared memory;
// every thread gets it. A maximum is exact: its order changes nothing.
SK_DEVICE SK_INLINE float block_abs_max(float m) {
  __shared__ float partial[kThreads];
  const int t = static_cast<int>(threadIdx.x);
  partial[t] = m;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] = abs_max(partial[t], partial[t + stride]);
    __syncthreads();
  }
  return partial[0];
}

template <class Code, class T>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_kernel(const T* x, std::int64_t n, std::int64_t block, float* scales,
                           std::uint8_t* q) {
  const std::int64_t lo = std::int64_t{blockIdx.x} * block;
  const std::int64_t hi = lo + block < n ? lo + block : n;
  const int t = static_cast<int>(threadIdx.x);
  float amax = 0.0f;
  for (std::int64_t i = lo + t; i < hi; i += kThreads) amax = abs_max(amax, load_element(x + i));
  amax = block_abs_max(amax);
  if (t == 0) scales[blockIdx.x] = block_scale<Code>(amax);
  const float inverse = inverse_step<Code>(amax);
  if constexpr (Code::kPerByte == 1) {
    for (std::int64_t i = lo + t; i < hi; i += kThreads)
      q[i] = Code::encode(load_element(x + i), inverse);
  } else {  // two codes a byte, a pair a thread; lo is even (int4 blocks are)
    for (std::int64_t i = lo + 2 * t; i < hi; i += 2 * kThreads) {
      const std::uint8_t low = Code::encode(load_element(x + i), inverse);
      const std::uint8_t high =
          i + 1 < hi ? Code::encode(load_element(x + i + 1), inverse) : std::uint8_t{0};
      q[i / 2] = static_cast<std::uint8_t>(low | (high << 4));
    }
  }
}

// The warp form's block and each lane's share of it.
inline constexpr std::int64_t kWarpQuantBlock = 256;
inline constexpr int kValuesPerLane = static_cast<int>(kWarpQuantBlock / 32);

// A lane's 8 values from `first` in registers (zeros from `hi` on: they change no maximum);
// whether all 8 were there (read 128 bits at a time).
template <class T>
SK_DEVICE SK_INLINE bool load_lane_values(const T* x, std::int64_t first, std::int64_t hi,
                                          float (&v)[kValuesPerLane]) {
  const bool whole = first + kValuesPerLane <= hi;
  if (whole) {
    load_vector(x + first, v);
    load_vector(x + first + 4, v + 4);
  } else {
    SK_UNROLL
    for (int j = 0; j < kValuesPerLane; ++j)
      v[j] = first + j < hi ? load_element(x + first + j) : 0.0f;
  }
  return whole;
}

// 256-value blocks a warp each; x 16-byte aligned, the codes 4-byte aligned (launch checks).
template <class Code, class T>
__global__ void __launch_bounds__(kThreads)
    quantize_warp_blocks_kernel(const T* x, std::int64_t n, std::int64_t blocks, float* scales,
                                std::uint8_t* q) {
  const std::int64_t b = std::int64_t{blockIdx.x} * (kThreads / 32) + threadIdx.x / 32;
  if (b >= blocks) return;  // a whole warp leaves
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t first = b * kWarpQuantBlock + lane * kValuesPerLane;
  const std::int64_t hi =
      b * kWarpQuantBlock + kWarpQuantBlock < n ? b * kWarpQuantBlock + kWarpQuantBlock : n;
  float v[kValuesPerLane];
  const bool whole = load_lane_values(x, first, hi, v);
  float amax = 0.0f;
  SK_UNROLL
  for (int j = 0; j < kValuesPerLane; ++j) amax = abs_max(amax, v[j]);
  SK_UNROLL
  for (int offset = 16; offset > 0; offset /= 2)
    amax = abs_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (lane == 0) scales[b] = block_scale<Code>(amax);
  const float inverse = inverse_step<Code>(amax);
  if constexpr (Code::kPerByte == 1) {
    if (whole) {
      std::uint32_t words[2] = {0, 0};
      SK_UNROLL
      for (int j = 0; j < kValuesPerLane; ++j)
        words[j / 4] |= static_cast<std::uint32_t>(Code::encode(v[j], inverse)) << (8 * (j % 4));
      auto* out = reinterpret_cast<std::uint32_t*>(q + first);
      out[0] = words[0];
      out[1] = words[1];
    } else {
      for (int j = 0; j < kValuesPerLane; ++j)
        if (first + j < hi) q[first + j] = Code::encode(v[j], inverse);
    }
  } else {  // two codes a byte, the even value's in the low nibble; first is even
    std::uint32_t word = 0;
    SK_UNROLL
    for (int k = 0; k < kValuesPerLane / 2; ++k) {
      const std::int64_t i = first + 2 * k;
      const std::uint8_t low = Code::encode(v[2 * k], inverse);
      const std::uint8_t high = i + 1 < hi ? Code::encode(v[2 * k + 1], inverse) : std::uint8_t{0};
      const auto byte = static_cast<std::uint8_t>(low | (high << 4));
      if (whole)
        word |= static_cast<std::uint32_t>(byte) << (8 * k);
      else if (i < hi)
        q[i / 2] = byte;
    }
    if (whole) *reinterpret_cast<std::uint32_t*>(q + first / 2) = word;
  }
}

// 8 consecutive values a thread, one scale each (block % 8 == 0); x 16-byte aligned, the codes
// 4-byte aligned (launch checks). The last thread's values past n are left alone.
template <class Code, class T>
__global__ void dequantize_octets_kernel(const float* scales, const std::uint8_t* q, std::int64_t n,
                                         std::int64_t block, T* x, bool accumulate) {
  const std::int64_t octets = (n + 7) / 8;
  for (std::int64_t o = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; o < octets;
       o += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t first = 8 * o;
    const float scale = scales[first / block];
    float v[8];
    if (first + 8 <= n) {
      std::uint8_t codes[8];
      if constexpr (Code::kPerByte == 1) {
        const auto* words = reinterpret_cast<const std::uint32_t*>(q + first);
        const std::uint32_t w[2] = {words[0], words[1]};
        SK_UNROLL
        for (int j = 0; j < 8; ++j) codes[j] = static_cast<std::uint8_t>(w[j / 4] >> (8 * (j % 4)));
      } else {
        const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(q + first / 2);
        SK_UNROLL
        for (int j = 0; j < 8; ++j)
          codes[j] = static_cast<std::uint8_t>((w >> (8 * (j / 2))) >> (4 * (j % 2)));
      }
      float old[8] = {};
      if (accumulate) {
        load_vector(x + first, old);
        load_vector(x + first + 4, old + 4);
      }
      SK_UNROLL
      for (int j = 0; j < 8; ++j) {
        const float value = Code::decode(codes[j], scale);
        v[j] = accumulate ? __fadd_rn(old[j], value) : value;
      }
      store_vector(x + first, v);
      store_vector(x + first + 4, v + 4);
    } else {
      for (std::int64_t i = first; i < n; ++i) {
        const float value = Code::decode(code_at<Code>(q, i), scale);
        store_element(x + i, accumulate ? __fadd_rn(load_element(x + i), value) : value);
      }
    }
  }
}

// `accumulate`: x += the value (the product rounded apart from the sum: Code::decode's mul_rn).
template <class Code, class T>
__global__ void dequantize_blocks_kernel(const float* scales, const std::uint8_t* q, std::int64_t n,
                                         std::int64_t block, T* x, bool accumulate) {
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const float value = Code::decode(code_at<Code>(q, i), scales[i / block]);
    store_element(x + i, accumulate ? __fadd_rn(load_element(x + i), value) : value);
  }
}

inline void launch_quantize_blocks(Context& ctx, QuantFormat format, DType dtype,
                                   const void* values, std::int64_t n, std::int64_t block,
                                   std::uint8_t* payload) {
  const std::int64_t blocks = quant_block_count(n, block);
  check(blocks <= 0x7fffffff, "quantize_blocks: ", blocks,
        " blocks in one run; at most 2^31 - 1 (one thread block each): pass a larger block");
  CudaDeviceGuard guard(ctx.device().index);
  std::uint8_t* codes = payload + 4 * blocks;
  const bool warps =
      block == kWarpQuantBlock && aligned(values, 16) && aligned(codes, 4) && aligned(payload, 4);
  visit_quant_format(format, [&]<class Code>() {
    visit_element_dtype(dtype, [&]<class T>() {
      if (warps) {
        const std::int64_t grid = (blocks + kThreads / 32 - 1) / (kThreads / 32);
        quantize_warp_blocks_kernel<Code, T>
            <<<static_cast<unsigned>(grid), kThreads, 0, ctx.stream()>>>(
                static_cast<const T*>(values), n, blocks, reinterpret_cast<float*>(payload), codes);
      } else {
        quantize_blocks_kernel<Code, T>
            <<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream()>>>(
                static_cast<const T*>(values), n, block, reinterpret_cast<float*>(payload), codes);
      }
    });
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::quantize_blocks_kernel");
  // The padding too: a payload's bytes are a function of the values alone.
  const std::int64_t used = 4 * blocks + quant_code_bytes(n, format);
  SK_CUDA_CHECK(cudaMemsetAsync(
      payload + used, 0, static_cast<std::size_t>(quant_payload_bytes(n, block, format) - used),
      ctx.stream()));
}

inline void launch_dequantize_blocks(Context& ctx, QuantFormat format, DType dtype,
                                     const std::uint8_t* payload, std::int64_t n,
                                     std::int64_t block, void* values, bool accumulate) {
  const std::int64_t blocks = quant_block_count(n, block);
  const std::uint8_t* codes = payload + 4 * blocks;
  const bool octets =
      block % 8 == 0 && aligned(values, 16) && aligned(codes, 4) && aligned(payload, 4);
  const std::int64_t threads = octets ? (n + 7) / 8 : n;
  const auto grid = static_cast<unsigned>(
      std::min<std::int64_t>((threads + kThreads - 1) / kThreads, std::int64_t{1} << 20));
  CudaDeviceGuard guard(ctx.device().index);
  visit_quant_format(format, [&]<class Code>() {
    visit_element_dtype(dtype, [&]<class T>() {
      const auto* scales = reinterpret_cast<const float*>(payload);
      if (octets)
        dequantize_octets_kernel<Code, T><<<grid, kThreads, 0, ctx.stream()>>>(
            scales, codes, n, block, static_cast<T*>(values), accumulate);
      else
        dequantize_blocks_kernel<Code, T><<<grid, kThreads, 0, ctx.stream()>>>(
            scales, codes, n, block, static_cast<T*>(values), accumulate);
    });
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::dequantize_blocks_kernel");
}

// Per-tensor scales (quantize.hpp's slot chunks): a thread block per chunk. The chunk's |x|
// maximum (block_abs_max) is folded into its slot's with an integer atomicMax on the
// f32 bits -- the order of non-negative floats and +inf, which a NaN is clamped to -- so any
// order of the chunks gives the same maxima.
template <class T>
__global__ void __launch_bounds__(kThreads)
    slot_abs_max_kernel(const T* x, const std::int64_t* chunks, float* amax) {
  const std::int64_t* row = chunks + 3 * std::int64_t{blockIdx.x};
  const std::int64_t lo = row[0], hi = row[0] + row[1];
  float m = 0.0f;
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
    m = abs_max(m, load_element(x + i));
  m = block_abs_max(m);
  // (a NaN's maximum as +inf, as the CPU's: the maxima's all-reduce keeps an inf on every
  // backend, and may drop a NaN)
  if (threadIdx.x == 0)
    atomicMax(reinterpret_cast<int*>(amax + row[2]),
              static_cast<int>(min(__float_as_uint(m), 0x7f800000u)));
}

template <class Code, class T>
__global__ void __launch_bounds__(kThreads)
    quantize_by_slots_kernel(const T* x, const std::int64_t* chunks, const float* amax,
                             std::uint8_t* q) {
  const std::int64_t* row = chunks + 3 * std::int64_t{blockIdx.x};
  const float inverse = inverse_step<Code>(amax[row[2]]);
  for (std::int64_t i = row[0] + threadIdx.x; i < row[0] + row[1]; i += kThreads)
    q[i] = Code::encode(load_element(x + i), inverse);
}

template <class Code, class T>
__global__ void __launch_bounds__(kThreads)
    dequantize_by_slots_kernel(const std::uint8_t* q, const std::int64_t* chunks, const float* amax,
                               T* x) {
  const std::int64_t* row = chunks + 3 * std::int64_t{blockIdx.x};
  const float scale = block_scale<Code>(amax[row[2]]);
  for (std::int64_t i = row[0] + threadIdx.x; i < row[0] + row[1]; i += kThreads)
    store_element(x + i, Code::decode(q[i], scale));
}

inline unsigned chunk_grid(std::int64_t count, const char* op) {
  check(count <= 0x7fffffff, op, ": ", count,
        " chunks in one run; at most 2^31 - 1 (one thread block each)");
  return static_cast<unsigned>(count);
}

inline void launch_slot_abs_max(Context& ctx, DType dtype, const void* values,
                                const std::int64_t* chunks, std::int64_t count, float* amax) {
  CudaDeviceGuard guard(ctx.device().index);
  visit_element_dtype(dtype, [&]<class T>() {
    slot_abs_max_kernel<T><<<chunk_grid(count, "slot_abs_max"), kThreads, 0, ctx.stream()>>>(
        static_cast<const T*>(values), chunks, amax);
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::slot_abs_max_kernel");
}

inline void launch_quantize_by_slots(Context& ctx, QuantFormat format, DType dtype,
                                     const void* values, const std::int64_t* chunks,
                                     std::int64_t count, const float* amax, std::uint8_t* codes) {
  CudaDeviceGuard guard(ctx.device().index);
  visit_quant_format(format, [&]<class Code>() {
    if constexpr (Code::kPerByte == 1)
      visit_element_dtype(dtype, [&]<class T>() {
        quantize_by_slots_kernel<Code, T>
            <<<chunk_grid(count, "quantize_by_slots"), kThreads, 0, ctx.stream()>>>(
                static_cast<const T*>(values), chunks, amax, codes);
      });
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::quantize_by_slots_kernel");
}

inline void launch_dequantize_by_slots(Context& ctx, QuantFormat format, DType dtype,
                                       const std::uint8_t* codes, const std::int64_t* chunks,
                                       std::int64_t count, const float* amax, void* values) {
  CudaDeviceGuard guard(ctx.device().index);
  visit_quant_format(format, [&]<class Code>() {
    if constexpr (Code::kPerByte == 1)
      visit_element_dtype(dtype, [&]<class T>() {
        dequantize_by_slots_kernel<Code, T>
            <<<chunk_grid(count, "dequantize_by_slots"), kThreads, 0, ctx.stream()>>>(
                codes, chunks, amax, static_cast<T*>(values));
      });
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::dequantize_by_slots_kernel");
}

}  // namespace shardkit::ops::cuda
