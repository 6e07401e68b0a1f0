// The CPU launcher: a functor applied over spans in plain loops the compiler vectorises (the
// paired sums of squares, the leaf sums and the f16 / bf16 casts in explicit SIMD), on the
// context's thread pool. Spans are cut into chunks of kChunkElements from their start; each
// chunk sums in 8 lanes combined pairwise, and a span's sum is its chunks' partials added in
// chunk order. Which thread runs a chunk never enters the arithmetic, so the bits are the same
// for any thread count (and the loops need no -ffast-math to vectorise).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "shardkit/core/half_runs.hpp"
#include "shardkit/core/thread_pool.hpp"
#include "shardkit/ops/cast.hpp"
#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/spans.hpp"
#include "shardkit/ops/step_gate.hpp"

namespace shardkit::ops::cpu {

inline constexpr int kSumLanes = 8;
// How many elements ahead the read-only norm passes prefetch (4 KiB of f32, 2 KiB of bf16):
// enough lines in flight to cover DRAM's latency at one core's streaming rate, few enough to
// stay in L1.
inline constexpr std::int64_t kPrefetchAhead = 1024;

// Whether F is a cast with a SIMD run in half_runs.hpp.
template <class F>
constexpr bool has_cast_run() {
  if constexpr (requires { typename F::Source; })
    return ::shardkit::detail::has_convert_run<typename F::Source, typename F::Destination>;
  else
    return false;
}

namespace detail {
// Prefetches element i of every operand F touches (for writing where F writes it).
template <class F, std::size_t... K>
void prefetch_operands(void* const* data, std::int64_t i, std::index_sequence<K...>) {
#if !defined(__CUDACC__)
  (
      [&] {
        if constexpr (writes<F>(K))
          __builtin_prefetch(static_cast<const operand_t<F, K>*>(data[K]) + i, 1, 3);
        else if constexpr (reads<F>(K))
          __builtin_prefetch(static_cast<const operand_t<F, K>*>(data[K]) + i, 0, 3);
      }(),
      ...);
#else
  (void)data, (void)i;
#endif
}
}  // namespace detail

// An update loop (apply_range of a functor that sums nothing) goes kUpdateGroup elements at a
// time, prefetching every operand kUpdatePrefetchAhead elements ahead of the group (2 KiB of
// f32), into the next chunk or block too. The hardware prefetchers alone keep too few misses in
// flight for one core streaming three to five operands, the fewer the shorter the calls:
// LARC-SGD with the params' squares kept, whose update runs 256 elements a call, took 30.8 ms
// per ResNet-50 step on one thread without these prefetches and 27.1 ms with them; SGD with
// momentum, 8192 a call, 21.5 and 21.0 ms (bench_ops BM_larc_sgd_fused_kept and
// BM_sgd_momentum, flat:0). The group's fixed-count loop vectorises for every functor as long
// as the functors choose by selects on floats (sgd.hpp); it measured 2-6% faster than a strip
// of prefetches followed by a loop of variable length (SGD with a bf16 copy, then written by the
// loop itself, and LARC-SGD).
inline constexpr int kUpdateGroup = 16;
inline constexpr std::int64_t kUpdatePrefetchAhead = 512;

// Applies `op` to elements [lo, hi) of a span whose operands hold `readable` elements (>= hi;
// the prefetches stay before it, and may run into the next chunk); when it sums, returns the
// lanes' pairwise total. The functor, its segment and the operand pointers are taken by value:
// as locals, the stores into the operands cannot alias them, so the loop keeps them in
// registers, hoists the rule's branches on them, and vectorises (by reference, GCC reloads them
// every element and stays scalar).
template <class F>
std::array<double, kSumSlots<F>> apply_range(const F op, const typename F::Segment segment,
                                             void* const* operands, std::int64_t lo,
                                             std::int64_t hi, std::int64_t readable) {
  void* data[F::kDepth];
  for (int k = 0; k < F::kDepth; ++k) data[k] = operands[k];
  std::array<double, kSumSlots<F>> total{};
  if constexpr (has_cast_run<F>()) {  // SIMD runs (half_runs.hpp): the same bits
    using From = typename F::Source;
    using To = typename F::Destination;
    ::shardkit::detail::convert_run(static_cast<const From*>(data[0]) + lo,
                                    static_cast<To*>(data[1]) + lo, hi - lo);
  } else if constexpr (F::kSums == 0) {
    auto element = [&](std::int64_t i) {
      float x[F::kDepth];
      double unused[1];
      load_operands<F>(x, data, i);
      op(x, segment, unused);
      store_operands<F>(x, data, i);
    };
    std::int64_t i = lo;
    for (; i + kUpdateGroup <= hi; i += kUpdateGroup) {
      if (i + kUpdatePrefetchAhead < readable)
        detail::prefetch_operands<F>(data, i + kUpdatePrefetchAhead,
                                     std::make_index_sequence<F::kDepth>{});
      for (int l = 0; l < kUpdateGroup; ++l) element(i + l);
    }
    for (; i < hi; ++i) element(i);
  } else {
    double lanes[F::kSums][kSumLanes] = {};
    std::int64_t i = lo;
    for (; i + kSumLanes <= hi; i += kSumLanes) {
      // Lane l takes element i + l: a fixed-count inner loop the vectoriser maps onto SIMD
      // lanes without reassociating any sum.
      for (int l = 0; l < kSumLanes; ++l) {
        float x[F::kDepth];
        double sums[F::kSums];
        load_operands<F>(x, data, i + l);
        op(x, segment, sums);
        store_operands<F>(x, data, i + l);
        if constexpr (F::kSums == 1) {
          lanes[0][l] += sums[0];
        } else {
          lanes[0][l] += sums[0];
          lanes[1][l] += sums[1];
        }
      }
    }
    for (int l = 0; i < hi; ++i, ++l) {
      float x[F::kDepth];
      double sums[F::kSums];
      load_operands<F>(x, data, i);
      op(x, segment, sums);
      store_operands<F>(x, data, i);
      for (int k = 0; k < F::kSums; ++k) lanes[k][l] += sums[k];
    }
    for (int k = 0; k < F::kSums; ++k) {
      double* a = lanes[k];
      for (int width = kSumLanes / 2; width > 0; width /= 2)  // a fixed pairwise tree
        for (int l = 0; l < width; ++l) a[l] += a[l + width];
      total[static_cast<std::size_t>(k)] = a[0];
    }
  }
  return total;
}

// One unit of parallel work: elements [lo, hi) of span `span`, at most kChunkElements.
struct Chunk {
  std::size_t span;
  std::int64_t lo, hi;
};

// Appends the chunks of spans [first, last) in order.
template <int Depth>
void cut_into_chunks(const SpanList<Depth>& spans, std::size_t first, std::size_t last,
                     std::vector<Chunk>& chunks) {
  for (std::size_t s = first; s < last; ++s)
    for (std::int64_t lo = 0; lo < spans[s].size; lo += kChunkElements)
      chunks.push_back(Chunk{s, lo, std::min(lo + kChunkElements, spans[s].size)});
}

namespace detail {
// GCC/Clang vector types (nvcc's host pass accepts them too): four lanes of the sums at once,
// whatever SIMD the -march allows (two SSE registers each without AVX).
using F64x4 = double __attribute__((vector_size(32)));

// (Element by element: GCC turns this into one vcvtps2pd, where __builtin_convertvector
// splits it in halves.) The result is written through a reference, not returned: a 32-byte
// vector returned by value changes the ABI between builds with and without AVX, which GCC
// reports (-Wpsabi) in a user's build at the default -march.
inline void widen4(const float* p, F64x4& out) { out = F64x4{p[0], p[1], p[2], p[3]}; }
// bf16 -> f32 is a shift of the bits, so this stays branch-free too.
inline void widen4(const BFloat16* p, F64x4& out) {
  out = F64x4{p[0].to_float(), p[1].to_float(), p[2].to_float(), p[3].to_float()};
}

// A software prefetch into all cache levels (none in nvcc's passes, which see no intrinsics
// here). A prefetch past the end of a mapping would not fault, but the callers stay inside
// their arrays.
inline void prefetch_for_read(const void* p) {
#if !defined(__CUDACC__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}
}  // namespace detail

// Eight lanes of a running sum of squares of one f32 stream, with apply_range's arithmetic
// for a summing functor: element start + 8k + l is added to lane l, in order of k, then total()
// adds the lanes along a fixed pairwise tree. The lanes are held as two vectors (GCC's vectoriser
// leaves the generic loop's lanes scalar when two sets of them interleave). A square of a float
// is exact in double, so a fused multiply-add changes no bit.
class SquareLanes {
 public:
  // Adds the squares of x[0, 8) to lanes 0-7.
  void add8(const float* x) {
#if defined(__CUDACC__)
    for (int l = 0; l < kSumLanes; ++l) {
      const double v = x[l];
      lanes_[l] += v * v;
    }
#else
    detail::F64x4 low, high;
    detail::widen4(x, low);
    detail::widen4(x + 4, high);
    low_ += low * low;
    high_ += high * high;
#endif
  }
  // Adds the squares of tail[0, count) (count < 8) to lanes 0 .. count-1, then the lanes'
  // pairwise total.
  double total(const float* tail, std::int64_t count) const {
    double lanes[kSumLanes];
#if defined(__CUDACC__)
    for (int l = 0; l < kSumLanes; ++l) lanes[l] = lanes_[l];
#else
    std::memcpy(lanes, &low_, sizeof low_);
    std::memcpy(lanes + 4, &high_, sizeof high_);
#endif
    for (std::int64_t l = 0; l < count; ++l) {
      const double x = tail[l];
      lanes[l] += x * x;
    }
    for (int width = kSumLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    return lanes[0];
  }

 private:
#if defined(__CUDACC__)
  double lanes_[kSumLanes] = {};  // nvcc's host pass fails on constants of vector type members
#else
  detail::F64x4 low_{}, high_{};  // lanes 0-3 and 4-7
#endif
};

// The sums of squares of K f32 operands over [lo, hi), taken a piece at a time: advance_to(i)
// adds the groups of 16 elements that end by i, totals() adds the rest and returns the sums.
// Every element goes to the lane it would in one call (SquareLanes per operand, counted from
// lo), so the pieces change no bit: the sums are apply_range's for SumOfSquaresFunctor<K>.
// Between pieces the caller streams other data (LARC-SGD's update, cpu_larc.hpp).
//
// Every operand is prefetched kPrefetchAhead elements ahead, up to `readable` (the end of the
// arrays, which may lie past hi: the next chunk's first lines then arrive in time too). With
// the hardware prefetchers alone, one core reading two streams from DRAM keeps too few misses
// in flight: the fused LARC-SGD step over one 2^26-element segment took 97.6 ms on one thread,
// 89-92 ms with these prefetches (bench_ops BM_larc_sgd_fused/flat:1, docs/performance.md).
template <std::size_t K>
class RangeSquares {
 public:
  RangeSquares() = default;  // an empty range
  RangeSquares(const std::array<const float*, K>& x, std::int64_t lo, std::int64_t hi,
               std::int64_t readable)
      : x_(x), at_(lo), hi_(hi), readable_(readable) {}

