// f16/bf16 on the CPU: "store low precision, compute in f32, round on store". The CPU kernels
// compute in f32 or f64; in_f32() runs one of them for tensors of which some are f16/bf16 --
// those are widened to f32 copies (exact), the kernel runs on the copies, and then every copy
// is rounded back into its tensor (inputs come back unchanged: a widened value rounds to
// itself). So mixed precision runs, and is tested, on machines without a GPU; the GPU kernels
// keep 16-bit storage and f32 arithmetic natively.
#pragma once

#include <type_traits>
#include <utility>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::cpu {

inline bool is_half(DType dtype) { return dtype == DType::f16 || dtype == DType::bf16; }

// Calls fn(t...) with each f16/bf16 tensor replaced by an f32 copy, then rounds the copies
// back. Undefined tensors and other dtypes pass through as they are.
template <class Fn, class... Ts>
void in_f32(Context& ctx, Fn&& fn, const Ts&... tensors) {
  static_assert((std::is_same_v<Ts, Tensor> && ...), "in_f32 takes tensors");
  if (!((tensors.defined() && is_half(tensors.dtype())) || ...)) return fn(tensors...);
  std::vector<std::pair<Tensor, Tensor>> widened;  // (original, f32 copy)
  auto widen = [&](const Tensor& t) -> Tensor {
    if (!t.defined() || !is_half(t.dtype())) return t;
    for (const auto& [original, copy] : widened)  // the same tensor twice: one copy
      if (original.storage() == t.storage() && original.offset() == t.offset() &&
          original.shape() == t.shape())
        return copy;
    Tensor copy = cast(ctx, t, DType::f32);
    widened.emplace_back(t, copy);
    return copy;
  };
  fn(widen(tensors)...);
  for (const auto& [original, copy] : widened) shardkit::copy(ctx, original, copy);
}

}  // namespace shardkit::autograd::cpu
