// LARC-SGD on the CPU, pipelined. A tensor's update needs its norms first, so a plain fused step
// reads every tensor's grads (and params) twice: once for the norms, once for the update. The
// step takes the tensors in batches and reads the norms of batch b + 1 between the blocks of
// batch b's update, so one core streams both at once: the update alone keeps a core's memory
// pipe fuller than the norms pass alone does (bench_ops: SGD with momentum moves its 20 bytes
// per parameter at about 110% of copy on one thread, the norms pass its 8 at about 100%), and
// the norms ride along. Only the first batch's norms are read on their own.
//
// The norms' bits are a policy's (ChunkSums: the plain fused step's, every chunk summed with
// sums_of_squares's arithmetic and a tensor's sums its chunks' in chunk order; TreeSums: the
// norm tree's, the sharded optimizer's for every split), and the update is apply_range over the
// same chunks. Which thread takes which chunk never enters the arithmetic.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "shardkit/core/thread_pool.hpp"
#include "shardkit/ops/cpu_apply.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::ops::cpu {

// Elements per thread in a batch (4 MiB of f32 grads). The first batch's norms are read alone,
// so it should be small; a batch's norms are read during the update before it, and its grads
// again in its own update soon after, from the last-level cache if it still holds them. On the
// 2-core Xeon of docs/performance.md, 2^17 to 2^22 per thread measured alike (bench_ops'
// LARC-SGD rows, within the run-to-run spread); one batch for all (no pipelining) was slower.
inline constexpr std::int64_t kLarcBatchPerThread = std::int64_t{1} << 20;

// How a pipelined step forms a tensor's norms. A policy reads one chunk at a time: its
// Range(span, chunk) is advanced a piece at a time between other work (advance_to), then
// close() writes it into the chunk's Partial; finish() turns the partials of a batch's chunks
// into each tensor's sums.
//
// ChunkSums<K>: sums_of_squares's lanes per chunk, and a tensor's sums are its chunks' added
// in chunk order: the fused step's own bits. The last K operands are read (K = 2: params and
// grads; 1: grads alone, the params' sums being kept from the last step), into slots 2 - K .. 1.
template <std::size_t K>
struct ChunkSums {
  static constexpr bool kReadsParams = K == 2;
  using Partial = std::array<double, 2>;
  // The chunk's operands' lanes.
  struct Range : RangeSquares<K> {
    Range() = default;
    Range(const Span<4>& span, const Chunk& c)
        : RangeSquares<K>(operands(span), c.lo, c.hi, span.size) {}
    static std::array<const float*, K> operands(const Span<4>& span) {
      std::array<const float*, K> x;
      for (std::size_t k = 0; k < K; ++k) x[k] = static_cast<const float*>(span.data[2 - K + k]);
      return x;
    }
  };

  static void close(const Range& range, Partial& out) {
    const std::array<double, K> sums = range.totals();
    for (std::size_t k = 0; k < K; ++k) out[2 - K + k] = sums[k];
  }
  // sums[s - first] += the partials of span s's chunks, in chunk order.
  static void finish(const SpanList<4>&, std::span<const Chunk> chunks,
                     std::span<const Partial> partials, std::size_t first,
                     std::vector<std::array<double, 2>>& sums) {
    for (std::size_t i = 0; i < chunks.size(); ++i)
      for (std::size_t k = 2 - K; k < 2; ++k) sums[chunks[i].span - first][k] += partials[i][k];
  }
};

// TreeSums<Grad>: norm_tree.hpp's arithmetic, the bits the sharded optimizer's ParamNorms forms
// for every split of a tensor: so a step over whole tensors here equals the sharded stages'.
// Per chunk, the leaf sums of params (f32) and grads (Grad: f32, bf16 or f16) are folded into
// each one's cover of the chunk's leaves, a block of 16 leaves at a time (one node); a
// tensor's sums are its tree's roots, finished from its chunks' covers. Chunks start on
// multiples of kChunkElements, so every block starts on a multiple of 16 leaves.
template <class Grad>
struct TreeSums {
  static constexpr bool kReadsParams = true;
  static constexpr int kBlockLeaves = 16;
  static constexpr std::int64_t kBlock = kBlockLeaves * kNormLeaf;  // elements
  static_assert(kChunkElements % kBlock == 0, "chunks hold whole blocks");
  // A chunk's cover has a node per level at most (NormCoverStack).
  static constexpr int kChunkLevels =
      std::bit_width(static_cast<std::uint64_t>(kChunkElements / kNormLeaf));
  using Cover = NormCoverStack<kChunkLevels>;
  using Partial = std::array<Cover, 2>;  // params', grads'

