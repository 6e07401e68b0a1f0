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

// Four threads per leaf of the batch's spans, a thread per group of four elements: lanes of a
// warp read consecutive groups (one float4 load for aligned f32, four scalar loads otherwise),
// and leaf_sum_of_squares' additions happen where the groups are -- each thread's (x0² + x1²) +
// (x2² + x3²), then (g0 + g1) + (g2 + g3) across its leaf's four lanes by shuffles: the same bits
// as one thread per leaf. Each thread takes kLeafGroups groups a grid apart, their loads issued
// together: one thread per leaf (64 bytes a thread) reached 44% of copy on an H200, one 16-byte
// group a thread 55%, its load waiting behind its span search. `leaves`: the batch's first leaf.
constexpr int kLeafGroups = 4;

template <class T>
__global__ void leaf_sums_kernel(const LeafBatch batch, double* leaves) {
  const std::int64_t total = batch.first_leaf[batch.count];
  const std::int64_t stride = std::int64_t{gridDim.x} * blockDim.x;  // (a multiple of 4)
  const std::int64_t quad0 = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  const int part = static_cast<int>(quad0 & 3);
  // Where each group's values are, then every group's loads, then the sums: no early return,
  // every lane takes part in the shuffles (a leaf's four lanes are all in range or all out).
  const T* where[kLeafGroups];
  std::int64_t left[kLeafGroups];
  int lo = 0;  // (the groups' leaves rise: each search starts at the last one's span)
  SK_UNROLL
  for (int j = 0; j < kLeafGroups; ++j) {
    const std::int64_t leaf = (quad0 + j * stride) >> 2;
    where[j] = nullptr;
    left[j] = 0;
    if (leaf < total) {
      int hi = batch.count;  // the span holding the leaf: first_leaf[lo] <= leaf < [lo + 1]
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (batch.first_leaf[mid] <= leaf)
          lo = mid;
        else
          hi = mid;
      }
      const std::int64_t first = (leaf - batch.first_leaf[lo]) * kNormLeaf + 4 * part;
      left[j] = batch.size[lo] - first;  // (<= 0 for the lanes past a short last leaf)
      if (left[j] > 0) where[j] = static_cast<const T*>(batch.data[lo]) + first;
    }
  }
  double q[kLeafGroups][4];
  SK_UNROLL
  for (int j = 0; j < kLeafGroups; ++j) {
    const T* x = where[j];
    if constexpr (std::is_same_v<T, float>) {
      if (left[j] >= 4 && reinterpret_cast<std::uintptr_t>(x) % 16 == 0) {
        const float4 v = *reinterpret_cast<const float4*>(x);
        q[j][0] = double(v.x), q[j][1] = double(v.y), q[j][2] = double(v.z), q[j][3] = double(v.w);
        continue;
      }
    }
    SK_UNROLL
    for (int i = 0; i < 4; ++i) q[j][i] = i < left[j] ? double(load_element(x + i)) : 0.0;
  }
  SK_UNROLL
  for (int j = 0; j < kLeafGroups; ++j) {
    const double g =
        (q[j][0] * q[j][0] + q[j][1] * q[j][1]) + (q[j][2] * q[j][2] + q[j][3] * q[j][3]);
    const double pair = g + __shfl_down_sync(0xffffffffu, g, 1);  // g0 + g1 at part 0, g2 + g3 at 2
    const double whole = pair + __shfl_down_sync(0xffffffffu, pair, 2);  // (g0 + g1) + (g2 + g3)
    const std::int64_t leaf = (quad0 + j * stride) >> 2;
    if (part == 0 && leaf < total) leaves[leaf] = whole;
  }
}

inline void launch_leaf_sums(Context& ctx, const SpanList<1>& spans, DType dtype, double* leaves) {
  CudaDeviceGuard guard(ctx.device().index);
  LeafBatch batch{};
  auto launch = [&] {
    const std::int64_t total = batch.first_leaf[batch.count];
    if (total > 0) {
      const std::int64_t per_block = std::int64_t{kThreads} * kLeafGroups;
      const auto blocks = static_cast<unsigned>((4 * total + per_block - 1) / per_block);
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
        (batch.count > 0 && batch.first_leaf[batch.count] + count > (std::int64_t{1} << 36)))
      launch();
    check(count <= (std::int64_t{1} << 36), "leaf_sums_of_squares: a span of ", span.size,
          " elements is too large for one launch; split it below 2^40 elements");
    const int b = batch.count++;
    batch.data[b] = span.data[0];
    batch.size[b] = span.size;
    batch.first_leaf[b + 1] = batch.first_leaf[b] + count;
  }
  launch();
}

