// What a fused-op backend is: the launcher that applies an element functor (functor.hpp) over
// spans on one kind of device, plus the few per-tensor steps that are not element-wise. The
// fused ops (fused_ops.hpp) are written once over a backend given as a compile-time tag, and
// each backend's instances fill that device's table of fused ops (device_ops.hpp), through which
// everything above calls them by the context's device:
//
//   sk::ops::Cpu    ops/cpu_backend.hpp: the table cpu_fused_ops()
//   sk::ops::Cuda   kernels/ops/cuda_backend.cuh (nvcc): the table every CUDA Context carries
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>

#include "shardkit/core/context.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/quantize.hpp"
#include "shardkit/ops/spans.hpp"

namespace shardkit::ops {

// A backend B provides, as static members:
//   name                                   "cpu", "cuda"
//   check_context(ctx, op)                 throws unless ctx is on B's kind of device
//   apply(ctx, functor, spans)             runs a functor without sums
//   apply_sums(ctx, functor, spans, sums, found_nonfinite)
//                                          a summing functor: sums f64 [kSums, n] on ctx's
//                                          device; found_nonfinite (f32 [1], optional) is set to
//                                          1 when a sum is inf or NaN
//   larc_coefficients(ctx, larc, lr, inv_grad_scale, sums, coefficients, gate)
//                                          per-tensor LARC factors from whole-tensor sums;
//                                          gate (device f32 [4], or null): its gradient factor
//                                          multiplies inv_grad_scale, its rate replaces lr
//   leaf_sums_of_squares(ctx, spans, dtype, leaves)
//                                          every span's leaf sums (norm_tree.hpp; elements of
//                                          `dtype`), one span after the other, into leaves (f64,
//                                          on ctx's device)
//   leaf_sums_of_squares_pair(ctx, spans, dtypes, leaves)
//                                          the same for two lists of equal sizes at once
//                                          (operand k: data[k], dtypes[k], leaves[k])
//   norm_subtree_sums(ctx, leaves, nodes, nodes_on_device, out)
//                                          each node's norm_subtree over leaves (f64, on ctx's
//                                          device) into out[i] (checked by the caller);
//                                          nodes_on_device: the same nodes as i64 pairs on the
//                                          device, or null
//   norm_roots(ctx, values, table, roots, out)
//                                          out[r] = root r's program (NormRootPlan's device
//                                          table) run over values, for r < roots
//   clip_norm_and_factor(ctx, total, max_norm, inv_grad_scale, norm, factor)
//                                          clip_result (clip.hpp) of *total into *norm and
//                                          *factor *= its coefficient (either may be null)
//   larc_sgd(ctx, sgd_functor, spans, larc, lr, inv_grad_scale, param_squares)
//                                          LARC-SGD over whole tensors, in the order that
//                                          reuses the device's cache best; param_squares
//                                          (optional) as larc_param_squares.hpp says
//   quantize_blocks(ctx, format, dtype, values, n, block, payload)
//   dequantize_blocks(ctx, format, dtype, payload, n, block, values, accumulate)
//                                          one run of n values (f32, f16 or bf16) to and from
//                                          quantize.hpp's blocks of int8, int4 or E4M3 codes
//                                          (payload: device bytes, 4-byte aligned,
//                                          quant_payload_bytes(n, block) long); `accumulate`:
//                                          added to the values (f32) instead of stored
//   slot_abs_max(ctx, dtype, values, chunks, count, amax)
//   quantize_by_slots(ctx, format, dtype, values, chunks, count, amax, codes)
//   dequantize_by_slots(ctx, format, dtype, codes, chunks, count, amax, values)
//                                          a run cut into `count` chunks (quantize.hpp's
//                                          slot_chunks: device i64 rows {first, size, slot}):
//                                          amax (f32, per slot) folded with every chunk's |x|
//                                          maximum; one-byte codes with each slot's scale
//                                          amax / kMax, and back
template <class B>
concept OpsBackend = requires(Context& ctx, const LarcOptions& larc, const Tensor& t,
                              const SpanList<1>& spans, const SpanList<2>& pairs, double* leaves,
                              std::span<const NormSubtree> nodes, std::uint8_t* bytes) {
  { B::name } -> std::convertible_to<std::string_view>;
  B::check_context(ctx, "op");
  B::larc_coefficients(ctx, larc, 1.0f, 1.0f, t, t, static_cast<const float*>(nullptr));
  B::leaf_sums_of_squares(ctx, spans, DType::f32, leaves);
  B::leaf_sums_of_squares_pair(ctx, pairs, {DType::f32, DType::bf16}, {leaves, leaves});
  B::norm_subtree_sums(ctx, leaves, nodes, nullptr, leaves);
  B::norm_roots(ctx, leaves, static_cast<const std::int64_t*>(nullptr), 1, leaves);
  B::clip_norm_and_factor(ctx, leaves, 1.0, 1.0f, leaves, static_cast<float*>(nullptr));
  B::quantize_blocks(ctx, QuantFormat::int8, DType::f32, leaves, 1, 256, bytes);
  B::dequantize_blocks(ctx, QuantFormat::f8_e4m3, DType::bf16, bytes, 1, 256, leaves, false);
  B::slot_abs_max(ctx, DType::f32, leaves, static_cast<const std::int64_t*>(nullptr), 1,
                  static_cast<float*>(nullptr));
  B::quantize_by_slots(ctx, QuantFormat::f8_e4m3, DType::f32, leaves,
                       static_cast<const std::int64_t*>(nullptr), 1,
                       static_cast<const float*>(nullptr), bytes);
  B::dequantize_by_slots(ctx, QuantFormat::f8_e4m3, DType::f32, bytes,
                         static_cast<const std::int64_t*>(nullptr), 1,
                         static_cast<const float*>(nullptr), leaves);
};

// The message of the static_assert every entry point makes: what B must be.
#define SK_REQUIRE_OPS_BACKEND(B, op)                                                     \
  static_assert(::shardkit::ops::OpsBackend<B>, op                                        \
                ": the backend must be sk::ops::Cpu (<shardkit/ops/cpu_backend.hpp>) or " \
                "sk::ops::Cuda (<kernels/ops/cuda_backend.cuh>, from a .cu file)")

// What a fused op's entry point starts with: B checked at compile time, then the context
// checked to be one that B runs on, both naming the op.
#define SK_OPS_ENTRY(B, ctx, op) \
  SK_REQUIRE_OPS_BACKEND(B, op); \
  B::check_context(ctx, op)

}  // namespace shardkit::ops