  class Range {
   public:
    Range() = default;
    Range(const Span<4>& span, const Chunk& c)
        : params_(static_cast<const float*>(span.data[0])),
          grads_(static_cast<const Grad*>(span.data[1])),
          at_(c.lo),
          hi_(c.hi),
          size_(span.size),
          covers_{Cover(c.lo / kNormLeaf), Cover(c.lo / kNormLeaf)} {}

    void advance_to(std::int64_t until) {
      until = std::min(until, hi_);
      for (; at_ + kBlock <= until; at_ += kBlock) add_block(covers_, at_);
    }

    // The chunk's covers: the blocks not yet read, then the last short block leaf by leaf.
    Partial covers() const {
      Partial out = covers_;
      std::int64_t at = at_;
      for (; at + kBlock <= hi_; at += kBlock) add_block(out, at);
      double leaves[kBlockLeaves];
      const auto count = static_cast<int>(norm_leaves(hi_ - at));
      leaf_sums_range(params_, size_, at, hi_, leaves);
      for (int i = 0; i < count; ++i) out[0].push(0, leaves[i]);
      leaf_sums_range(grads_, size_, at, hi_, leaves);
      for (int i = 0; i < count; ++i) out[1].push(0, leaves[i]);
      return out;
    }

   private:
    void add_block(Partial& out, std::int64_t at) const {
      double leaves[kBlockLeaves];
      leaf_sums_range(params_, size_, at, at + kBlock, leaves);
      out[0].push(4, norm_subtree_in_place(leaves));
      leaf_sums_range(grads_, size_, at, at + kBlock, leaves);
      out[1].push(4, norm_subtree_in_place(leaves));
    }

    const float* params_ = nullptr;
    const Grad* grads_ = nullptr;
    std::int64_t at_ = 0, hi_ = 0, size_ = 0;
    Partial covers_{};
  };

  static void close(const Range& range, Partial& out) { out = range.covers(); }

  // sums[s - first] = span s's roots, from its chunks' covers (pushed in order into one cover
  // of the whole span, which keeps a node per level at most).
  static void finish(const SpanList<4>& spans, std::span<const Chunk> chunks,
                     std::span<const Partial> partials, std::size_t first,
                     std::vector<std::array<double, 2>>& sums) {
    for (std::size_t i = 0; i < chunks.size();) {
      const std::size_t span = chunks[i].span;
      std::array<NormCoverStack<64>, 2> whole;
      for (; i < chunks.size() && chunks[i].span == span; ++i)
        for (std::size_t k = 0; k < 2; ++k)
          for (int j = 0; j < partials[i][k].size(); ++j)
            whole[k].push(partials[i][k].node(j).level, partials[i][k].value(j));
      for (std::size_t k = 0; k < 2; ++k) {
        std::map<NormNode, double> known;
        for (int j = 0; j < whole[k].size(); ++j) known[whole[k].node(j)] = whole[k].value(j);
        sums[span - first][k] = norm_root(norm_leaves(spans[span].size), known);
      }
    }
  }
};

// The sums of each chunk of a run of LARC spans through a Norms policy, written into
// partials[i] for the run's chunk i; taken a piece at a time, advance_to(n) reading up to the
// run's n-th element, between the blocks of another loop.
template <class Norms>
class ChunkRunSquares {
 public:
  ChunkRunSquares(const SpanList<4>& spans, std::span<const Chunk> run,
                  typename Norms::Partial* partials)
      : spans_(spans), run_(run), partials_(partials) {
    for (const Chunk& c : run) elements_ += c.hi - c.lo;
  }

