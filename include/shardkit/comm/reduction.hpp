// Reduction operators of the collectives and the element rule every backend that reduces by
// itself applies (the local backend's CPU loop and its CUDA kernel share it, so both give the
// same bits): accumulate in rank order 0..n-1, f16/bf16 in f32, then round once.
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include "shardkit/core/config.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/enum_names.hpp"

namespace shardkit::comm {

enum class ReduceOp : std::uint8_t { sum, avg, max };

inline constexpr EnumName<ReduceOp> kReduceOpNames[] = {
    {ReduceOp::sum, "sum"}, {ReduceOp::avg, "avg"}, {ReduceOp::max, "max"}};

constexpr std::string_view reduce_op_name(ReduceOp op) { return name_of(op, kReduceOpNames); }

// The element types collectives move and reduce.
constexpr bool is_comm_dtype(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}

// What the collectives that only move data (broadcast, all_gather, all_gather_v) also take:
// bytes, such as quantised payloads (ops/quantize.hpp).
constexpr bool is_movable_dtype(DType dtype) { return is_comm_dtype(dtype) || dtype == DType::u8; }

// f16 and bf16 accumulate in f32: summing 8 ranks of f16 in f16 would round 7 times.
template <class T>
using accumulator_t =
    std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

template <class T>
SK_HOST_DEVICE SK_INLINE accumulator_t<T> widen(T value) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return value.to_float();
  else
    return value;
}

template <class T>
SK_HOST_DEVICE SK_INLINE T narrow(accumulator_t<T> value) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return T(value);
  else
    return value;
}

// acc <- acc (op) value. max keeps a NaN once seen, so a NaN on any rank shows in the result
// (what an overflow check after the reduction needs).
template <class A>
SK_HOST_DEVICE SK_INLINE A combine(A acc, A value, ReduceOp op) {
  if (op == ReduceOp::max) return (value > acc || value != value) ? value : acc;
  return acc + value;
}

// The final step over n contributions: avg divides once, after the sum.
template <class A>
SK_HOST_DEVICE SK_INLINE A finish(A acc, int n, ReduceOp op) {
  return op == ReduceOp::avg ? acc / static_cast<A>(n) : acc;
}

// Element i reduced over `n` sources in rank order.
template <class T>
SK_HOST_DEVICE SK_INLINE T reduce_element(const T* const* sources, int n, std::size_t i,
                                          ReduceOp op) {
  accumulator_t<T> acc = widen(sources[0][i]);
  for (int r = 1; r < n; ++r) acc = combine(acc, widen(sources[r][i]), op);
  return narrow<T>(finish(acc, n, op));
}

}  // namespace shardkit::comm
