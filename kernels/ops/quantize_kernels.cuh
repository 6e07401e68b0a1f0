// quantize.hpp's blocks (int8, E4M3 or int4 codes) on the GPU, with the element rules the CPU loops
// use (the same bits). Quantising: a thread block per quantisation block, its values strided over
// the threads; the |x| maximum is formed in shared memory (a maximum is exact, so its order changes
// nothing), then every thread writes its values' q (int4: a pair of values a thread, one byte).
// Dequantising: a thread per value.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/ops/multi_tensor_apply.cuh"
#include "shardkit/ops/quantize.hpp"

namespace shardkit::ops::cuda {

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
  if (t == 0) scales[blockIdx.x] = amax / Code::kMax;
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
  visit_quant_format(format, [&]<class Code>() {
    visit_element_dtype(dtype, [&]<class T>() {
      quantize_blocks_kernel<Code, T><<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream()>>>(
          static_cast<const T*>(values), n, block, reinterpret_cast<float*>(payload),
          payload + 4 * blocks);
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
  const auto grid = static_cast<unsigned>(
      std::min<std::int64_t>((n + kThreads - 1) / kThreads, std::int64_t{1} << 20));
  CudaDeviceGuard guard(ctx.device().index);
  visit_quant_format(format, [&]<class Code>() {
    visit_element_dtype(dtype, [&]<class T>() {
      dequantize_blocks_kernel<Code, T><<<grid, kThreads, 0, ctx.stream()>>>(
          reinterpret_cast<const float*>(payload), payload + 4 * blocks, n, block,
          static_cast<T*>(values), accumulate);
    });
  });
  SK_CUDA_CHECK_LAUNCH("ops::cuda::dequantize_blocks_kernel");
}

// Per-tensor scales (quantize.hpp's slot chunks): a thread block per chunk. The chunk's |x|
// maximum (block_abs_max) is folded into its slot's with an integer atomicMax on the
// f32 bits -- the order of non-negative floats, +inf and a NaN (fabsf clears its sign, and its
// bits lie above +inf's) included -- so any order of the chunks gives the same maxima.
template <class T>
__global__ void __launch_bounds__(kThreads)
    slot_abs_max_kernel(const T* x, const std::int64_t* chunks, float* amax) {
  const std::int64_t* row = chunks + 3 * std::int64_t{blockIdx.x};
  const std::int64_t lo = row[0], hi = row[0] + row[1];
  float m = 0.0f;
  for (std::int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
    m = abs_max(m, load_element(x + i));
  m = block_abs_max(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax + row[2]), __float_as_int(m));
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
  const float scale = amax[row[2]] / Code::kMax;
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