  std::int64_t elements() const { return elements_; }

  void advance_to(std::int64_t done) {
    while (next_ < run_.size()) {
      const Chunk& c = run_[next_];
      if (!open_) current_ = typename Norms::Range(spans_[c.span], c), open_ = true;
      const std::int64_t until = c.lo + (done - before_);
      current_.advance_to(until);
      if (until < c.hi) return;
      Norms::close(current_, partials_[next_]);
      open_ = false;
      before_ += c.hi - c.lo;
      ++next_;
    }
  }

 private:
  const SpanList<4>& spans_;
  std::span<const Chunk> run_;
  typename Norms::Partial* partials_;
  std::int64_t elements_ = 0;
  std::int64_t before_ = 0;  // elements of the chunks before next_
  std::size_t next_ = 0;     // the chunk being read
  // The chunk being read, when open_ (a member, not a std::optional: GCC 12 then warns that
  // its fields may be read uninitialised).
  typename Norms::Range current_{};
  bool open_ = false;
};

// The sums of `run`'s chunks (as ChunkRunSquares) read as two streams at once, its two halves
// side by side: a core reading one stream and doing nothing else keeps too few misses in
// flight (the first batch's norms, and the whole step when one tensor is the only batch).
template <class Norms>
void read_run_squares(const SpanList<4>& spans, std::span<const Chunk> run,
                      typename Norms::Partial* partials) {
  const std::size_t half = balanced_runs(run, 2)[1];
  ChunkRunSquares<Norms> first(spans, run.first(half), partials);
  ChunkRunSquares<Norms> second(spans, run.subspan(half), partials + half);
  for (std::int64_t done = 0; done < first.elements();) {
    done = std::min(done + kUpdateBlock, first.elements());
    first.advance_to(done);
    second.advance_to(done * second.elements() / first.elements());
  }
  second.advance_to(second.elements());
}

// Updates the chunks of `run` (coefficients per span; with kSquare, writing the sum of squares
// of the params each chunk wrote into param_squares[i]), and reads `ahead` between the blocks,
// in proportion to the elements updated, so both streams stay in flight to the end. `copy` is
// written after each block.
template <bool kSquare, class Sgd, class Ahead>
void update_run(const Sgd& op, const LowCopy& copy, const SpanList<4>& spans,
                std::span<const Chunk> run, const SgdCoefficients* coefficients,
                double* param_squares, Ahead& ahead) {
  std::int64_t total = 0;
  for (const Chunk& c : run) total += c.hi - c.lo;
  const std::int64_t ahead_total = ahead.elements();
  // Ahead elements per updated element, in double: done * ahead_total in integers overflows
  // past 2^63 (two spans of 2^32 elements); the pacing need not be exact, the end is.
  const double pace = total > 0 ? static_cast<double>(ahead_total) / static_cast<double>(total) : 0;
  std::int64_t done = 0;
  auto read_ahead = [&](std::int64_t elements) {
    done += elements;
    ahead.advance_to(
        std::min(ahead_total, static_cast<std::int64_t>(static_cast<double>(done) * pace)));
  };
  for (std::size_t i = 0; i < run.size(); ++i) {
    const Chunk& c = run[i];
    const double squares = update_in_blocks<kSquare>(op, op.segment_of(coefficients[c.span]),
                                                     spans[c.span].data.data(), c.lo, c.hi,
                                                     spans[c.span].size, read_ahead, copy);
    if constexpr (kSquare) param_squares[i] = squares;
  }
  ahead.advance_to(ahead_total);
}