  void advance_to(std::int64_t until) {
    static_assert(2 * kSumLanes * sizeof(float) == 64, "one prefetch per cache line and operand");
    until = std::min(until, hi_);
    std::array<SquareLanes, K> lanes = lanes_;  // locals, so the loop keeps them in registers
    std::int64_t i = at_;
    for (; i + 2 * kSumLanes <= until; i += 2 * kSumLanes) {
      if (i + kPrefetchAhead < readable_)
        for (std::size_t k = 0; k < K; ++k) detail::prefetch_for_read(x_[k] + i + kPrefetchAhead);
      for (std::size_t k = 0; k < K; ++k) lanes[k].add8(x_[k] + i);
      for (std::size_t k = 0; k < K; ++k) lanes[k].add8(x_[k] + i + kSumLanes);
    }
    lanes_ = lanes;
    at_ = i;
  }

  std::array<double, K> totals() const {
    std::array<SquareLanes, K> lanes = lanes_;
    std::int64_t i = at_;
    for (; i + kSumLanes <= hi_; i += kSumLanes)
      for (std::size_t k = 0; k < K; ++k) lanes[k].add8(x_[k] + i);
    std::array<double, K> sums;
    for (std::size_t k = 0; k < K; ++k) sums[k] = lanes[k].total(x_[k] + i, hi_ - i);
    return sums;
  }