// Tree nodes over leaf sums (norm_tree.hpp's norm_subtree, the same additions), in tiles of at
// most 2^11 values so that a large node is spread over many blocks: one block per node read a
// node's run alone -- ResNet-50's largest parameters are nodes of 2^17 leaf sums -- and took
// 131 us of an H200 for what is 25 MB (an LARC step's largest kernel). Three launches:
//   tile_counts   each node's tiles (1, or 2^(level - 11)) and their running total, one block;
//   tile_sums     one block per tile: its node's value when the node fits in a tile, else a
//                 level-11 node of it, each thread adding its run of up to 8 values in
//                 registers, then the threads' values in shared memory, pairwise;
//   node_sums     one block per node: its one tile's value, or its tiles' values added along the
//                 same tree (left + right, level by level).
// Every addition is one of the tree's, so every node has the bits of norm_subtree.
constexpr int kSubtreeThreads = 256;
constexpr int kTileLevel = 11;  // 2^8 threads x 8 values

// The value of the node over the 2^level values x[0..) (level <= kTileLevel) by the block's
// kSubtreeThreads threads; meaningful in thread 0. `partial`: the block's shared scratch.
SK_DEVICE SK_INLINE double block_subtree(const double* x, int level, double* partial) {
  const int t = static_cast<int>(threadIdx.x);
  const int threads_log2 = level < 8 ? level : 8;
  const int threads = 1 << threads_log2;
  const int per = 1 << (level - threads_log2);  // 1, 2, 4 or 8 values a thread
  if (t < threads) {
    double v[8];
    SK_UNROLL
    for (int j = 0; j < 8; ++j) v[j] = j < per ? x[t * per + j] : 0.0;
    SK_UNROLL
    for (int len = 8; len > 1; len /= 2)  // the run's own levels: pairs, pairs of pairs, ...
      if (len <= per) SK_UNROLL
    for (int j = 0; j < len / 2; ++j) v[j] = v[2 * j] + v[2 * j + 1];
    partial[t] = v[0];
  }
  __syncthreads();
  for (int stride = 1; stride < threads; stride *= 2) {
    if (t < threads && t % (2 * stride) == 0) partial[t] = partial[t] + partial[t + stride];
    __syncthreads();
  }
  const double value = partial[0];
  __syncthreads();  // partial is reused by the caller's next call
  return value;
}

SK_DEVICE SK_INLINE std::int64_t subtree_tiles(int level) {
  return level > kTileLevel ? std::int64_t{1} << (level - kTileLevel) : 1;
}

// tile_first[i]: node i's first tile; tile_first[n]: the tiles in all. One block of
// kSubtreeThreads threads, each over a run of consecutive nodes.
template <int = 0>
__global__ void __launch_bounds__(kSubtreeThreads)
    subtree_tile_counts_kernel(const std::int64_t* nodes, std::int64_t n,
                               std::int64_t* tile_first) {
  __shared__ std::int64_t totals[kSubtreeThreads];
  const int t = static_cast<int>(threadIdx.x);
  const std::int64_t per = (n + kSubtreeThreads - 1) / kSubtreeThreads;
  const std::int64_t begin = t * per < n ? t * per : n, end = begin + per < n ? begin + per : n;
  std::int64_t mine = 0;
  for (std::int64_t i = begin; i < end; ++i)
    mine += subtree_tiles(static_cast<int>(nodes[2 * i + 1]));
  totals[t] = mine;
  __syncthreads();
  for (int stride = 1; stride < kSubtreeThreads; stride *= 2) {  // inclusive scan
    const std::int64_t add = t >= stride ? totals[t - stride] : 0;
    __syncthreads();
    totals[t] += add;
    __syncthreads();
  }
  std::int64_t running = totals[t] - mine;
  for (std::int64_t i = begin; i < end; ++i) {
    tile_first[i] = running;
    running += subtree_tiles(static_cast<int>(nodes[2 * i + 1]));
  }
  if (t == kSubtreeThreads - 1) tile_first[n] = totals[t];
}

template <int = 0>
__global__ void __launch_bounds__(kSubtreeThreads)
    subtree_tile_sums_kernel(const double* leaves, const std::int64_t* nodes, std::int64_t n,
                             const std::int64_t* tile_first, double* tiles) {
  __shared__ double partial[kSubtreeThreads];
  const std::int64_t tile = blockIdx.x;
  std::int64_t lo = 0, hi = n;  // the node holding this tile: tile_first[lo] <= tile < [lo + 1]
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (tile_first[mid] <= tile)
      lo = mid;
    else
      hi = mid;
  }
  const int level = static_cast<int>(nodes[2 * lo + 1]);
  const int tile_level = level < kTileLevel ? level : kTileLevel;
  const double* x = leaves + nodes[2 * lo] + ((tile - tile_first[lo]) << tile_level);
  const double value = block_subtree(x, tile_level, partial);
  if (threadIdx.x == 0) tiles[tile] = value;
}