// The LARC-SGD step over `spans` (operands: params, grads, momentum, low copy), its norms
// formed by the Norms policy. When it reads no params (ChunkSums<1>), the params' sums of squares
// are given in param_squares[s] (kept from the last step). With kSquare, the update writes the
// sums of squares of the params it wrote into param_squares[s]. `decays` holds each span's
// weight decay (nullptr: larc.weight_decay for all). `copy`: the params' f16/bf16 copy, written
// after each block of the update (cpu_apply.hpp).
template <class Norms, bool kSquare, class Sgd>
void larc_sgd_pipelined(ThreadPool& pool, const Sgd& op, const LowCopy& copy,
                        const SpanList<4>& spans, const LarcOptions& larc, float lr,
                        float inv_grad_scale, double* param_squares,
                        const double* decays = nullptr) {
  static_assert(Norms::kReadsParams || kSquare, "kept squares are rewritten by the update");
  using Partial = typename Norms::Partial;
  const int threads = pool.size();
  std::vector<std::pair<std::size_t, std::size_t>> batches;  // spans [first, last)
  for (std::size_t first = 0; first < spans.size();) {
    std::size_t last = first;
    std::int64_t elements = 0;
    while (last < spans.size() &&
           (last == first || elements + spans[last].size <= kLarcBatchPerThread * threads))
      elements += spans[last++].size;
    batches.emplace_back(first, last);
    first = last;
  }
  std::vector<Chunk> chunks, next_chunks;
  std::vector<Partial> partials, next_partials;
  std::vector<double> param_partials;
  std::vector<SgdCoefficients> coefficients(spans.size());
  auto cut = [&](std::size_t b, std::vector<Chunk>& out, std::vector<Partial>& sums) {
    out.clear();
    if (b < batches.size()) cut_into_chunks(spans, batches[b].first, batches[b].second, out);
    sums.assign(out.size(), {});
  };
  // Thread t's run of `list` cut at `bounds` (balanced_runs), and where it starts.
  auto run_of = [](std::int64_t t, const std::vector<std::size_t>& bounds,
                   const std::vector<Chunk>& list) {
    const std::size_t lo = bounds[static_cast<std::size_t>(t)];
    return std::pair(
        std::span<const Chunk>(list).subspan(lo, bounds[static_cast<std::size_t>(t) + 1] - lo), lo);
  };
  cut(0, chunks, partials);
  const auto first_bounds = balanced_runs(chunks, threads);
  pool.parallel_for(threads, [&](std::int64_t t) {
    const auto [run, lo] = run_of(t, first_bounds, chunks);
    read_run_squares<Norms>(spans, run, partials.data() + lo);
  });
  for (std::size_t b = 0; b < batches.size(); ++b) {
    const auto [first, last] = batches[b];
    std::vector<std::array<double, 2>> sums(last - first, std::array<double, 2>{});
    Norms::finish(spans, chunks, partials, first, sums);
    for (std::size_t s = first; s < last; ++s) {
      const double param_sum = Norms::kReadsParams ? sums[s - first][0] : param_squares[s];
      const double decay = decays != nullptr ? decays[s] : static_cast<double>(larc.weight_decay);
      coefficients[s] =
          ops::larc_coefficients(param_sum, sums[s - first][1], larc, lr, inv_grad_scale, decay);
    }
    cut(b + 1, next_chunks, next_partials);
    if constexpr (kSquare) param_partials.assign(chunks.size(), 0.0);
    const auto update_bounds = balanced_runs(chunks, threads);
    const auto ahead_bounds = balanced_runs(next_chunks, threads);
    pool.parallel_for(threads, [&](std::int64_t t) {
      const auto [ahead_run, ahead_lo] = run_of(t, ahead_bounds, next_chunks);
      ChunkRunSquares<Norms> ahead(spans, ahead_run, next_partials.data() + ahead_lo);
      const auto [update, update_lo] = run_of(t, update_bounds, chunks);
      update_run<kSquare>(op, copy, spans, update, coefficients.data(),
                          kSquare ? param_partials.data() + update_lo : nullptr, ahead);
    });
    if constexpr (kSquare) {
      for (std::size_t s = first; s < last; ++s) param_squares[s] = 0.0;
      for (std::size_t i = 0; i < chunks.size(); ++i)
        param_squares[chunks[i].span] += param_partials[i];
    }
    std::swap(chunks, next_chunks);
    std::swap(partials, next_partials);
  }
}

}  // namespace shardkit::ops::cpu
