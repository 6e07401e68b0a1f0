// The CUDA backend of the fused ops (the twin of include/shardkit/ops/cpu_backend.hpp): the
// functors run through the multi-tensor launcher on the context's stream. Every call is
// asynchronous; results land in device tensors. Include from .cu files only.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kernels/ops/multi_tensor_apply.cuh"
#include "kernels/ops/quantize_kernels.cuh"
#include "shardkit/ops/backend.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/ops/fused_ops.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::ops {

namespace cuda {

// Kernels of this header that are not templates are written as templates of one instance
// (template <int = 0>): every translation unit that includes the header then holds the same
// mergeable definition, as an inline function would (nvcc ignores `inline` on kernels), so the
// header can sit in any .cu beside kernels/shardkit_cuda.cu.

// One thread per tensor: sums (f64 [2, n], read from the back when `reversed`; [3, n] with
// per-parameter decays when `per_param_decay`) -> coefficients.
// `gate` (the step gate, or null): its gradient factor multiplies inv_grad_scale, its rate
// replaces `lr`.
template <int = 0>
__global__ void larc_coefficients_kernel(const double* sums, std::int64_t n, bool reversed,
                                         bool per_param_decay, LarcOptions larc, float lr,
                                         float inv_grad_scale, const float* gate,
                                         SgdCoefficients* out) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  if (gate != nullptr) {
    inv_grad_scale *= gate[kGateGradFactor];
    lr = gate[kGateRate];
  }
  const std::int64_t at = reversed ? n - 1 - i : i;
  out[i] = per_param_decay
               ? ops::larc_coefficients(sums[at], sums[n + at], larc, lr, inv_grad_scale,
                                        sums[2 * n + at])
               : ops::larc_coefficients(sums[at], sums[n + at], larc, lr, inv_grad_scale);
}

inline void launch_larc_coefficients(Context& ctx, const double* sums, std::int64_t n,
                                     bool reversed, const LarcOptions& larc, float lr,
                                     float inv_grad_scale, SgdCoefficients* out,
                                     bool per_param_decay = false, const float* gate = nullptr) {
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  larc_coefficients_kernel<><<<blocks, kThreads, 0, ctx.stream()>>>(
      sums, n, reversed, per_param_decay, larc, lr, inv_grad_scale, gate, out);
  SK_CUDA_CHECK_LAUNCH("ops::cuda::larc_coefficients_kernel");
}

// A launch's spans, passed by value as the kernel's parameters (nothing uploaded, so the host
// need not wait; within the classic 4 KB limit): each span's elements and size, and its first
// leaf among this launch's leaves (first_leaf[count]: their total).
struct LeafBatch {
  static constexpr int kMaxSpans = 160;
  const void* data[kMaxSpans];
  std::int64_t size[kMaxSpans];
  std::int64_t first_leaf[kMaxSpans + 1];
  int count = 0;
};
static_assert(sizeof(LeafBatch) + 64 <= 4096, "kernel parameters over 4 KB");

// One thread per leaf of the batch's spans; `leaves` points at the batch's first leaf.
template <class T>
__global__ void leaf_sums_kernel(const LeafBatch batch, double* leaves) {
  const std::int64_t leaf = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (leaf >= batch.first_leaf[batch.count]) return;
  int lo = 0, hi = batch.count;  // the span holding this leaf: first_leaf[lo] <= leaf < [lo + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (batch.first_leaf[mid] <= leaf)
      lo = mid;
    else
      hi = mid;
  }
  const std::int64_t first = (leaf - batch.first_leaf[lo]) * kNormLeaf;
  const std::int64_t left = batch.size[lo] - first;
  leaves[leaf] = leaf_sum_of_squares(static_cast<const T*>(batch.data[lo]) + first,
                                     static_cast<int>(left < kNormLeaf ? left : kNormLeaf));
}

