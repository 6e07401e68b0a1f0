// Sinkhorn-Knopp's passes on the GPU (device_table.hpp's sinkhorn_* entries; the CPU's loops are
// autograd/cpu_sinkhorn.hpp). Every scalar -- the largest score, the total, the flag of an empty
// prototype -- is read from device memory by the kernel that needs it, so the host only
// launches. Sums over the whole matrix and over its columns go through fixed partial results
// in a fixed order: repeated runs give the same bits (not the CPU's, whose sums run in index
// order).
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::cuda_kernels {

// Blocks of a reduction over the whole matrix: each leaves one partial result.
constexpr unsigned kSinkhornPartials = 256;
// Row chunks of a column sum: each leaves one partial row of column sums.
constexpr std::int64_t kSinkhornRowChunks = 64;

template <class T>
SK_DEVICE SK_INLINE T sinkhorn_infinity() {
  return static_cast<T>(INFINITY);
}

// True in every thread when some u[j] == 0 (j < cols): VISSL's empty-prototype guard.
template <class T>
SK_DEVICE bool block_any_zero(const T* u, std::int64_t cols) {
  int found = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) found |= (u[j] == T(0));
  return __syncthreads_or(found) != 0;
}

template <class T>
__global__ void sinkhorn_scale_kernel(const float* scores, T* q, std::int64_t n, T epsilon,
                                      T* partial) {
  T best = -sinkhorn_infinity<T>();
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const T v = static_cast<T>(scores[i]) / epsilon;
    q[i] = v;
    best = v > best ? v : best;
  }
  best = block_max(best);
  if (threadIdx.x == 0) partial[blockIdx.x] = best;
}

template <class T>
__global__ void sinkhorn_exp_kernel(T* q, std::int64_t n, const T* shift, T* partial) {
  const T by = shift[0];
  T sum = 0;
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const T v = exp(q[i] - by);
    q[i] = v;
    sum += v;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// out[0] = max or sum of partial[0, count), one block.
template <class T>
__global__ void sinkhorn_finish_kernel(const T* partial, unsigned count, T* out, bool max) {
  T acc = max ? -sinkhorn_infinity<T>() : T(0);
  for (unsigned i = threadIdx.x; i < count; i += blockDim.x)
    acc = max ? (partial[i] > acc ? partial[i] : acc) : acc + partial[i];
  acc = max ? block_max(acc) : block_sum(acc);
  if (threadIdx.x == 0) out[0] = acc;
}

// partial[chunk, j] = sum of q[r, j] over the chunk's rows (blockIdx.y), after q /= divisor;
// with zero_in, only when some zero_in[j] == 0, and after q += 1e-12.
template <class T>
__global__ void sinkhorn_column_partials_kernel(T* q, const T* divisor, const T* zero_in,
                                                T* partial, std::int64_t rows, std::int64_t cols,
                                                std::int64_t rows_per_chunk) {
  if (zero_in != nullptr && !block_any_zero(zero_in, cols)) return;
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  const std::int64_t first = blockIdx.y * rows_per_chunk;
  const std::int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  const T by = divisor != nullptr ? divisor[0] : T(1);
  T sum = 0;
  for (std::int64_t r = first; r < last; ++r) {
    T v = q[r * cols + j];
    if (zero_in != nullptr) v += static_cast<T>(1e-12);
    if (divisor != nullptr) v /= by;
    if (zero_in != nullptr || divisor != nullptr) q[r * cols + j] = v;
    sum += v;
  }
  partial[blockIdx.y * cols + j] = sum;
}

template <class T>
__global__ void sinkhorn_column_finish_kernel(const T* partial, const T* zero_in, T* u,
                                              std::int64_t cols, std::int64_t chunks) {
  const bool skipped = zero_in != nullptr && !block_any_zero(zero_in, cols);
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  T sum = 0;
  if (!skipped)
    for (std::int64_t c = 0; c < chunks; ++c) sum += partial[c * cols + j];
  u[j] = sum;
}

// v[j] = share / w[j] (w: u_again after an empty prototype, else u), infinities replaced by the
// largest finite v (0 when none is). One block.
template <class T>
__global__ void sinkhorn_prototype_scale_kernel(const T* u, const T* u_again, T* v,
                                                std::int64_t cols) {
  const T* w = block_any_zero(u, cols) ? u_again : u;
  const T share = T(1) / static_cast<T>(cols);
  int any_infinite = 0;
  T largest = -sinkhorn_infinity<T>();
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const T x = share / w[j];
    v[j] = x;
    if (isinf(x))
      any_infinite = 1;
    else
      largest = x > largest ? x : largest;
  }
  largest = block_max(largest);
  if (__syncthreads_or(any_infinite) == 0) return;
  if (!isfinite(largest)) largest = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x)
    if (isinf(v[j])) v[j] = largest;
}

