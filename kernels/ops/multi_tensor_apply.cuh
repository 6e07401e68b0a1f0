// The CUDA multi-tensor launcher: one launch applies a functor (include/shardkit/ops/
// functor.hpp) to up to SpanBatch::kMaxSpans spans, one block per chunk of kChunkElements, with
// the span table passed by value as the kernel's parameters (under the classic 4 KB limit);
// longer lists take several launches. Aligned runs use 16-byte (f32) / 8-byte (f16, bf16)
// vector accesses, the few elements before and after them scalar ones. Sums go to one partial
// per chunk (fixed-order block reduction), then a second kernel adds each span's partials in a
// fixed order: the same bits on every run.
#pragma once

#include <cstdint>
#include <vector>

#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/spans.hpp"
#include "shardkit/ops/step_gate.hpp"

namespace shardkit::ops::cuda {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;

template <int Depth>
struct SpanBatch {
  // As many spans as fit in 4 KB of kernel parameters with the functor beside them.
  static constexpr int kMaxSpans = (4096 - 512) / (8 * Depth + 8 + 4 + 1);

  void* data[Depth][kMaxSpans];
  std::int64_t size[kMaxSpans];
  std::int32_t chunk_begin[kMaxSpans + 1];  // chunks before each span in this launch
  // Elements from the span's start to the next 16-byte boundary of every operand's vector
  // unit (0..3), or -1 when the operands disagree and the span runs scalar.
  std::int8_t misalign[kMaxSpans];
  int count = 0;
  std::int64_t first_span = 0;   // index of span 0 of this launch in the whole list
  std::int64_t first_chunk = 0;  // chunks of the whole list before this launch
};

// 0..3 such that element `misalign` of every operand sits on a vector boundary, or -1.
template <class F>
int span_misalignment(const Span<F::kDepth>& span) {
  int common = -1;
  bool ok = true;
  // (clang-format 14 would split these immediately invoked template lambdas apart)
  // clang-format off
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    (
        [&] {
          constexpr std::uintptr_t element = sizeof(operand_t<F, K>);
          const auto address = reinterpret_cast<std::uintptr_t>(span.data[K]);
          if (address == 0) return;  // unused operand
          if (address % element != 0) {
            ok = false;
            return;
          }
          const int offset = static_cast<int>(
              (kVectorElements - (address / element) % kVectorElements) % kVectorElements);
          if (common < 0) common = offset;
          ok = ok && common == offset;
        }(),
        ...);
  }(std::make_index_sequence<F::kDepth>{});
  // clang-format on
  return ok ? (common < 0 ? 0 : common) : -1;
}

template <class T>
SK_DEVICE SK_INLINE void load_vector(const T* p, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const T e[4] = {T::from_bits(static_cast<std::uint16_t>(v.x)),
                    T::from_bits(static_cast<std::uint16_t>(v.x >> 16)),
                    T::from_bits(static_cast<std::uint16_t>(v.y)),
                    T::from_bits(static_cast<std::uint16_t>(v.y >> 16))};
    SK_UNROLL
    for (int j = 0; j < 4; ++j) out[j] = load_element(&e[j]);
  }
}

template <class T>
SK_DEVICE SK_INLINE void store_vector(T* p, const float* in) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  } else {
    T e[4];
    SK_UNROLL
    for (int j = 0; j < 4; ++j) store_element(&e[j], in[j]);
    uint2 v;
    v.x = static_cast<unsigned>(e[0].bits) | (static_cast<unsigned>(e[1].bits) << 16);
    v.y = static_cast<unsigned>(e[2].bits) | (static_cast<unsigned>(e[3].bits) << 16);
    *reinterpret_cast<uint2*>(p) = v;
  }
}