inline void launch_leaf_sums(Context& ctx, const SpanList<1>& spans, DType dtype, double* leaves) {
  CudaDeviceGuard guard(ctx.device().index);
  LeafBatch batch{};
  auto launch = [&] {
    const std::int64_t total = batch.first_leaf[batch.count];
    if (total > 0) {
      const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
      visit_element_dtype(dtype, [&]<class T>() {
        leaf_sums_kernel<T><<<blocks, kThreads, 0, ctx.stream()>>>(batch, leaves);
      });
      SK_CUDA_CHECK_LAUNCH("ops::cuda::leaf_sums_kernel");
    }
    leaves += total;
    batch = LeafBatch{};
  };
  for (const auto& span : spans) {
    const std::int64_t count = norm_leaves(span.size);
    // A launch's grid counts blocks in an unsigned int: start a new one well before it wraps.
    if (batch.count == LeafBatch::kMaxSpans ||
        (batch.count > 0 && batch.first_leaf[batch.count] + count > (std::int64_t{1} << 38)))
      launch();
    check(count <= (std::int64_t{1} << 38), "leaf_sums_of_squares: a span of ", span.size,
          " elements is too large for one launch; split it below 2^42 elements");
    const int b = batch.count++;
    batch.data[b] = span.data[0];
    batch.size[b] = span.size;
    batch.first_leaf[b + 1] = batch.first_leaf[b] + count;
  }
  launch();
}

// One block per node (norm_tree.hpp's norm_subtree, the same additions): thread t of the
// block's `threads` (a power of two, at most kSubtreeThreads) forms the subtree over its own
// run of `per` = 2^level / threads leaves with a binary counter -- each value arriving is added
// to the finished subtrees on the stack while its position says they pair up, the left one
// first -- then the threads' values pair up level by level in shared memory.
constexpr int kSubtreeThreads = 256;

template <int = 0>
__global__ void __launch_bounds__(kSubtreeThreads)
    norm_subtrees_kernel(const double* leaves, const std::int64_t* nodes, double* out) {
  __shared__ double partial[kSubtreeThreads];
  const std::int64_t first = nodes[2 * blockIdx.x];
  const int level = static_cast<int>(nodes[2 * blockIdx.x + 1]);
  const int threads_log2 = level < 8 ? level : 8;  // 2^8 = kSubtreeThreads
  const int threads = 1 << threads_log2;
  const std::int64_t per = std::int64_t{1} << (level - threads_log2);
  const int t = static_cast<int>(threadIdx.x);
  if (t < threads) {
    const double* x = leaves + first + t * per;
    double stack[64];  // finished subtrees, largest first; at most log2(per) + 1 deep
    int depth = 0;
    for (std::int64_t j = 0; j < per; ++j) {
      double v = x[j];
      for (std::int64_t m = j + 1; (m & 1) == 0; m >>= 1) v = stack[--depth] + v;
      stack[depth++] = v;
    }
    partial[t] = stack[0];
  }
  __syncthreads();
  for (int stride = 1; stride < threads; stride *= 2) {
    if (t < threads && t % (2 * stride) == 0) partial[t] = partial[t] + partial[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

// `on_device`: the nodes as (first, level) pairs in device memory, or null (uploaded here).
inline void launch_norm_subtrees(Context& ctx, const double* leaves,
                                 std::span<const NormSubtree> nodes, const std::int64_t* on_device,
                                 double* out) {
  if (nodes.empty()) return;
  check(nodes.size() <= 0x7fffffffu, "norm_subtree_sums: ", nodes.size(),
        " nodes in one call; at most 2^31 - 1 (one block each)");
  Tensor uploaded;
  if (on_device == nullptr) {
    std::vector<std::int64_t> table(2 * nodes.size());
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      table[2 * i] = nodes[i].first;
      table[2 * i + 1] = nodes[i].level;
    }
    uploaded = from_vector(ctx, table, {static_cast<std::int64_t>(table.size())});
    on_device = uploaded.data<std::int64_t>();
  }
  CudaDeviceGuard guard(ctx.device().index);
  norm_subtrees_kernel<><<<static_cast<unsigned>(nodes.size()), kSubtreeThreads, 0, ctx.stream()>>>(
      leaves, on_device, out);
  SK_CUDA_CHECK_LAUNCH("ops::cuda::norm_subtrees_kernel");
}

// One thread per root, each running its program (a few words: a root's cover has about
// 2·log2 nodes per piece).
template <int = 0>
__global__ void norm_roots_kernel(const double* values, const std::int64_t* table,
                                  std::int64_t roots, double* out) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= roots) return;
  out[r] = run_norm_root_program(values, table + roots + 1, table[r], table[r + 1]);
}