// One block per row: q[r] *= v, then q[r] *= row_share / sum(q[r]).
template <class T>
__global__ void sinkhorn_scale_rows_kernel(T* q, const T* v, std::int64_t cols, T row_share) {
  T* row = q + blockIdx.x * cols;
  T sum = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const T x = row[j] * v[j];
    row[j] = x;
    sum += x;
  }
  const T factor = row_share / block_sum(sum);
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) row[j] *= factor;
}

// Whether code a (at index i) goes before code b (at j) as the row's hard assignment: larger, a
// NaN before any number (torch.argmax's rule, which VISSL's codes follow), the first of equals.
__device__ inline bool sinkhorn_code_wins(float a, std::int64_t i, float b, std::int64_t j) {
  if (a != a || b != b) return a != a && (b == b || i < j);
  return a > b || (a == b && i < j);
}

// One block per row: codes[r] = q[r] / sum(q[r]) in f32; `hard`: one-hot at the first largest.
template <class T>
__global__ void sinkhorn_codes_kernel(const T* q, float* codes, std::int64_t cols, bool hard) {
  const T* row = q + blockIdx.x * cols;
  float* code = codes + blockIdx.x * cols;
  T sum = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += row[j];
  sum = block_sum(sum);
  float best = -INFINITY;
  std::int64_t best_at = cols;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float c = static_cast<float>(row[j] / sum);
    code[j] = c;
    if (sinkhorn_code_wins(c, j, best, best_at)) best = c, best_at = j;
  }
  if (!hard) return;
  __shared__ float values[kThreadsPerBlock];
  __shared__ std::int64_t where[kThreadsPerBlock];
  values[threadIdx.x] = best;
  where[threadIdx.x] = best_at;
  __syncthreads();
  if (threadIdx.x == 0)
    for (unsigned t = 1; t < blockDim.x; ++t)
      if (sinkhorn_code_wins(values[t], where[t], values[0], where[0]))
        values[0] = values[t], where[0] = where[t];
  __syncthreads();
  const std::int64_t winner = where[0];
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) code[j] = j == winner ? 1.0f : 0.0f;
}

// Calls fn(T{}) for the Sinkhorn matrix's dtype: f32 or f64.
template <class Fn>
void visit_sinkhorn(const Tensor& q, const char* op, Fn&& fn) {
  if (q.dtype() == DType::f32) return fn(float{});
  if (q.dtype() == DType::f64) return fn(double{});
  fail<InvalidArgument>(op, ": the Sinkhorn matrix is f32 or f64, got ", dtype_name(q.dtype()),
                        "; use_double_precision picks between the two");
}

template <class T>
T* sinkhorn_ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

inline unsigned sinkhorn_blocks(std::int64_t n) {
  const std::int64_t wanted = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned>(wanted < kSinkhornPartials ? (wanted > 0 ? wanted : 1)
                                                          : kSinkhornPartials);
}

inline void sinkhorn_scale(Context& ctx, const Tensor& scores, const Tensor& q,
                           const Tensor& largest, double epsilon) {
  CudaDeviceGuard guard(ctx.device().index);
  visit_sinkhorn(q, "sinkhorn_scale", [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = sinkhorn_blocks(q.numel());
    const Tensor partial = empty(ctx, {static_cast<std::int64_t>(blocks)}, q.dtype());
    sinkhorn_scale_kernel<T><<<blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const float>(scores), sinkhorn_ptr<T>(q), q.numel(), static_cast<T>(epsilon),
        sinkhorn_ptr<T>(partial));
    SK_CUDA_CHECK_LAUNCH("sinkhorn_scale_kernel");
    sinkhorn_finish_kernel<T><<<1, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const T>(partial), blocks, sinkhorn_ptr<T>(largest), true);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_finish_kernel");
  });
}

