// Precision casts between f32 and f16/bf16 (round to nearest even, bit-exact with
// core/float16.hpp) as a fused-op functor: many tensors in one launch.
#pragma once

#include <cstdint>

#include "shardkit/ops/functor.hpp"

namespace shardkit::ops {

// Operands: 0 source (From), 1 destination (To).
template <class From, class To>
struct CastFunctor {
  static_assert(is_element_type_v<From> && is_element_type_v<To>,
                "casts go between float, sk::Half and sk::BFloat16");
  static constexpr int kDepth = 2;
  using Types = TypeList<From, To>;
  using Source = From;
  using Destination = To;
  static constexpr unsigned kReads = 0b01u;
  static constexpr unsigned kWrites = 0b10u;
  static constexpr int kSums = 0;

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }

  // Loads widen exactly and the store rounds once: From -> float -> To is the direct cast.
  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[2], const Segment&, double (&)[1]) const {
    x[1] = x[0];
  }
};

}  // namespace shardkit::ops