template <int = 0>
__global__ void clip_norm_and_factor_kernel(const double* total, double max_norm,
                                            float inv_grad_scale, double* norm, float* factor) {
  const ClipResult r = clip_result(*total, max_norm, inv_grad_scale);
  if (norm != nullptr) *norm = r.norm;
  if (factor != nullptr) *factor = __fmul_rn(*factor, r.coefficient);
}

inline void launch_norm_roots(Context& ctx, const double* values, const std::int64_t* table,
                              std::int64_t roots, double* out) {
  constexpr int kThreads = 128;
  const std::int64_t blocks = (roots + kThreads - 1) / kThreads;
  check(blocks <= 0x7fffffff, "norm_roots: ", roots, " roots in one call; at most ",
        std::int64_t{0x7fffffff} * kThreads);
  CudaDeviceGuard guard(ctx.device().index);
  norm_roots_kernel<>
      <<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream()>>>(values, table, roots, out);
  SK_CUDA_CHECK_LAUNCH("ops::cuda::norm_roots_kernel");
}

}  // namespace cuda

struct Cuda {
  static constexpr std::string_view name = "cuda";

  static void check_context(const Context& ctx, const char* op) {
    check(ctx.device().is_cuda(), op, "<sk::ops::Cuda> needs a CUDA context, got ", ctx.device(),
          "; use sk::ops::Cpu for the CPU");
  }

  template <class F>
  static void apply(Context& ctx, const F& op, const SpanList<F::kDepth>& spans) {
    static_assert(F::kSums == 0, "summing functors go through apply_sums");
    cuda::apply(ctx, op, spans);
  }

  template <class F>
  static void apply_sums(Context& ctx, const F& op, const SpanList<F::kDepth>& spans,
                         const Tensor& sums, const Tensor& found_nonfinite) {
    static_assert(F::kSums > 0, "apply_sums needs a summing functor");
    cuda::apply(ctx, op, spans, sums.data<double>(),
                found_nonfinite.defined() ? found_nonfinite.data<float>() : nullptr);
  }

  static void larc_coefficients(Context& ctx, const LarcOptions& larc, float lr,
                                float inv_grad_scale, const Tensor& sums,
                                const Tensor& coefficients, const float* gate) {
    cuda::launch_larc_coefficients(
        ctx, sums.data<double>(), sums.size(1), false, larc, lr, inv_grad_scale,
        static_cast<SgdCoefficients*>(coefficients.data_ptr()), sums.size(0) == 3, gate);
  }

  static void leaf_sums_of_squares(Context& ctx, const SpanList<1>& spans, DType dtype,
                                   double* leaves) {
    cuda::launch_leaf_sums(ctx, spans, dtype, leaves);
  }

  // On the GPU each list is its own launch: its bandwidth does not need the two streams
  // interleaved that the CPU's one thread does.
  static void leaf_sums_of_squares_pair(Context& ctx, const SpanList<2>& spans,
                                        const std::array<DType, 2>& dtypes,
                                        const std::array<double*, 2>& leaves) {
    for (std::size_t k = 0; k < 2; ++k) {
      SpanList<1> list(spans.size());
      for (std::size_t s = 0; s < spans.size(); ++s) list[s] = {{spans[s].data[k]}, spans[s].size};
      cuda::launch_leaf_sums(ctx, list, dtypes[k], leaves[k]);
    }
  }

  static void norm_subtree_sums(Context& ctx, const double* leaves,
                                std::span<const NormSubtree> nodes,
                                const std::int64_t* nodes_on_device, double* out) {
    cuda::launch_norm_subtrees(ctx, leaves, nodes, nodes_on_device, out);
  }

  static void norm_roots(Context& ctx, const double* values, const std::int64_t* table,
                         std::int64_t roots, double* out) {
    cuda::launch_norm_roots(ctx, values, table, roots, out);
  }

  static void clip_norm_and_factor(Context& ctx, const double* total, double max_norm,
                                   float inv_grad_scale, double* norm, float* factor) {
    CudaDeviceGuard guard(ctx.device().index);
    cuda::clip_norm_and_factor_kernel<>
        <<<1, 1, 0, ctx.stream()>>>(total, max_norm, inv_grad_scale, norm, factor);
    SK_CUDA_CHECK_LAUNCH("ops::cuda::clip_norm_and_factor_kernel");
  }

