// The CPU launcher: a functor applied over spans in plain loops the compiler vectorises. Sums
// use 8 lanes per chunk, combined pairwise, then chunks in order: a fixed order, so the same
// bits every run (and the loops need no -ffast-math to vectorise).
#pragma once

#include <array>
#include <cstdint>

#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/spans.hpp"

namespace shardkit::ops::cpu {

inline constexpr int kSumLanes = 8;

// Applies `op` to elements [lo, hi) of a span; when it sums, returns the lanes' pairwise total.
template <class F>
std::array<double, kSumSlots<F>> apply_range(const F& op, const typename F::Segment& segment,
                                             void* const* data, std::int64_t lo, std::int64_t hi) {
  std::array<double, kSumSlots<F>> total{};
  if constexpr (F::kSums == 0) {
    for (std::int64_t i = lo; i < hi; ++i) {
      float x[F::kDepth];
      double unused[1];
      load_operands<F>(x, data, i);
      op(x, segment, unused);
      store_operands<F>(x, data, i);
    }
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

// Applies `op` to one span (its index picks the functor's per-segment values) and returns the
// span's sums: chunk partials added in chunk order.
template <class F, int Depth>
std::array<double, kSumSlots<F>> apply_span(const F& op, const Span<Depth>& span,
                                            std::int64_t index) {
  static_assert(check_functor<F>() && Depth == F::kDepth, "span depth must match the functor");
  const auto segment = op.segment(index);
  std::array<double, kSumSlots<F>> sums{};
  if constexpr (F::kSums == 0) {
    apply_range(op, segment, span.data.data(), 0, span.size);
  } else {
    for (std::int64_t lo = 0; lo < span.size; lo += kChunkElements) {
      const std::int64_t hi = lo + kChunkElements < span.size ? lo + kChunkElements : span.size;
      const auto partial = apply_range(op, segment, span.data.data(), lo, hi);
      for (std::size_t k = 0; k < sums.size(); ++k) sums[k] += partial[k];
    }
  }
  return sums;
}

// Applies `op` over all spans; when it sums, writes span s's k-th sum to sums[k * n + s].
template <class F, int Depth>
void apply(const F& op, const SpanList<Depth>& spans, double* sums) {
  const auto n = spans.size();
  for (std::size_t s = 0; s < n; ++s) {
    const auto span_sums = apply_span(op, spans[s], static_cast<std::int64_t>(s));
    if constexpr (F::kSums > 0)
      for (int k = 0; k < F::kSums; ++k)
        sums[static_cast<std::size_t>(k) * n + s] = span_sums[static_cast<std::size_t>(k)];
  }
}

}  // namespace shardkit::ops::cpu