inline void sinkhorn_exp(Context& ctx, const Tensor& q, const Tensor& shift, const Tensor& total) {
  CudaDeviceGuard guard(ctx.device().index);
  visit_sinkhorn(q, "sinkhorn_exp", [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = sinkhorn_blocks(q.numel());
    const Tensor partial = empty(ctx, {static_cast<std::int64_t>(blocks)}, q.dtype());
    sinkhorn_exp_kernel<T><<<blocks, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<T>(q), q.numel(), sinkhorn_ptr<const T>(shift), sinkhorn_ptr<T>(partial));
    SK_CUDA_CHECK_LAUNCH("sinkhorn_exp_kernel");
    sinkhorn_finish_kernel<T><<<1, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const T>(partial), blocks, sinkhorn_ptr<T>(total), false);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_finish_kernel");
  });
}

inline void sinkhorn_column_sums(Context& ctx, const Tensor& q, const Tensor& divisor,
                                 const Tensor& zero_in, const Tensor& u, std::int64_t rows,
                                 std::int64_t cols) {
  if (cols == 0) return;  // (no grid of 0 blocks; no column, no sum)
  CudaDeviceGuard guard(ctx.device().index);
  visit_sinkhorn(q, "sinkhorn_column_sums", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t chunks =
        rows < kSinkhornRowChunks ? (rows > 0 ? rows : 1) : kSinkhornRowChunks;
    const std::int64_t per_chunk = (rows + chunks - 1) / chunks;
    const Tensor partial = empty(ctx, {chunks * cols}, q.dtype());
    const dim3 grid(static_cast<unsigned>((cols + kThreadsPerBlock - 1) / kThreadsPerBlock),
                    static_cast<unsigned>(chunks));
    sinkhorn_column_partials_kernel<T><<<grid, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<T>(q), sinkhorn_ptr<const T>(divisor), sinkhorn_ptr<const T>(zero_in),
        sinkhorn_ptr<T>(partial), rows, cols, per_chunk);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_column_partials_kernel");
    sinkhorn_column_finish_kernel<T><<<grid.x, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const T>(partial), sinkhorn_ptr<const T>(zero_in), sinkhorn_ptr<T>(u), cols,
        chunks);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_column_finish_kernel");
  });
}

inline void sinkhorn_scale_rows(Context& ctx, const Tensor& q, const Tensor& u,
                                const Tensor& u_again, const Tensor& v, std::int64_t rows,
                                std::int64_t cols, std::int64_t global_rows) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_sinkhorn(q, "sinkhorn_scale_rows", [&](auto tag) {
    using T = decltype(tag);
    sinkhorn_prototype_scale_kernel<T><<<1, kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const T>(u), sinkhorn_ptr<const T>(u_again), sinkhorn_ptr<T>(v), cols);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_prototype_scale_kernel");
    sinkhorn_scale_rows_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<T>(q), sinkhorn_ptr<const T>(v), cols, T(1) / static_cast<T>(global_rows));
    SK_CUDA_CHECK_LAUNCH("sinkhorn_scale_rows_kernel");
  });
}

inline void sinkhorn_codes(Context& ctx, const Tensor& q, const Tensor& codes,
                           std::int64_t code_rows, std::int64_t cols, bool hard) {
  if (code_rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_sinkhorn(q, "sinkhorn_codes", [&](auto tag) {
    using T = decltype(tag);
    sinkhorn_codes_kernel<T><<<row_grid(code_rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        sinkhorn_ptr<const T>(q), sinkhorn_ptr<float>(codes), cols, hard);
    SK_CUDA_CHECK_LAUNCH("sinkhorn_codes_kernel");
  });
}

}  // namespace shardkit::autograd::cuda_kernels