  static void quantize_blocks(Context& ctx, QuantFormat format, DType dtype, const void* values,
                              std::int64_t n, std::int64_t block, std::uint8_t* payload) {
    cuda::launch_quantize_blocks(ctx, format, dtype, values, n, block, payload);
  }

  static void slot_abs_max(Context& ctx, DType dtype, const void* values,
                           const std::int64_t* chunks, std::int64_t count, float* amax) {
    cuda::launch_slot_abs_max(ctx, dtype, values, chunks, count, amax);
  }
  static void quantize_by_slots(Context& ctx, QuantFormat format, DType dtype, const void* values,
                                const std::int64_t* chunks, std::int64_t count, const float* amax,
                                std::uint8_t* codes) {
    cuda::launch_quantize_by_slots(ctx, format, dtype, values, chunks, count, amax, codes);
  }
  static void dequantize_by_slots(Context& ctx, QuantFormat format, DType dtype,
                                  const std::uint8_t* codes, const std::int64_t* chunks,
                                  std::int64_t count, const float* amax, void* values) {
    cuda::launch_dequantize_by_slots(ctx, format, dtype, codes, chunks, count, amax, values);
  }
  static void dequantize_blocks(Context& ctx, QuantFormat format, DType dtype,
                                const std::uint8_t* payload, std::int64_t n, std::int64_t block,
                                void* values, bool accumulate) {
    cuda::launch_dequantize_blocks(ctx, format, dtype, payload, n, block, values, accumulate);
  }

  // One norms pass (params and grads together), one tiny coefficient kernel, one update pass.
  // The norms pass walks the tensors last to first, so the update's first reads find the L2
  // holding what it needs. With param_squares the params' squares are kept (in that reversed
  // order) for the next step, whose norms pass then reads only the grads. Here they come from a
  // pass of their own after the update, so the bytes moved stay those of the plain step: squaring
  // inside the update, as the CPU does, is a kernel that awaits a GPU to be tested on.
  template <class Sgd>
  static void larc_sgd(Context& ctx, Sgd op, const SpanList<4>& spans, const LarcOptions& larc,
                       float lr, float inv_grad_scale, LarcParamSquares* param_squares) {
    const auto n = static_cast<std::int64_t>(spans.size());
    SpanList<2> reversed(spans.size());
    SpanList<1> reversed_params(spans.size()), reversed_grads(spans.size());
    for (std::size_t s = 0; s < spans.size(); ++s) {
      const auto& span = spans[spans.size() - 1 - s];
      reversed[s].data = {span.data[0], span.data[1]};
      reversed[s].size = span.size;
      reversed_params[s] = {{span.data[0]}, span.size};
      reversed_grads[s] = {{span.data[1]}, span.size};
    }
    Tensor sums = empty(ctx, {2, n}, DType::f64);
    Tensor coefficients = empty(ctx, {n, 2}, DType::f32);
    if (param_squares != nullptr && param_squares->describes(spans)) {
      copy(ctx, sums.select(0, 0), param_squares->sums());
      cuda::apply(ctx, SumOfSquaresFunctor<1>{}, reversed_grads, sums.data<double>() + n);
    } else {
      cuda::apply(ctx, SumOfSquaresFunctor<2>{}, reversed, sums.data<double>());
    }
    cuda::launch_larc_coefficients(ctx, sums.data<double>(), n, true, larc, lr, inv_grad_scale,
                                   static_cast<SgdCoefficients*>(coefficients.data_ptr()));
    op.per_segment = static_cast<const SgdCoefficients*>(coefficients.data_ptr());
    cuda::apply(ctx, op, spans);
    if (param_squares != nullptr) {
      Tensor squares = empty(ctx, {n}, DType::f64, MemoryCategory::optimizer_state);
      cuda::apply(ctx, SumOfSquaresFunctor<1>{}, reversed_params, squares.data<double>());
      param_squares->record(spans, std::move(squares));
    }
  }
};

static_assert(OpsBackend<Cuda>);

// The GPU's fused-ops table (device_ops.hpp), which every CUDA Context carries.
inline const FusedOps* cuda_fused_ops() {
  static constexpr FusedOps kTable = fused_ops_table<Cuda>();
  return &kTable;
}

}  // namespace shardkit::ops
