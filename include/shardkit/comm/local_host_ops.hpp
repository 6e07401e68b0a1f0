// Runs a TransferPlan on host memory: memcpy for copies, and for reductions a blocked loop that
// applies reduction.hpp's combine/finish in rank order (vectorisable, and bit-equal to the
// device kernel, which applies the same steps per element).
#pragma once

#include <algorithm>
#include <cstring>

#include "shardkit/comm/transfer_plan.hpp"

namespace shardkit::comm {

namespace detail {

template <class T>
void reduce_on_host(const ReduceStep& step, ReduceOp op) {
  using A = accumulator_t<T>;
  constexpr std::size_t kBlock = 1024;  // the accumulators stay in L1
  A acc[kBlock];
  const int n = static_cast<int>(step.sources.size());
  if (n == 1) {  // x, avg of x and max of x are x: copy, keeping every bit (NaN payloads too)
    for (void* dst : step.destinations)
      if (dst != step.sources[0]) std::memmove(dst, step.sources[0], step.count * sizeof(T));
    return;
  }
  for (std::size_t begin = 0; begin < step.count; begin += kBlock) {
    const std::size_t len = std::min(kBlock, step.count - begin);
    const T* first = static_cast<const T*>(step.sources[0]) + begin;
    for (std::size_t j = 0; j < len; ++j) acc[j] = widen(first[j]);
    for (int r = 1; r < n; ++r) {
      const T* src = static_cast<const T*>(step.sources[static_cast<std::size_t>(r)]) + begin;
      if (op == ReduceOp::max)
        for (std::size_t j = 0; j < len; ++j)
          acc[j] = combine(acc[j], widen(src[j]), ReduceOp::max);
      else
        for (std::size_t j = 0; j < len; ++j) acc[j] = acc[j] + widen(src[j]);
    }
    // Every source of this block is read before any destination of it is written.
    for (void* dst_bytes : step.destinations) {
      T* dst = static_cast<T*>(dst_bytes) + begin;
      for (std::size_t j = 0; j < len; ++j) dst[j] = narrow<T>(finish(acc[j], n, op));
    }
  }
}

}  // namespace detail

inline void run_plan_on_host(const TransferPlan& plan) {
  for (const CopyStep& c : plan.copies) std::memmove(c.dst, c.src, c.bytes);
  for (const ReduceStep& step : plan.reductions) {
    visit_dtype(plan.dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_comm_dtype(dtype_of<T>)) detail::reduce_on_host<T>(step, plan.op);
    });
  }
}

}  // namespace shardkit::comm