template <class F>
SK_DEVICE SK_INLINE void apply_vector(const F& op, const typename F::Segment& segment,
                                      void* const* data, std::int64_t i,
                                      double (&acc)[kSumSlots<F>]) {
  float v[F::kDepth][kVectorElements];
  // clang-format off
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ([&] {
      if constexpr (reads<F>(K))
        load_vector(static_cast<const operand_t<F, K>*>(data[K]) + i, v[K]);
    }(), ...);
  }(std::make_index_sequence<F::kDepth>{});
  // clang-format on
  SK_UNROLL
  for (int j = 0; j < kVectorElements; ++j) {
    float x[F::kDepth];
    SK_UNROLL
    for (int k = 0; k < F::kDepth; ++k) x[k] = reads<F>(k) ? v[k][j] : 0.0f;
    double sums[kSumSlots<F>];
    op(x, segment, sums);
    SK_UNROLL
    for (int k = 0; k < F::kDepth; ++k) v[k][j] = x[k];
    if constexpr (F::kSums > 0) {
      SK_UNROLL
      for (int k = 0; k < F::kSums; ++k) acc[k] += sums[k];
    }
  }
  // clang-format off
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ([&] {
      if constexpr (writes<F>(K)) store_vector(static_cast<operand_t<F, K>*>(data[K]) + i, v[K]);
    }(), ...);
  }(std::make_index_sequence<F::kDepth>{});
  // clang-format on
}

template <class F>
SK_DEVICE SK_INLINE void apply_scalar(const F& op, const typename F::Segment& segment,
                                      void* const* data, std::int64_t i,
                                      double (&acc)[kSumSlots<F>]) {
  float x[F::kDepth];
  load_operands<F>(x, data, i);
  double sums[kSumSlots<F>];
  op(x, segment, sums);
  store_operands<F>(x, data, i);
  if constexpr (F::kSums > 0) {
    SK_UNROLL
    for (int k = 0; k < F::kSums; ++k) acc[k] += sums[k];
  }
}

// Sums `value` over the block in a fixed order (shuffles, then warps in order); thread 0 gets
// the total.
SK_DEVICE SK_INLINE double block_sum(double value, double* shared) {
  SK_UNROLL
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32;
  __syncthreads();  // `shared` may still be read from a previous call
  if (threadIdx.x % 32 == 0) shared[warp] = value;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += shared[w];
  return total;
}

template <class F>
__global__ void __launch_bounds__(kThreads)
    apply_kernel(F op, SpanBatch<F::kDepth> batch, double* partials, std::int64_t stride) {
  if (gate_skips(op)) return;  // a gated step that overflowed somewhere: nothing written
  const int chunk = static_cast<int>(blockIdx.x);
  // The span owning this chunk: the last one starting at or before it (empty spans own none).
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.chunk_begin[mid] <= chunk)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int s = lo;
  void* data[F::kDepth];
  SK_UNROLL
  for (int k = 0; k < F::kDepth; ++k) data[k] = batch.data[k][s];
  const std::int64_t begin = std::int64_t{chunk - batch.chunk_begin[s]} * kChunkElements;
  const std::int64_t end = min(begin + kChunkElements, batch.size[s]);
  const auto segment = op.segment(batch.first_span + s);
  double acc[kSumSlots<F>] = {};

  std::int64_t vector_begin = end, vector_end = end;
  if (batch.misalign[s] >= 0) {
    vector_begin = min(begin + batch.misalign[s], end);  // chunk starts keep the span's alignment
    vector_end = vector_begin + (end - vector_begin) / kVectorElements * kVectorElements;
  }
  for (std::int64_t i = begin + threadIdx.x; i < vector_begin; i += kThreads)
    apply_scalar(op, segment, data, i, acc);
  for (std::int64_t i = vector_begin + std::int64_t{threadIdx.x} * kVectorElements; i < vector_end;
       i += std::int64_t{kThreads} * kVectorElements)
    apply_vector(op, segment, data, i, acc);
  for (std::int64_t i = vector_end + threadIdx.x; i < end; i += kThreads)
    apply_scalar(op, segment, data, i, acc);

  if constexpr (F::kSums > 0) {
    __shared__ double shared[kWarps];
    SK_UNROLL
    for (int k = 0; k < F::kSums; ++k) {
      const double total = block_sum(acc[k], shared);
      if (threadIdx.x == 0) partials[k * stride + batch.first_chunk + chunk] = total;
    }
  }
}

