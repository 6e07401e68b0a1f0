// What every autograd CUDA kernel file shares: the compute type of each storage type, f16/bf16
// loads and stores in f32, deterministic block reductions (fixed tree order, so repeated runs give
// the same bits), the dtype dispatch of the launchers and the one-block-per-row grid.
#pragma once

#include "kernels/core/tensor_kernels.cuh"
#include "shardkit/autograd/device_table.hpp"

namespace shardkit::autograd::cuda_kernels {

using shardkit::cuda::grid_for;
using shardkit::cuda::kThreadsPerBlock;

// The compute type of each storage type.
// clang-format off
template <class T> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<double> { using type = double; };
// clang-format on
template <class T>
using Acc = typename AccumulatorOf<T>::type;

template <class A, class T>
SK_DEVICE SK_INLINE A load(const T* p, std::int64_t i) {
  return convert_value<A>(p[i]);
}
template <class T, class A>
SK_DEVICE SK_INLINE void store(T* p, std::int64_t i, A v) {
  p[i] = convert_value<T>(v);
}

// Sum over the block (blockDim.x == kThreadsPerBlock); every thread gets the result.
template <class A>
SK_DEVICE A block_sum(A value) {
  __shared__ A partial[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  A total = 0;
  for (int w = 0; w < kThreadsPerBlock / 32; ++w) total += partial[w];
  return total;
}

template <class A>
SK_DEVICE A block_max(A value) {
  __shared__ A partial[kThreadsPerBlock / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    const A other = __shfl_down_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  A best = partial[0];
  for (int w = 1; w < kThreadsPerBlock / 32; ++w) best = partial[w] > best ? partial[w] : best;
  return best;
}

// Calls fn(T{}) for the floating dtypes the kernels take.
template <class Fn>
void visit_floating(DType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    // clang-format off
    case DType::f32: return fn(float{});
    case DType::f64: return fn(double{});
    case DType::f16: return fn(Half{});
    case DType::bf16: return fn(BFloat16{});
    default: break;
      // clang-format on
  }
  fail<InvalidArgument>(op, " on the GPU takes f32, f64, f16 or bf16, got ", dtype_name(dtype));
}

inline unsigned row_grid(std::int64_t rows) {
  check(rows < (std::int64_t{1} << 31), "row-wise kernel: ", rows, " rows exceed the grid limit");
  return static_cast<unsigned>(rows);
}

}  // namespace shardkit::autograd::cuda_kernels
