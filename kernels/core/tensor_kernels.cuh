// CUDA kernels behind the core tensor operations (fill, strided/casting copy, add, divide,
// Philox fills), the
// DeviceKernels table that carries them (a CUDA Context gets it from <shardkit/cuda.hpp>).
#pragma once

#include <algorithm>

#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::cuda {

inline constexpr int kMaxDims = 8;
inline constexpr int kThreadsPerBlock = 256;

// Maps a row-major element index to an element offset in a strided tensor; passed by value.
struct StridedIndexer {
  int rank = 0;
  bool contiguous = true;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t strides[kMaxDims] = {};

  SK_DEVICE SK_INLINE std::int64_t offset(std::int64_t index) const {
    if (contiguous) return index;
    std::int64_t at = 0;
    for (int d = rank - 1; d >= 0; --d) {
      at += (index % shape[d]) * strides[d];
      index /= shape[d];
    }
    return at;
  }
};

inline StridedIndexer make_indexer(const Tensor& t) {
  check(t.dim() <= kMaxDims, "CUDA tensor kernels handle up to ", kMaxDims, " dimensions, got ",
        t.dim(), " for ", t, "; reshape (view) it to fewer dimensions");
  StridedIndexer indexer;
  indexer.rank = static_cast<int>(t.dim());
  indexer.contiguous = t.is_contiguous();
  for (int d = 0; d < indexer.rank; ++d) {
    indexer.shape[d] = t.shape()[static_cast<std::size_t>(d)];
    indexer.strides[d] = t.strides()[static_cast<std::size_t>(d)];
  }
  return indexer;
}

inline unsigned grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, 65536));
}

template <class T>
__global__ void fill_kernel(T* data, StridedIndexer indexer, std::int64_t n, T value) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    data[indexer.offset(i)] = value;
}

template <class D, class S>
__global__ void copy_kernel(D* dst, StridedIndexer dst_indexer, const S* src,
                            StridedIndexer src_indexer, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    dst[dst_indexer.offset(i)] = convert_value<D>(src[src_indexer.offset(i)]);
}

template <class D, class S>
__global__ void add_kernel(D* dst, StridedIndexer dst_indexer, const S* src,
                           StridedIndexer src_indexer, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t d = dst_indexer.offset(i);
    dst[d] = add_value(dst[d], convert_value<D>(src[src_indexer.offset(i)]));
  }
}

template <class T, class Acc>
__global__ void divide_kernel(T* data, StridedIndexer indexer, std::int64_t n, Acc divisor) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t at = indexer.offset(i);
    data[at] = convert_value<T>(convert_value<Acc>(data[at]) / divisor);
  }
}

// One thread per Philox block: it draws the block once (ten rounds) and writes the two or four
// elements the block gives, where one thread per element drew each block two or four times.
// Block b of the fill gives the stream's positions b * per .. b * per + per - 1, position
// `skip` being element 0 (RandomSpec::value_at's mapping, so the bits are the CPU's).
template <class T>
__global__ void random_kernel(T* data, StridedIndexer indexer, std::int64_t n, RandomSpec spec,
                              std::int64_t blocks) {
  const auto per = static_cast<unsigned>(spec.elements_per_block());
  const T ceiling = spec.uniform_ceiling<T>();
  for (std::int64_t b = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; b < blocks;
       b += std::int64_t{gridDim.x} * blockDim.x) {
    const PhiloxBlock block = philox_block(spec.seed, spec.counter_base + b);
    const auto first = static_cast<std::int64_t>(b * per) - static_cast<std::int64_t>(spec.skip);
    for (unsigned position = 0; position < per; ++position) {
      const std::int64_t i = first + position;
      if (i >= 0 && i < n)
        data[indexer.offset(i)] = spec.stored_as<T>(spec.value_in_block(block, position), ceiling);
    }
  }
}

inline void fill(Context& ctx, const Tensor& t, double value) {
  const std::int64_t n = t.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    fill_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<T*>(t.data_ptr()), make_indexer(t), n, convert_value<T>(value));
    SK_CUDA_CHECK_LAUNCH("fill_kernel");
  });
}

inline void copy(Context& ctx, const Tensor& dst, const Tensor& src) {
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    SK_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                  cudaMemcpyDeviceToDevice, ctx.stream()));
    return;
  }
  visit_dtype(dst.dtype(), [&](auto dst_tag) {
    using D = decltype(dst_tag);
    visit_dtype(src.dtype(), [&](auto src_tag) {
      using S = decltype(src_tag);
      copy_kernel<D, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<D*>(dst.data_ptr()), make_indexer(dst), static_cast<const S*>(src.data_ptr()),
          make_indexer(src), n);
      SK_CUDA_CHECK_LAUNCH("copy_kernel");
    });
  });
}

inline void add(Context& ctx, const Tensor& dst, const Tensor& src) {
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_dtype(dst.dtype(), [&](auto dst_tag) {
    using D = decltype(dst_tag);
    visit_dtype(src.dtype(), [&](auto src_tag) {
      using S = decltype(src_tag);
      add_kernel<D, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<D*>(dst.data_ptr()), make_indexer(dst), static_cast<const S*>(src.data_ptr()),
          make_indexer(src), n);
      SK_CUDA_CHECK_LAUNCH("add_kernel");
    });
  });
}

inline void divide(Context& ctx, const Tensor& t, double divisor) {
  const std::int64_t n = t.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    divide_kernel<T, Acc><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<T*>(t.data_ptr()), make_indexer(t), n, static_cast<Acc>(divisor));
    SK_CUDA_CHECK_LAUNCH("divide_kernel");
  });
}

inline void random(Context& ctx, const Tensor& t, const RandomSpec& spec) {
  const std::int64_t n = t.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                  std::is_same_v<T, BFloat16>) {
      const auto blocks = static_cast<std::int64_t>(spec.blocks_for(spec.skip + n));
      random_kernel<T><<<grid_for(blocks), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<T*>(t.data_ptr()), make_indexer(t), n, spec, blocks);
      SK_CUDA_CHECK_LAUNCH("random_kernel");
    }
  });
}

// The table a CUDA Context calls through. Constant: no global mutable state.
inline const DeviceKernels* device_kernels() {
  static constexpr DeviceKernels kTable{.fill = &cuda::fill,
                                        .copy = &cuda::copy,
                                        .add = &cuda::add,
                                        .divide = &cuda::divide,
                                        .random = &cuda::random};
  return &kTable;
}

}  // namespace shardkit::cuda