// sums[k * n + span] = the span's chunk partials added in a fixed order (at n - 1 - span when
// `reversed`); found_nonfinite (if given) is set to 1 when a sum is inf or NaN. One block per
// span of the batch.
template <int Depth>
__global__ void __launch_bounds__(kThreads)
    finish_sums_kernel(SpanBatch<Depth> batch, int sum_count, const double* partials,
                       std::int64_t stride, double* sums, std::int64_t n, bool reversed,
                       float* found_nonfinite) {
  __shared__ double shared[kWarps];
  const int s = static_cast<int>(blockIdx.x);
  const std::int64_t first = batch.first_chunk + batch.chunk_begin[s];
  const std::int64_t last = batch.first_chunk + batch.chunk_begin[s + 1];
  for (int k = 0; k < sum_count; ++k) {
    double value = 0;
    for (std::int64_t c = first + threadIdx.x; c < last; c += kThreads)
      value += partials[k * stride + c];
    const double total = block_sum(value, shared);
    if (threadIdx.x == 0) {
      const std::int64_t span = batch.first_span + s;
      sums[k * n + (reversed ? n - 1 - span : span)] = total;
      if (found_nonfinite != nullptr && !is_finite_sum(total)) *found_nonfinite = 1.0f;
    }
  }
}

// Applies `op` over `spans` on the context's stream. When F sums, sums (device, f64 [kSums, n])
// receives each span's sums (in reverse span order with SumOrder::reversed), and
// found_nonfinite (device f32, optional) is raised on inf/NaN.
enum class SumOrder { spans, reversed };
template <class F>
void apply(Context& ctx, const F& op, const SpanList<F::kDepth>& spans, double* sums = nullptr,
           float* found_nonfinite = nullptr, SumOrder order = SumOrder::spans) {
  static_assert(check_functor<F>());
  using Batch = SpanBatch<F::kDepth>;
  static_assert(sizeof(Batch) + sizeof(F) + 64 <= 4096, "kernel parameters over 4 KB");
  const auto n = static_cast<std::int64_t>(spans.size());
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  const std::int64_t stride = total_chunks(spans);
  Tensor workspace;
  double* partials = nullptr;
  if constexpr (F::kSums > 0) {
    check(sums != nullptr, "internal: a summing functor needs an output for its sums");
    if (stride > 0) {
      workspace = empty(ctx, {F::kSums * stride}, DType::f64);
      partials = workspace.data<double>();
    }
  }
  Batch batch{};  // zeroed: unused slots are copied into the kernel parameters too
  std::int64_t first_chunk = 0;
  auto launch = [&] {
    const int chunks = batch.chunk_begin[batch.count];
    if (chunks > 0) {
      apply_kernel<F><<<chunks, kThreads, 0, ctx.stream()>>>(op, batch, partials, stride);
      SK_CUDA_CHECK_LAUNCH("ops::cuda::apply_kernel");
    }
    if constexpr (F::kSums > 0) {
      finish_sums_kernel<F::kDepth><<<batch.count, kThreads, 0, ctx.stream()>>>(
          batch, F::kSums, partials, stride, sums, n, order == SumOrder::reversed, found_nonfinite);
      SK_CUDA_CHECK_LAUNCH("ops::cuda::finish_sums_kernel");
    }
    first_chunk += chunks;
  };
  for (std::int64_t s = 0; s < n; ++s) {
    const auto& span = spans[static_cast<std::size_t>(s)];
    const std::int64_t chunks = chunks_of(span.size);
    // A launch's grid counts chunks in an int: start a new launch well before it could wrap.
    if (batch.count == Batch::kMaxSpans ||
        (batch.count > 0 && batch.chunk_begin[batch.count] + chunks > (std::int64_t{1} << 30))) {
      launch();
      batch = Batch{};
    }
    if (batch.count == 0) {
      batch.first_span = s;
      batch.first_chunk = first_chunk;
      batch.chunk_begin[0] = 0;
    }
    check(chunks <= (std::int64_t{1} << 30), "ops: a span of ", span.size,
          " elements is too large for one launch; split it into segments below 2^43 elements");
    const int b = batch.count++;
    for (int k = 0; k < F::kDepth; ++k) batch.data[k][b] = span.data[static_cast<std::size_t>(k)];
    batch.size[b] = span.size;
    batch.misalign[b] = static_cast<std::int8_t>(span_misalignment<F>(span));
    batch.chunk_begin[b + 1] = batch.chunk_begin[b] + static_cast<std::int32_t>(chunks);
  }
  launch();
}

}  // namespace shardkit::ops::cuda
