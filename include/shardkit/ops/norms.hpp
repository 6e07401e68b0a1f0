// Segmented sums of squares (the pieces of L2 norms) and the loss scaler's unscale + finite
// check. Sums are per span, in double, in a fixed order: the same bits on every run. They are
// exposed, not the norms, because a tensor split over ranks needs sqrt(sum of all partials):
// callers all-reduce the per-segment sums of one tensor, then take the root.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "shardkit/ops/functor.hpp"

namespace shardkit::ops {

// Sums of squares of Depth operands (1: one tensor list, stored as T -- f32, or f16/bf16
// gradients; 2: f32 params and grads at once).
template <int Depth, class T = float>
struct SumOfSquaresFunctor {
  static_assert(Depth == 1 || Depth == 2, "sums of squares of one or two operands");
  static constexpr int kDepth = Depth;
  using Types = std::conditional_t<Depth == 1, TypeList<T>, TypeList<float, float>>;
  static constexpr unsigned kReads = (1u << Depth) - 1u;
  static constexpr unsigned kWrites = 0;
  static constexpr int kSums = Depth;

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[kDepth], const Segment&,
                                           double (&sums)[kDepth]) const {
    SK_UNROLL
    for (int k = 0; k < kDepth; ++k) {
      // Squares in double are exact and cannot overflow: a sum is inf or NaN only when an
      // element is, which is what the finite check relies on.
      const double v = static_cast<double>(x[k]);
      sums[k] = v * v;
    }
  }
};

// g <- g · inv_scale, summing the squares of the unscaled values. The sum is finite exactly
// when every unscaled gradient is, so one pass gives the finite check and the norm. Gradients
// in f32, or f16/bf16 under mixed precision (scaled, unscaled and stored in that dtype). The
// squares are of the values as stored: a loss scale backed off below 1 multiplies, and an f16
// gradient of 40000 unscaled by 2 is finite in f32 but stores as inf -- the check must see it.
template <class Grad = float>
struct UnscaleFunctor {
  static constexpr int kDepth = 1;
  using Types = TypeList<Grad>;
  static constexpr unsigned kReads = 1u;
  static constexpr unsigned kWrites = 1u;
  static constexpr int kSums = 1;

  float inv_scale = 1.0f;

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[1], const Segment&, double (&sums)[1]) const {
    x[0] *= inv_scale;
    if constexpr (!std::is_same_v<Grad, float>) {  // (rounded as stored: what is summed)
      Grad stored;
      store_element(&stored, x[0]);
      x[0] = load_element(&stored);
    }
    const double v = static_cast<double>(x[0]);
    sums[0] = v * v;
  }
};

SK_HOST_DEVICE SK_INLINE bool is_finite_sum(double sum) { return sum - sum == 0.0; }

}  // namespace shardkit::ops