 private:
  std::array<const float*, K> x_{};
  std::int64_t at_ = 0, hi_ = 0, readable_ = 0;  // [lo, at_) is in the lanes
  std::array<SquareLanes, K> lanes_{};
};

// The sums of squares of K f32 operands over [lo, hi) in one piece.
template <std::size_t K>
std::array<double, K> sums_of_squares(const std::array<const float*, K>& x, std::int64_t lo,
                                      std::int64_t hi, std::int64_t readable) {
  RangeSquares<K> range(x, lo, hi, readable);
  range.advance_to(hi);
  return range.totals();
}

// The two-operand case, as the norms passes call it.
inline std::array<double, 2> sums_of_squares_pair(const float* a, const float* b, std::int64_t lo,
                                                  std::int64_t hi, std::int64_t readable) {
  return sums_of_squares<2>({a, b}, lo, hi, readable);
}

// The f16/bf16 copy of the updated parameters that an optimizer functor may write (SgdFunctor,
// AdamFunctor: its last operand, x[last] = x[0], the copy a mixed-precision forward reads). On
// the CPU the functor runs without it (F::WithoutCopy) and the copy is converted from the
// parameters each chunk (8192 elements, cpu::apply) or LARC block (256, update_in_blocks) has
// just updated, while they are in cache: the same bits (half_runs.hpp's runs round as
// store_element does; their F16C body raises the floating-point flags, as that header says),
// and one update loop per rule instead of one per copy dtype -- the f16 and bf16 copies of
// f32-gradient steps had been a tenth of the kernel tables' compile (docs/performance.md).
struct LowCopy {
  DType dtype = DType::f32;  // f32: no copy
  int operand = 0;           // the copy's operand