template <int = 0>
__global__ void __launch_bounds__(kSubtreeThreads)
    subtree_node_sums_kernel(const std::int64_t* nodes, const std::int64_t* tile_first,
                             const double* tiles, double* out) {
  __shared__ double partial[kSubtreeThreads];
  const std::int64_t i = blockIdx.x;
  const int level = static_cast<int>(nodes[2 * i + 1]);
  const double* x = tiles + tile_first[i];
  if (level <= kTileLevel) {
    if (threadIdx.x == 0) out[i] = x[0];
    return;
  }
  // 2^(level - 11) tile values: a block pass per 2^11 of them, the passes' values added as they
  // come (a binary counter: each finished subtree is added to its left neighbour's while their
  // positions pair up, left + right), so a node of any size is one tree.
  const int above = level - kTileLevel;
  const int pass_level = above < kTileLevel ? above : kTileLevel;
  const std::int64_t passes = std::int64_t{1} << (above - pass_level);
  double stack[64];
  int depth = 0;
  for (std::int64_t p = 0; p < passes; ++p) {
    double v = block_subtree(x + (p << pass_level), pass_level, partial);
    for (std::int64_t m = p + 1; (m & 1) == 0; m >>= 1) v = stack[--depth] + v;
    stack[depth++] = v;
  }
  if (threadIdx.x == 0) out[i] = stack[0];
}

// `on_device`: the nodes as (first, level) pairs in device memory, or null (uploaded here).
inline void launch_norm_subtrees(Context& ctx, const double* leaves,
                                 std::span<const NormSubtree> nodes, const std::int64_t* on_device,
                                 double* out) {
  if (nodes.empty()) return;
  const auto n = static_cast<std::int64_t>(nodes.size());
  std::int64_t tiles = 0;  // as subtree_tile_counts_kernel counts them, for the grid
  for (const auto& node : nodes)
    tiles += node.level > kTileLevel ? std::int64_t{1} << (node.level - kTileLevel) : 1;
  check(n <= 0x7fffffff && tiles <= 0x7fffffff, "norm_subtree_sums: ", n, " nodes in ", tiles,
        " tiles of 2^", kTileLevel, " leaf sums in one call; at most 2^31 - 1 of each");
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
  // (Stream-ordered scratch: freed after the kernels that read it, in the capture's pool when
  // captured.)
  Tensor tile_first = empty(ctx, {n + 1}, DType::i64, MemoryCategory::other);
  Tensor tile_values = empty(ctx, {tiles}, DType::f64, MemoryCategory::other);
  CudaDeviceGuard guard(ctx.device().index);
  subtree_tile_counts_kernel<>
      <<<1, kSubtreeThreads, 0, ctx.stream()>>>(on_device, n, tile_first.data<std::int64_t>());
  SK_CUDA_CHECK_LAUNCH("ops::cuda::subtree_tile_counts_kernel");
  subtree_tile_sums_kernel<><<<static_cast<unsigned>(tiles), kSubtreeThreads, 0, ctx.stream()>>>(
      leaves, on_device, n, tile_first.data<std::int64_t>(), tile_values.data<double>());
  SK_CUDA_CHECK_LAUNCH("ops::cuda::subtree_tile_sums_kernel");
  subtree_node_sums_kernel<><<<static_cast<unsigned>(n), kSubtreeThreads, 0, ctx.stream()>>>(
      on_device, tile_first.data<std::int64_t>(), tile_values.data<double>(), out);
  SK_CUDA_CHECK_LAUNCH("ops::cuda::subtree_node_sums_kernel");
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

// The squares of one operand of a (param, grad) pair, the other left unread: apply() lays a
// span's elements over threads by its operands' common alignment, so walking the pair's spans
// adds each value in the order SumOfSquaresFunctor<2> over the pair does, and the sums are the
// pair pass's bit for bit -- whatever the other operand's alignment does to the layout.
template <int K>
struct PairOperandSquaresFunctor {
  static_assert(K == 0 || K == 1, "operand 0 (params) or 1 (grads) of the pair");
  static constexpr int kDepth = 2;
  using Types = TypeList<float, float>;
  static constexpr unsigned kReads = 1u << K;
  static constexpr unsigned kWrites = 0;
  static constexpr int kSums = 1;

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[kDepth], const Segment&,
                                           double (&sums)[1]) const {
    const double v = static_cast<double>(x[K]);
    sums[0] = v * v;
  }
};

