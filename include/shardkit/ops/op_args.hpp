// The tensor arguments of the fused ops and their checking, shared by the entry points of every
// backend (fused_ops.hpp).
#pragma once

#include <span>

#include "shardkit/ops/adam.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/sgd.hpp"
#include "shardkit/ops/spans.hpp"

namespace shardkit::ops {

// One tensor per parameter in each list; flat-buffer segments are views (Tensor::flat_view).
struct SgdTensors {
  std::span<const Tensor> params;      // f32, updated
  std::span<const Tensor> grads;       // f32 (or the low copies' dtype), read
  std::span<const Tensor> momentum;    // f32; needed when momentum != 0, else ignored
  std::span<const Tensor> low_copies;  // optional f16 or bf16 copies of the updated params
};

struct AdamTensors {
  std::span<const Tensor> params;
  std::span<const Tensor> grads;
  std::span<const Tensor> exp_avg;     // f32, zero before the first step
  std::span<const Tensor> exp_avg_sq;  // f32, zero before the first step
  std::span<const Tensor> low_copies;  // optional f16 or bf16
};

inline DType low_copy_dtype(std::span<const Tensor> low_copies, const char* op) {
  if (low_copies.empty()) return DType::f32;
  const DType low = low_copies[0].dtype();
  check(low == DType::f16 || low == DType::bf16, op, ": low_copies must be f16 or bf16, got ",
        dtype_name(low));
  return low;
}

// The gradients' dtype: f32, or (mixed precision) f16 / bf16 like the low-precision copies.
inline DType grad_dtype(std::span<const Tensor> grads, const char* op) {
  if (grads.empty()) return DType::f32;
  const DType dtype = grads[0].dtype();
  check(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16, op,
        ": gradients must be f32, f16 or bf16, got ", dtype_name(dtype));
  return dtype;
}

// Checks a tensor of per-span results: dtype, shape and device.
inline void check_result_tensor(const Context& ctx, const Tensor& t, DType dtype,
                                const Shape& shape, const char* op, const char* what) {
  check(t.defined(), op, ": ", what, " is undefined; allocate ", dtype_name(dtype), " ",
        shape_text(shape), " on ", ctx.device());
  check(t.dtype() == dtype && t.shape() == shape && t.is_contiguous(), op, ": ", what,
        " must be a contiguous ", dtype_name(dtype), " tensor ", shape_text(shape), ", got ", t);
  check(t.device() == ctx.device(), op, ": ", what, " is on ", t.device(),
        " but the context is on ", ctx.device());
}

// Checks a step gate (step_gate.hpp) when one is given: f32 [4] on the context's device.
inline void check_gate(const Context& ctx, const Tensor& gate, const char* op) {
  if (gate.defined())
    check_result_tensor(ctx, gate, DType::f32, {kGateSlots}, op, "the step gate (options.gate)");
}

inline SpanList<4> sgd_spans(const Context& ctx, const SgdOptions& o, const SgdTensors& t) {
  validate(o);
  check_gate(ctx, o.gate, "sgd_step");
  const bool with_momentum = o.momentum != 0;
  const std::span<const Tensor> none;
  return make_spans<4>(
      ctx, "sgd_step",
      {OperandList{t.params, DType::f32, "params"},
       OperandList{t.grads, grad_dtype(t.grads, "sgd_step"), "grads"},
       OperandList{with_momentum ? t.momentum : none, DType::f32, "momentum"},
       OperandList{t.low_copies, low_copy_dtype(t.low_copies, "sgd_step"), "low_copies"}},
      {true, true, with_momentum, false});
}

inline SpanList<5> adam_spans(const Context& ctx, const AdamOptions& o, const AdamTensors& t) {
  validate(o);
  check_gate(ctx, o.gate, "adam_step");
  return make_spans<5>(
      ctx, "adam_step",
      {OperandList{t.params, DType::f32, "params"},
       OperandList{t.grads, grad_dtype(t.grads, "adam_step"), "grads"},
       OperandList{t.exp_avg, DType::f32, "exp_avg"},
       OperandList{t.exp_avg_sq, DType::f32, "exp_avg_sq"},
       OperandList{t.low_copies, low_copy_dtype(t.low_copies, "adam_step"), "low_copies"}},
      {true, true, true, true, false});
}

// Per-span LARC coefficients: f32 [n, 2] = (grad, param) factors, laid out as SgdCoefficients.
inline const SgdCoefficients* coefficients_data(const Context& ctx, const Tensor& coefficients,
                                                std::size_t spans, const char* op) {
  check_result_tensor(ctx, coefficients, DType::f32, {static_cast<std::int64_t>(spans), 2}, op,
                      "coefficients");
  static_assert(sizeof(SgdCoefficients) == 2 * sizeof(float));
  return static_cast<const SgdCoefficients*>(coefficients.data_ptr());
}

// Casts take a source and a destination list; the dtype pair picks the functor.
inline SpanList<2> cast_spans(const Context& ctx, std::span<const Tensor> src,
                              std::span<const Tensor> dst, DType& from, DType& to) {
  check(!src.empty() || dst.empty(), "cast: no sources for ", dst.size(), " destinations");
  from = src.empty() ? DType::f32 : src[0].dtype();
  to = dst.empty() ? DType::f16 : dst[0].dtype();
  const bool supported = (from == DType::f32 && (to == DType::f16 || to == DType::bf16)) ||
                         (to == DType::f32 && (from == DType::f16 || from == DType::bf16));
  check(supported, "cast: ", dtype_name(from), " -> ", dtype_name(to),
        " is not a fused cast; use f32 <-> f16 or f32 <-> bf16 (sk::copy converts any pair)");
  return make_spans<2>(ctx, "cast",
                       {OperandList{src, from, "sources"}, OperandList{dst, to, "destinations"}},
                       {true, true});
}

}  // namespace shardkit::ops
