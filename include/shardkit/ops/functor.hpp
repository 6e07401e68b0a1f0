// The element-functor contract shared by the CPU loop (cpu_apply.hpp) and the CUDA launcher
// (kernels/ops/multi_tensor_apply.cuh), and the operand load/store helpers both use.
//
// A functor F is a small trivially copyable struct (passed by value to kernels) with:
//   static constexpr int kDepth;        operands per span
//   using Types = TypeList<...>;         storage type of each operand (float, Half, BFloat16)
//   static constexpr unsigned kReads;    bit k set: operand k is loaded
//   static constexpr unsigned kWrites;   bit k set: operand k is stored after the rule ran
//   static constexpr int kSums;          0..2 values summed per segment (in double)
//   using Segment = ...;                 what the rule needs per span (e.g. LARC coefficients)
//   Segment segment(std::int64_t index) const;
//   void operator()(float (&x)[kDepth], const Segment&, double (&sums)[kSumSlots<F>]) const;
// The rule reads and rewrites x in place and writes this element's contributions to `sums`.
// Optionally, a non-summing functor has a member `const float* gate` (step_gate.hpp): where it
// is set and says skip, the launcher runs nothing. An optimizer functor may write an f16/bf16
// copy of the updated f32 parameter (operand 0) as its last operand; it then names the copy's
// storage (`using LowStorage`, void for none) and its rule without the copy (`using
// WithoutCopy`, `without_copy()`), which the CPU launcher runs before converting the copy a
// chunk at a time (cpu_apply.hpp, LowCopy); the CUDA launcher runs the functor as it is.
#pragma once

#include <cstdint>
#include <utility>

#include "shardkit/ops/element.hpp"

namespace shardkit::ops {

template <class F>
inline constexpr int kSumSlots = F::kSums > 0 ? F::kSums : 1;

template <class F, int K>
using operand_t = type_at<K, typename F::Types>;

template <class F>
constexpr bool reads(int k) {
  return ((F::kReads >> k) & 1u) != 0;
}
template <class F>
constexpr bool writes(int k) {
  return ((F::kWrites >> k) & 1u) != 0;
}

namespace detail {

template <class F, std::size_t... K>
SK_HOST_DEVICE SK_INLINE void load_operands(float (&x)[F::kDepth], void* const* data,
                                            std::int64_t i, std::index_sequence<K...>) {
  (
      [&] {
        if constexpr (reads<F>(K))
          x[K] = load_element(static_cast<const operand_t<F, K>*>(data[K]) + i);
        else
          x[K] = 0.0f;
      }(),
      ...);
}

template <class F, std::size_t... K>
SK_HOST_DEVICE SK_INLINE void store_operands(const float (&x)[F::kDepth], void* const* data,
                                             std::int64_t i, std::index_sequence<K...>) {
  (
      [&] {
        if constexpr (writes<F>(K)) store_element(static_cast<operand_t<F, K>*>(data[K]) + i, x[K]);
      }(),
      ...);
}

}  // namespace detail

// Loads the read operands of element i (others read as 0), and stores the written ones.
template <class F>
SK_HOST_DEVICE SK_INLINE void load_operands(float (&x)[F::kDepth], void* const* data,
                                            std::int64_t i) {
  detail::load_operands<F>(x, data, i, std::make_index_sequence<F::kDepth>{});
}
template <class F>
SK_HOST_DEVICE SK_INLINE void store_operands(const float (&x)[F::kDepth], void* const* data,
                                             std::int64_t i) {
  detail::store_operands<F>(x, data, i, std::make_index_sequence<F::kDepth>{});
}

// Checks a functor against the contract at compile time, with messages that say what to fix.
template <class F>
constexpr bool check_functor() {
  static_assert(F::kDepth >= 1 && F::kDepth <= 8, "a fused-op functor needs 1..8 operands");
  static_assert(F::Types::size == F::kDepth, "Types must list one storage type per operand");
  static_assert(F::kSums >= 0 && F::kSums <= 2, "a functor sums at most 2 values per element");
  static_assert(F::kReads < (1u << F::kDepth) && F::kWrites < (1u << F::kDepth),
                "kReads/kWrites name operands beyond kDepth");
  return true;
}

}  // namespace shardkit::ops