// An update that also sums the squares of the params it writes (operand 0 after the rule, the
// value stored): the next step's ||w||² from registers, without reading w again. For a span
// that apply() walks as it walks the (param, grad) pair, the sum is PairOperandSquaresFunctor<0>'s
// over the updated params, bit for bit. Not gated (a summing functor must run whole; LARC's
// fused step refuses a gate, fused_ops.hpp).
template <class F>
struct SquaringParamsFunctor {
  static_assert(F::kSums == 0 && writes<F>(0), "an update that writes operand 0 and sums nothing");
  static constexpr int kDepth = F::kDepth;
  using Types = typename F::Types;
  static constexpr unsigned kReads = F::kReads;
  static constexpr unsigned kWrites = F::kWrites;
  static constexpr int kSums = 1;
  using Segment = typename F::Segment;

  F update;
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t index) const {
    return update.segment(index);
  }
  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[kDepth], const Segment& segment,
                                           double (&sums)[1]) const {
    update(x, segment, sums);
    const double v = static_cast<double>(x[0]);
    sums[0] = v * v;
  }
};

// Per span, how apply() walks a (param, grad) pair: the key LarcParamSquares keeps beside the
// sums (a change of it would change their bits).
inline std::vector<std::int8_t> pair_walk(const SpanList<2>& pairs) {
  std::vector<std::int8_t> walk(pairs.size());
  for (std::size_t s = 0; s < pairs.size(); ++s)
    walk[s] = static_cast<std::int8_t>(span_misalignment<PairOperandSquaresFunctor<0>>(pairs[s]));
  return walk;
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
  // holding what it needs. With param_squares the update also squares the params it writes
  // (kept in that reversed order) and the next step's norms pass reads only the grads: 24 bytes
  // a parameter instead of 28. Every sum of squares walks a span as the (param, grad) pass
  // does, so the bits are the same with the kept sums or without; where the update's operands
  // are aligned otherwise than the pair (it would walk the params differently), the squares
  // take a pass of their own after it.
  template <class Sgd>
  static void larc_sgd(Context& ctx, Sgd op, const SpanList<4>& spans, const LarcOptions& larc,
                       float lr, float inv_grad_scale, LarcParamSquares* param_squares) {
    const auto n = static_cast<std::int64_t>(spans.size());
    SpanList<2> reversed(spans.size());
    for (std::size_t s = 0; s < spans.size(); ++s) {
      const auto& span = spans[spans.size() - 1 - s];
      reversed[s].data = {span.data[0], span.data[1]};
      reversed[s].size = span.size;
    }
    Tensor sums = empty(ctx, {2, n}, DType::f64);
    Tensor coefficients = empty(ctx, {n, 2}, DType::f32);
    const std::vector<std::int8_t> walk =
        param_squares != nullptr ? cuda::pair_walk(reversed) : std::vector<std::int8_t>{};
    if (param_squares != nullptr && param_squares->describes(spans, walk)) {
      copy(ctx, sums.select(0, 0), param_squares->sums());
      cuda::apply(ctx, cuda::PairOperandSquaresFunctor<1>{}, reversed, sums.data<double>() + n);
    } else {
      cuda::apply(ctx, SumOfSquaresFunctor<2>{}, reversed, sums.data<double>());
    }
    cuda::launch_larc_coefficients(ctx, sums.data<double>(), n, true, larc, lr, inv_grad_scale,
                                   static_cast<SgdCoefficients*>(coefficients.data_ptr()));
    op.per_segment = static_cast<const SgdCoefficients*>(coefficients.data_ptr());
    if (param_squares == nullptr) return cuda::apply(ctx, op, spans);
    Tensor squares = empty(ctx, {n}, DType::f64, MemoryCategory::optimizer_state);
    const cuda::SquaringParamsFunctor<Sgd> squaring{op};
    bool walked_alike = true;
    for (std::size_t s = 0; s < spans.size(); ++s)
      walked_alike = walked_alike && cuda::span_misalignment<decltype(squaring)>(spans[s]) ==
                                         walk[spans.size() - 1 - s];
    if (walked_alike) {
      cuda::apply(ctx, squaring, spans, squares.data<double>(), nullptr, cuda::SumOrder::reversed);
    } else {
      cuda::apply(ctx, op, spans);
      cuda::apply(ctx, cuda::PairOperandSquaresFunctor<0>{}, reversed, squares.data<double>());
    }
    param_squares->record(spans, std::move(squares), walk);
  }
};

static_assert(OpsBackend<Cuda>);

// The GPU's fused-ops table (device_ops.hpp), which every CUDA Context carries.
inline const FusedOps* cuda_fused_ops() {
  static constexpr FusedOps kTable = fused_ops_table<Cuda>();
  return &kTable;
}

}  // namespace shardkit::ops