  // Writes the copy of elements [lo, hi) of the f32 parameters (operand 0).
  void write(void* const* operands, std::int64_t lo, std::int64_t hi) const {
    const float* params = static_cast<const float*>(operands[0]) + lo;
    if (dtype == DType::f16)
      ::shardkit::detail::convert_run(params, static_cast<Half*>(operands[operand]) + lo, hi - lo);
    else if (dtype == DType::bf16)
      ::shardkit::detail::convert_run(params, static_cast<BFloat16*>(operands[operand]) + lo,
                                      hi - lo);
  }
};

// Whether F writes such a copy; then F::WithoutCopy is the rule the CPU runs, with
// low_copy<F>() written after it.
template <class F>
constexpr bool writes_low_copy() {
  if constexpr (requires { typename F::LowStorage; })
    return !std::is_void_v<typename F::LowStorage>;
  else
    return false;
}
template <class F>
LowCopy low_copy() {
  using Low = typename F::LowStorage;
  using Rule = typename F::WithoutCopy;
  static_assert(std::is_same_v<Low, Half> || std::is_same_v<Low, BFloat16>,
                "a low-precision copy is f16 or bf16");
  static_assert(std::is_same_v<operand_t<F, 0>, float> && Rule::kDepth == F::kDepth &&
                    writes<F>(F::kDepth - 1) && !writes<Rule>(F::kDepth - 1) &&
                    Rule::kWrites == (F::kWrites & ~(1u << (F::kDepth - 1))),
                "the copy is the last operand, of f32 params (operand 0), and all the rule "
                "without it does not write");
  return LowCopy{std::is_same_v<Low, Half> ? DType::f16 : DType::bf16, F::kDepth - 1};
}

// Calls fn(rule, copy) with what the CPU runs for `op`: F::WithoutCopy and its LowCopy when F
// writes a copy, else `op` itself and no copy.
template <class F, class Fn>
void with_low_copy(const F& op, Fn&& fn) {
  if constexpr (writes_low_copy<F>())
    fn(op.without_copy(), low_copy<F>());
  else
    fn(op, LowCopy{});
}

// Elements per block of update_in_blocks: a block's operands (params, grads and momentum, 3 KiB
// of f32 at 256) are still in L1 when its params are squared.
inline constexpr std::int64_t kUpdateBlock = 256;

// apply_range(op, segment, operands, lo, hi, readable) for an update, kUpdateBlock elements at a
// time, calling after_block(elements) after each block (cpu_larc.hpp reads other data there).
// With kSquare, for a functor that writes f32 params as operand 0, it returns the sum of squares
// of the params it wrote over [lo, hi) with sums_of_squares's arithmetic (SquareLanes counted
// from lo): the bits the next norms pass would find, taken from L1 right after each block is
// written instead of read from memory again. The blocks run through apply_range itself, the
// very loop of the update without the squares; `copy` is written after each.
template <bool kSquare, class F, class AfterBlock>
double update_in_blocks(const F& op, const typename F::Segment& segment, void* const* operands,
                        std::int64_t lo, std::int64_t hi, std::int64_t readable,
                        AfterBlock&& after_block, const LowCopy& copy = {}) {
  static_assert(F::kSums == 0, "an update sums nothing; its squares are taken separately");
  static_assert(kUpdateBlock % kSumLanes == 0, "blocks keep the lanes counted from lo");
  const float* params = static_cast<const float*>(operands[0]);
  SquareLanes lanes;
  std::int64_t squared = lo;  // [lo, squared) added in groups of eight
  for (std::int64_t block = lo; block < hi; block += kUpdateBlock) {
    const std::int64_t end = std::min(hi, block + kUpdateBlock);
    apply_range(op, segment, operands, block, end, readable);
    copy.write(operands, block, end);
    if constexpr (kSquare)
      for (; squared + kSumLanes <= end; squared += kSumLanes) lanes.add8(params + squared);
    after_block(end - block);
  }
  return kSquare ? lanes.total(params + squared, hi - squared) : 0.0;
}

// Cuts `chunks` into `parts` contiguous runs of about equal elements (whole chunks): run t is
// chunks [bounds[t], bounds[t + 1]).
inline std::vector<std::size_t> balanced_runs(std::span<const Chunk> chunks, int parts) {
  std::int64_t total = 0;
  for (const Chunk& c : chunks) total += c.hi - c.lo;
  std::vector<std::size_t> bounds(static_cast<std::size_t>(parts) + 1, chunks.size());
  bounds[0] = 0;
  std::int64_t before = 0;  // elements of chunks [0, i)
  std::size_t i = 0;
  for (int t = 1; t < parts; ++t) {
    const std::int64_t target = total * t / parts;
    while (i < chunks.size() && before + (chunks[i].hi - chunks[i].lo) / 2 < target)
      before += chunks[i].hi - chunks[i].lo, ++i;
    bounds[static_cast<std::size_t>(t)] = i;
  }
  return bounds;
}

// leaf_sum_of_squares (norm_tree.hpp) of `leaves` whole f32 or bf16 leaves x[16 k .. 16 k + 16)
// into out[k], with the same additions in the same order: the four groups g[j] = (q[4j] + q[4j+1])
// + (q[4j+2] + q[4j+3]) as the lanes of one vector, from the squares transposed so that lane j
// holds group j, then (g0 + g1) + (g2 + g3). (Squares of floats are exact in double.) nvcc's
// host pass has no __builtin_shufflevector (GCC 12 and clang have it): there it is the scalar
// function. Prefetches kPrefetchAhead elements ahead while that stays before `readable` (the
// end of x's array), as sums_of_squares_pair does.
template <class T>
void leaf_sums_of_squares_lanes(const T* x, std::int64_t leaves, double* out, const T* readable) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, BFloat16>,
                "four-lane leaf sums take f32 or bf16 (f16's conversion branches)");
#if defined(__CUDACC__)
  (void)readable;
  for (std::int64_t k = 0; k < leaves; ++k)
    out[k] = leaf_sum_of_squares(x + k * kNormLeaf, static_cast<int>(kNormLeaf));
#else
  using detail::F64x4;
  using detail::widen4;
  for (std::int64_t k = 0; k < leaves; ++k, x += kNormLeaf) {
    if (readable - x > kPrefetchAhead) detail::prefetch_for_read(x + kPrefetchAhead);
    F64x4 r0, r1, r2, r3;
    widen4(x, r0);
    widen4(x + 4, r1);
    widen4(x + 8, r2);
    widen4(x + 12, r3);
    r0 *= r0, r1 *= r1, r2 *= r2, r3 *= r3;                        // row j: q[4j .. 4j + 4)
    const F64x4 t0 = __builtin_shufflevector(r0, r1, 0, 4, 2, 6);  // q0 q4 q2 q6
    const F64x4 t1 = __builtin_shufflevector(r0, r1, 1, 5, 3, 7);  // q1 q5 q3 q7
    const F64x4 t2 = __builtin_shufflevector(r2, r3, 0, 4, 2, 6);  // q8 q12 q10 q14
    const F64x4 t3 = __builtin_shufflevector(r2, r3, 1, 5, 3, 7);  // q9 q13 q11 q15
    // Lane j of a, b, c, d: q[4j], q[4j+1], q[4j+2], q[4j+3].
    const F64x4 a = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
    const F64x4 b = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
    const F64x4 c = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
    const F64x4 d = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
    const F64x4 g = (a + b) + (c + d);
    out[k] = (g[0] + g[1]) + (g[2] + g[3]);
  }
#endif
}

// The leaf sums of x[lo, hi) (lo a multiple of kNormLeaf) into out[0, ...); x holds `size`
// elements (the prefetches stop at its end, not at hi). f16 leaves go one at a time (its
// conversion branches); f32 and bf16 four lanes at a time.
template <class T>
void leaf_sums_range(const T* x, std::int64_t size, std::int64_t lo, std::int64_t hi, double* out) {
  std::int64_t at = lo;
  if constexpr (!std::is_same_v<T, Half>) {
    const std::int64_t whole = (hi - at) / kNormLeaf;
    leaf_sums_of_squares_lanes(x + at, whole, out, x + size);
    at += whole * kNormLeaf;
    out += whole;
  }
  for (; at < hi; at += kNormLeaf)
    *out++ = leaf_sum_of_squares(x + at, static_cast<int>(std::min(kNormLeaf, hi - at)));
}

// A chunk's sums (f32 sums of squares of one or two operands through the loops above).
template <class F, int Depth>
std::array<double, kSumSlots<F>> chunk_sums(const F& op, const Span<Depth>& span,
                                            const typename F::Segment& segment, std::int64_t lo,
                                            std::int64_t hi) {
  if constexpr (std::is_same_v<F, SumOfSquaresFunctor<2>>) {
    return sums_of_squares_pair(static_cast<const float*>(span.data[0]),
                                static_cast<const float*>(span.data[1]), lo, hi, span.size);
  } else if constexpr (std::is_same_v<F, SumOfSquaresFunctor<1, float>>) {
    return sums_of_squares<1>({static_cast<const float*>(span.data[0])}, lo, hi, span.size);
  } else {
    return apply_range(op, segment, span.data.data(), lo, hi, span.size);
  }
}

// Applies `op` over all spans, chunks spread over the pool's threads; when it sums, writes span
// s's k-th sum to sums[k * n + s]. An update writes `copy` after each chunk.
template <class F, int Depth>
void apply(ThreadPool& pool, const F& op, const SpanList<Depth>& spans, double* sums,
           const LowCopy& copy = {}) {
  static_assert(check_functor<F>() && Depth == F::kDepth, "span depth must match the functor");
  if (gate_skips(op)) return;  // (on the CPU the gate is read here, in the stream's order)
  const auto n = spans.size();
  std::vector<Chunk> chunks;
  chunks.reserve(static_cast<std::size_t>(total_chunks(spans)));
  cut_into_chunks(spans, 0, n, chunks);
  const auto tasks = static_cast<std::int64_t>(chunks.size());
  if constexpr (F::kSums == 0) {
    pool.parallel_for(tasks, [&](std::int64_t i) {
      const Chunk& c = chunks[static_cast<std::size_t>(i)];
      void* const* operands = spans[c.span].data.data();
      apply_range(op, op.segment(static_cast<std::int64_t>(c.span)), operands, c.lo, c.hi,
                  spans[c.span].size);
      copy.write(operands, c.lo, c.hi);
    });
  } else {
    SK_ASSERT(copy.dtype == DType::f32);  // (a summing functor writes no parameter copy)
    std::vector<std::array<double, F::kSums>> partials(chunks.size());
    pool.parallel_for(tasks, [&](std::int64_t i) {
      const Chunk& c = chunks[static_cast<std::size_t>(i)];
      partials[static_cast<std::size_t>(i)] =
          chunk_sums(op, spans[c.span], op.segment(static_cast<std::int64_t>(c.span)), c.lo, c.hi);
    });
    for (std::size_t k = 0; k < F::kSums * n; ++k) sums[k] = 0.0;
    for (std::size_t i = 0; i < chunks.size(); ++i)
      for (std::size_t k = 0; k < F::kSums; ++k) sums[k * n + chunks[i].span] += partials[i][k];
  }
}

}  // namespace shardkit::ops::cpu
