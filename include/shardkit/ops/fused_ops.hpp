// The fused ops, one entry point each, over a backend tag (backend.hpp): the arguments are
// checked and turned into spans here, once; the backend only launches.
//
//   sgd_step<B>                 SGD over many tensors (weight decay, momentum, unscale, and an
//                               optional f16/bf16 copy of the result, in one call)
//   sgd_step<B>(..., coefficients)   the same with per-tensor (grad, param) factors (LARC)
//   segment_sums_of_squares<B>  per-span sums of squares (pieces of L2 norms)
//   leaf_sums_of_squares<B>     per-leaf sums of squares: the split-invariant norms of
//                               norm_tree.hpp start from them (one list, or two in one pass)
//   norm_subtree_sums<B>        tree nodes' values from those leaf sums, where they lie
//   norm_roots<B>               whole trees finished from the nodes' values, where they lie
//   clip_norm_and_factor<B>     gradient clipping's norm and factor from the total
//   larc_coefficients<B>        per-tensor LARC factors from whole-tensor sums
//   larc_sgd_step<B>            LARC-SGD where every tensor is whole here
//   larc_sgd_step_tree<B>       the same with the norm tree's norms (the sharded optimizer's
//                               bits; backends that pipeline it: the CPU)
//   adam_step<B>                Adam / AdamW
//   cast<B>                     f32 <-> f16 / bf16
//   unscale_and_check<B>        g *= 1/scale, with the finite check and the norms in the pass
//   check_finite<B>             whether every element is finite (one read pass)
//   loss_scale_phase<B>         the loss scale state's begin or update (step_gate.hpp)
//   count_applied_step<B>       the step gate's count past a step it did not skip
//   follow_loss_scale<B>        values kept in the scaled units follow the scale's update
//   normalize_rows_by_leaves<B> a 2-D parameter's rows divided by their norms from leaf sums
#pragma once

#include <span>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/backend.hpp"
#include "shardkit/ops/cast.hpp"
#include "shardkit/ops/clip.hpp"
#include "shardkit/ops/larc_param_squares.hpp"
#include "shardkit/ops/norm_root_plan.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/op_args.hpp"
#include "shardkit/ops/quantize.hpp"
#include "shardkit/ops/row_normalize.hpp"

namespace shardkit::ops {

// SGD over all parameters with the options' weight decay and unscale.
template <class B>
void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors) {
  SK_OPS_ENTRY(B, ctx, "sgd_step");
  const auto spans = sgd_spans(ctx, options, tensors);
  visit_sgd_functor(options, grad_dtype(tensors.grads, "sgd_step"),
                    low_copy_dtype(tensors.low_copies, "sgd_step"), nullptr,
                    [&](const auto& op) { B::apply(ctx, op, spans); });
}

// SGD with per-parameter gradient coefficients (f32 [n, 2] on the context's device, e.g. from
// larc_coefficients): the rule uses g' = c[i][0]·g + c[i][1]·w, so options.weight_decay and
// inv_grad_scale must already be folded into them (both at their neutral values here).
template <class B>
void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors,
              const Tensor& coefficients) {
  SK_OPS_ENTRY(B, ctx, "sgd_step");
  check(options.weight_decay == 0 && options.inv_grad_scale == 1,
        "sgd_step with coefficients: fold weight_decay and inv_grad_scale into the coefficients "
        "(larc_coefficients does) and leave them at 0 and 1 in the options");
  const auto spans = sgd_spans(ctx, options, tensors);
  const auto* per_segment = coefficients_data(ctx, coefficients, spans.size(), "sgd_step");
  visit_sgd_functor(options, grad_dtype(tensors.grads, "sgd_step"),
                    low_copy_dtype(tensors.low_copies, "sgd_step"), per_segment,
                    [&](const auto& op) { B::apply(ctx, op, spans); });
}

// What every pass that reads one list of gradients starts with: the backend and the context
// checked, the list's dtype (f32, f16 or bf16, the same throughout) and its spans.
struct GradListSpans {
  DType dtype;
  SpanList<1> spans;
};
template <class B>
GradListSpans grad_list_spans(Context& ctx, std::span<const Tensor> tensors, const char* op,
                              const char* what) {
  SK_REQUIRE_OPS_BACKEND(B, "a pass over one list of gradients");
  B::check_context(ctx, op);
  const DType dtype = grad_dtype(tensors, op);
  return {dtype, make_spans<1>(ctx, op, {OperandList{tensors, dtype, what}}, {true})};
}

// Sums of squares per span: sums is f64 [1, n] for one list, [2, n] with a second list (e.g.
// params and grads in one pass). Partial sums, to be added over the segments of one tensor
// (and over ranks) before the square root.
template <class B>
void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                             std::span<const Tensor> second, const Tensor& sums) {
  SK_OPS_ENTRY(B, ctx, "segment_sums_of_squares");
  const auto n = static_cast<std::int64_t>(first.size());
  if (second.empty()) {
    const auto spans = make_spans<1>(ctx, "segment_sums_of_squares",
                                     {OperandList{first, DType::f32, "tensors"}}, {true});
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "segment_sums_of_squares", "sums");
    if (n > 0) B::apply_sums(ctx, SumOfSquaresFunctor<1>{}, spans, sums, Tensor());
  } else {
    const auto spans = make_spans<2>(
        ctx, "segment_sums_of_squares",
        {OperandList{first, DType::f32, "first"}, OperandList{second, DType::f32, "second"}},
        {true, true});
    check_result_tensor(ctx, sums, DType::f64, {2, n}, "segment_sums_of_squares", "sums");
    if (n > 0) B::apply_sums(ctx, SumOfSquaresFunctor<2>{}, spans, sums, Tensor());
  }
}

// The leaf sums of squares of norm_tree.hpp: tensor t contributes norm_leaves(t.numel()) sums
// (leaf_sum_of_squares of its elements [16k, 16k + 16)), the tensors one after the other, into
// `leaves` (f64 [total leaves]). Each tensor is read as flat as it lies (contiguous); f32, or
// f16 / bf16 (mixed-precision gradients; their values are exact in f32).
template <class B>
void leaf_sums_of_squares(Context& ctx, std::span<const Tensor> tensors, const Tensor& leaves) {
  const GradListSpans list = grad_list_spans<B>(ctx, tensors, "leaf_sums_of_squares", "tensors");
  const DType dtype = list.dtype;
  const auto& spans = list.spans;
  std::int64_t total = 0;
  for (const auto& span : spans) total += norm_leaves(span.size);
  check_result_tensor(ctx, leaves, DType::f64, {total}, "leaf_sums_of_squares", "leaves");
  if (total > 0) B::leaf_sums_of_squares(ctx, spans, dtype, leaves.data<double>());
}

// The leaf sums of two lists of equal sizes (params and their grads; each list f32, f16 or
// bf16) in one pass, into `leaves` (f64 [2, total leaves]): row k is list k's, as above.
template <class B>
void leaf_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                          std::span<const Tensor> second, const Tensor& leaves) {
  SK_OPS_ENTRY(B, ctx, "leaf_sums_of_squares");
  const DType dtype_first = grad_dtype(first, "leaf_sums_of_squares (first)");
  const DType dtype_second = grad_dtype(second, "leaf_sums_of_squares (second)");
  const auto spans = make_spans<2>(
      ctx, "leaf_sums_of_squares",
      {OperandList{first, dtype_first, "first"}, OperandList{second, dtype_second, "second"}},
      {true, true});
  std::int64_t total = 0;
  for (const auto& span : spans) total += norm_leaves(span.size);
  check_result_tensor(ctx, leaves, DType::f64, {2, total}, "leaf_sums_of_squares", "leaves");
  if (total > 0)
    B::leaf_sums_of_squares_pair(ctx, spans, {dtype_first, dtype_second},
                                 {leaves.data<double>(), leaves.data<double>() + total});
}

// The values of tree nodes (norm_tree.hpp) over leaf sums: out[i] = norm_subtree of the
// 2^nodes[i].level values of `leaves` (f64, contiguous, any shape: read flat) from
// nodes[i].first on, each formed along the tree, so the bits are norm_subtree's on any backend.
// `out` is f64 [nodes.size()] on the context's device. What ParamNorms sends between ranks
// instead of every leaf. `nodes_on_device` (optional): the same nodes as i64 [n, 2] (first,
// level) already on the context's device, kept by the caller from step to step; without it a
// GPU uploads them for the call.
template <class B>
void norm_subtree_sums(Context& ctx, const Tensor& leaves, std::span<const NormSubtree> nodes,
                       const Tensor& out, const Tensor& nodes_on_device = Tensor()) {
  SK_OPS_ENTRY(B, ctx, "norm_subtree_sums");
  const auto count = static_cast<std::int64_t>(nodes.size());
  check_result_tensor(ctx, out, DType::f64, {count}, "norm_subtree_sums", "out");
  if (count == 0) return;
  check(leaves.defined() && leaves.dtype() == DType::f64 && leaves.is_contiguous() &&
            leaves.device() == ctx.device(),
        "norm_subtree_sums: leaves must be a contiguous f64 tensor on ", ctx.device(), ", got ",
        tensor_text(leaves));
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& node = nodes[i];
    check(node.level >= 0 && node.level <= 62 && node.first >= 0 && node.first <= leaves.numel() &&
              (std::int64_t{1} << node.level) <= leaves.numel() - node.first,
          "norm_subtree_sums: node ", i, " (first ", node.first, ", level ", node.level,
          ") reaches past the ", leaves.numel(),
          " leaf sums given; every node's 2^level values must lie inside `leaves`");
  }
  const std::int64_t* table = nullptr;
  if (nodes_on_device.defined()) {
    check_result_tensor(ctx, nodes_on_device, DType::i64, {count, 2}, "norm_subtree_sums",
                        "nodes_on_device");
    table = nodes_on_device.data<std::int64_t>();
  }
  B::norm_subtree_sums(ctx, leaves.data<double>(), nodes, table, out.data<double>());
}

// Finishes norm trees where their cover values lie: out[r] = root r of `plan` (uploaded to the
// context's device) over `values` (f64, contiguous, read flat; undefined when the plan reads
// none), with norm_root's bits. `out`: f64, contiguous, plan.roots() elements in any shape.
template <class B>
void norm_roots(Context& ctx, const Tensor& values, const NormRootPlan& plan, const Tensor& out) {
  SK_OPS_ENTRY(B, ctx, "norm_roots");
  check(plan.uploaded() && plan.table().device() == ctx.device(),
        "norm_roots: the plan must be uploaded to ", ctx.device(), " first (NormRootPlan::upload)");
  check(out.defined() && out.dtype() == DType::f64 && out.is_contiguous() &&
            out.device() == ctx.device() && out.numel() == plan.roots(),
        "norm_roots: out must be a contiguous f64 tensor of ", plan.roots(), " elements on ",
        ctx.device(), ", got ", tensor_text(out));
  if (plan.values_read() > 0)
    check(values.defined() && values.dtype() == DType::f64 && values.is_contiguous() &&
              values.device() == ctx.device() && values.numel() >= plan.values_read(),
          "norm_roots: values must be a contiguous f64 tensor of at least ", plan.values_read(),
          " elements on ", ctx.device(), ", got ", tensor_text(values));
  if (plan.roots() == 0) return;
  B::norm_roots(ctx, plan.values_read() > 0 ? values.data<double>() : nullptr,
                plan.table().data<std::int64_t>(), plan.roots(), out.data<double>());
}

// Gradient clipping from the gradients' total sum of squares (`total`, f64 [1], loss-scaled
// units; inv_grad_scale unscales): `norm` (f64 [1], optional) receives the global norm and
// `factor` (f32 [1], optional: a step gate's gradient factor) is multiplied by the clip
// coefficient (clip.hpp), all on the context's device.
template <class B>
void clip_norm_and_factor(Context& ctx, const Tensor& total, double max_norm, float inv_grad_scale,
                          const Tensor& norm, const Tensor& factor) {
  SK_OPS_ENTRY(B, ctx, "clip_norm_and_factor");
  check(max_norm > 0, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  check_result_tensor(ctx, total, DType::f64, {1}, "clip_norm_and_factor", "total");
  if (norm.defined())
    check_result_tensor(ctx, norm, DType::f64, {1}, "clip_norm_and_factor", "norm");
  if (factor.defined())
    check_result_tensor(ctx, factor, DType::f32, {1}, "clip_norm_and_factor", "factor");
  B::clip_norm_and_factor(ctx, total.data<double>(), max_norm, inv_grad_scale,
                          norm.defined() ? norm.data<double>() : nullptr,
                          factor.defined() ? factor.data<float>() : nullptr);
}

// Whether every element of `tensors` (f32, f16 or bf16) is finite: found_nonfinite (f32 [1],
// on the context's device) is set to 1 when one is not, and left alone otherwise (zero it
// first). One read pass (sums of squares, which are non-finite exactly when an element is):
// the loss scaler's check of loss-scaled gradients, which the optimizer then unscales in its
// own pass.
template <class B>
void check_finite(Context& ctx, std::span<const Tensor> tensors, const Tensor& found_nonfinite) {
  const GradListSpans list = grad_list_spans<B>(ctx, tensors, "check_finite", "tensors");
  const DType dtype = list.dtype;
  const auto& spans = list.spans;
  check_result_tensor(ctx, found_nonfinite, DType::f32, {1}, "check_finite", "found_nonfinite");
  const auto n = static_cast<std::int64_t>(spans.size());
  if (n == 0) return;
  const Tensor sums = empty(ctx, {1, n}, DType::f64, MemoryCategory::other);
  auto run = [&]<class T>() {
    B::apply_sums(ctx, SumOfSquaresFunctor<1, T>{}, spans, sums, found_nonfinite);
  };
  visit_element_dtype(dtype, run);
}

// LARC coefficients per parameter from whole-tensor sums (f64 [2, n]: params' then grads'
// sums of squares, already added over segments and ranks) into f32 [n, 2]. With f64 [3, n],
// row 2 is each parameter's weight decay in place of larc.weight_decay (no-decay groups).
// With `gate` (the step gate, step_gate.hpp, on the context's device) the gradients' factor is
// inv_grad_scale times the gate's, read on the device: a loss-scaled LARC step then needs no
// verdict on the host. The coefficients hold that factor, so the SGD pass that reads them must
// not apply it again (the optimizer sets the gate's factor to 1 for that pass).
template <class B>
void larc_coefficients(Context& ctx, const LarcOptions& larc, float lr, float inv_grad_scale,
                       const Tensor& sums, const Tensor& coefficients,
                       const Tensor& gate = Tensor()) {
  SK_OPS_ENTRY(B, ctx, "larc_coefficients");
  if (gate.defined())
    check_result_tensor(ctx, gate, DType::f32, {kGateSlots}, "larc_coefficients", "gate");
  validate(larc);
  check(sums.dim() == 2 && (sums.size(0) == 2 || sums.size(0) == 3),
        "larc_coefficients: sums must be f64 [2, n] (or [3, n] with per-parameter decays), got ",
        sums);
  const auto n = sums.size(1);
  check_result_tensor(ctx, sums, DType::f64, {sums.size(0), n}, "larc_coefficients", "sums");
  check_result_tensor(ctx, coefficients, DType::f32, {n, 2}, "larc_coefficients", "coefficients");
  if (n > 0)
    B::larc_coefficients(ctx, larc, lr, inv_grad_scale, sums, coefficients,
                         gate.defined() ? gate.data<float>() : nullptr);
}

inline constexpr const char* kLarcTakesNoGate =
    "this LARC-SGD entry takes no step gate: its trust ratios need the gradients' scale before "
    "the pass; pass 1 / the loss scale in options.inv_grad_scale and skip an overflowing step on "
    "the host, or compose larc_coefficients (which reads the gate) with sgd_step";

// LARC-SGD where every tensor lies whole in this process (no shards). options.weight_decay must
// be 0: LARC takes larc.weight_decay over. With `param_squares` (kept by the caller from one step
// to the next), the step records each param's sum of squares as its update writes it, and the
// next step's norms pass reads only the grads (larc_param_squares.hpp: forget() it whenever
// anything else writes the params). The results are the same bits with it or without.
template <class B>
void larc_sgd_step(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                   const SgdTensors& tensors, LarcParamSquares* param_squares = nullptr) {
  SK_OPS_ENTRY(B, ctx, "larc_sgd_step");
  validate(larc);
  check(!options.gate.defined(), kLarcTakesNoGate);
  check(options.weight_decay == 0, "larc_sgd_step: LARC takes weight decay over; pass it as ",
        "LarcOptions::weight_decay and leave SgdOptions::weight_decay at 0 (got ",
        options.weight_decay, ")");
  check(grad_dtype(tensors.grads, "larc_sgd_step") == DType::f32,
        "larc_sgd_step takes f32 gradients; under mixed precision the sharded optimizer forms "
        "LARC's norms (ParamNorms) and calls sgd_step with coefficients");
  const auto spans = sgd_spans(ctx, options, tensors);
  if (spans.empty()) {
    if (param_squares != nullptr) param_squares->forget();
    return;
  }
  SgdOptions plain = options;
  plain.inv_grad_scale = 1.0f;  // folded into the coefficients
  visit_sgd_functor(plain, DType::f32, low_copy_dtype(tensors.low_copies, "larc_sgd_step"), nullptr,
                    [&](auto op) {
                      B::larc_sgd(ctx, op, spans, larc, options.lr, options.inv_grad_scale,
                                  param_squares);
                    });
}

// Whether backend B pipelines LARC-SGD with the norm tree's norms (B::larc_sgd_tree): the CPU
// does, since one core reading a norms pass and then an update keeps too few reads in flight
// (cpu_larc.hpp). On the GPU the norms pass and sgd_step with coefficients stay two kernels.
template <class B>
inline constexpr bool has_larc_sgd_tree = requires(Context& ctx,
                                                   const SgdFunctor<MomentumMode::none>& op,
                                                   const SpanList<4>& spans) {
  B::larc_sgd_tree(ctx, op, spans, LarcOptions{}, 0.0f, 1.0f, nullptr);
};

// LARC-SGD where every tensor is whole here, each tensor's norms formed as norm_tree.hpp says:
// the same bits as ParamNorms' sums, larc_coefficients and sgd_step with coefficients (what the
// sharded optimizer runs for shards), in one pipelined pass. Gradients f32, or f16 / bf16 under
// mixed precision. `decays`: each tensor's weight decay (empty: larc.weight_decay for all);
// options.weight_decay must be 0.
template <class B>
requires has_larc_sgd_tree<B>
void larc_sgd_step_tree(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                        const SgdTensors& tensors, std::span<const double> decays = {}) {
  B::check_context(ctx, "larc_sgd_step_tree");
  validate(larc);
  check(!options.gate.defined(), kLarcTakesNoGate);
  check(options.weight_decay == 0, "larc_sgd_step_tree: LARC takes weight decay over; pass it ",
        "as LarcOptions::weight_decay or per tensor in decays, and leave SgdOptions::weight_decay ",
        "at 0 (got ", options.weight_decay, ")");
  const auto spans = sgd_spans(ctx, options, tensors);
  check(decays.empty() || decays.size() == spans.size(), "larc_sgd_step_tree: ", decays.size(),
        " decays for ", spans.size(), " tensors; pass one per tensor, or none");
  if (spans.empty()) return;
  SgdOptions plain = options;
  plain.inv_grad_scale = 1.0f;  // folded into the coefficients
  visit_sgd_functor(plain, grad_dtype(tensors.grads, "larc_sgd_step_tree"),
                    low_copy_dtype(tensors.low_copies, "larc_sgd_step_tree"), nullptr,
                    [&](auto op) {
                      B::larc_sgd_tree(ctx, op, spans, larc, options.lr, options.inv_grad_scale,
                                       decays.empty() ? nullptr : decays.data());
                    });
}

template <class B>
void adam_step(Context& ctx, const AdamOptions& options, const AdamTensors& tensors) {
  SK_OPS_ENTRY(B, ctx, "adam_step");
  const auto spans = adam_spans(ctx, options, tensors);
  visit_adam_functor(options, grad_dtype(tensors.grads, "adam_step"),
                     low_copy_dtype(tensors.low_copies, "adam_step"),
                     [&](const auto& op) { B::apply(ctx, op, spans); });
}

// dst[i] = src[i] converted: f32 -> f16/bf16 (round to nearest even) or f16/bf16 -> f32.
template <class B>
void cast(Context& ctx, std::span<const Tensor> src, std::span<const Tensor> dst) {
  SK_OPS_ENTRY(B, ctx, "cast");
  DType from, to;
  const auto spans = cast_spans(ctx, src, dst, from, to);
  if (from == DType::f32 && to == DType::f16)
    return B::apply(ctx, CastFunctor<float, Half>{}, spans);
  if (from == DType::f32) return B::apply(ctx, CastFunctor<float, BFloat16>{}, spans);
  if (from == DType::f16) return B::apply(ctx, CastFunctor<Half, float>{}, spans);
  B::apply(ctx, CastFunctor<BFloat16, float>{}, spans);
}

// The loss scaler's pass: grads *= inv_scale; found_nonfinite (f32 [1]) is set to 1 when any
// unscaled gradient is inf or NaN and left alone otherwise (zero it first; several calls
// accumulate, as PyTorch's found_inf does). If `sums` is defined (f64 [1, n]) it receives each
// span's sum of squares of the unscaled gradients: the gradient norms, for free.
template <class B>
void unscale_and_check(Context& ctx, float inv_scale, std::span<const Tensor> grads,
                       const Tensor& found_nonfinite, const Tensor& sums = Tensor()) {
  const GradListSpans list = grad_list_spans<B>(ctx, grads, "unscale_and_check", "grads");
  const DType dtype = list.dtype;
  const auto& spans = list.spans;
  const auto n = static_cast<std::int64_t>(spans.size());
  check_result_tensor(ctx, found_nonfinite, DType::f32, {1}, "unscale_and_check",
                      "found_nonfinite");
  Tensor out = sums;
  if (sums.defined())
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "unscale_and_check", "sums");
  else
    out = empty(ctx, {1, n}, DType::f64);
  if (n == 0) return;
  auto run = [&]<class Grad>() {
    UnscaleFunctor<Grad> op;
    op.inv_scale = inv_scale;
    B::apply_sums(ctx, op, spans, out, found_nonfinite);
  };
  visit_element_dtype(dtype, run);
}

namespace detail {

// One-element views of the slots of a small state tensor (f32 [slots] on ctx's device).
inline std::vector<Tensor> slot_views(const Context& ctx, const Tensor& state, std::int64_t slots,
                                      const char* op, const char* what) {
  check_result_tensor(ctx, state, DType::f32, {slots}, op, what);
  std::vector<Tensor> views;
  for (std::int64_t k = 0; k < slots; ++k) views.push_back(state.slice(0, k, k + 1));
  return views;
}

}  // namespace detail

// The loss scale state's phase (step_gate.hpp, LossScaleFunctor): `state` f32 [4] on ctx's
// device, rewritten there.
template <class B>
void loss_scale_phase(Context& ctx, LossScaleFunctor::Phase phase, const LossScaleRule& rule,
                      const Tensor& state) {
  SK_OPS_ENTRY(B, ctx, "loss_scale_phase");
  const auto slots =
      detail::slot_views(ctx, state, kLossScaleSlots, "loss_scale_phase", "the loss scale state");
  const std::span<const Tensor> s(slots);
  const auto spans =
      make_spans<4>(ctx, "loss_scale_phase",
                    {OperandList{s.subspan(kLossScale, 1), DType::f32, "scale"},
                     OperandList{s.subspan(kLossInvScale, 1), DType::f32, "inv_scale"},
                     OperandList{s.subspan(kLossFoundInf, 1), DType::f32, "found_inf"},
                     OperandList{s.subspan(kLossGrowthTracker, 1), DType::f32, "growth_tracker"}},
                    {true, true, true, true});
  B::apply(ctx, LossScaleFunctor{phase, rule}, spans);
}

// The step gate (f32 [4] on ctx's device) counts the step it gated, unless it skipped it.
template <class B>
void count_applied_step(Context& ctx, const Tensor& gate) {
  SK_OPS_ENTRY(B, ctx, "count_applied_step");
  const auto slots =
      detail::slot_views(ctx, gate, kGateSlots, "count_applied_step", "the step gate");
  const std::span<const Tensor> s(slots);
  const auto spans =
      make_spans<2>(ctx, "count_applied_step",
                    {OperandList{s.subspan(kGateStepsBefore, 1), DType::f32, "steps_before"},
                     OperandList{s.subspan(kGateSkip, 1), DType::f32, "skip"}},
                    {true, true});
  B::apply(ctx, CountAppliedStepFunctor{}, spans);
}

// `values` (f32, kept in the loss-scaled units) times the scale's change over the update just
// made, or zeroed after an overflow (FollowLossScaleFunctor); `state` is the loss scale state.
template <class B>
void follow_loss_scale(Context& ctx, std::span<const Tensor> values, const Tensor& state) {
  SK_OPS_ENTRY(B, ctx, "follow_loss_scale");
  check_result_tensor(ctx, state, DType::f32, {kLossScaleSlots}, "follow_loss_scale",
                      "the loss scale state");
  const auto spans =
      make_spans<1>(ctx, "follow_loss_scale", {OperandList{values, DType::f32, "values"}}, {true});
  if (!spans.empty()) B::apply(ctx, FollowLossScaleFunctor{state.data<float>()}, spans);
}

// normalize_rows (parallel/param_rows.hpp) on one piece of a 2-D parameter with `cols` columns:
// `values` (contiguous f32) holds the parameter's elements [first, first + numel), `leaves` (f64
// on ctx's device) the whole parameter's leaf sums (norm_tree.hpp; cols a multiple of
// kNormLeaf). Each element is divided by its row's norm, max(sqrt(the row's leaves summed in
// order), eps), in f64; with `gate` defined (the optimizer's step gate) nothing is written after
// a skipped step.
template <class B>
void normalize_rows_by_leaves(Context& ctx, const Tensor& values, std::int64_t first,
                              std::int64_t cols, const Tensor& leaves, double eps,
                              const Tensor& gate = Tensor()) {
  SK_OPS_ENTRY(B, ctx, "normalize_rows_by_leaves");
  check(values.dtype() == DType::f32 && values.is_contiguous() && values.device() == ctx.device(),
        "normalize_rows_by_leaves: values must be contiguous f32 on ", ctx.device(), ", got ",
        values);
  check(cols > 0 && cols % kNormLeaf == 0 && first >= 0, "normalize_rows_by_leaves: rows of ", cols,
        " columns from element ", first, "; the row norms come from whole leaves of ", kNormLeaf,
        " elements");
  const std::int64_t end = first + values.numel();
  check(leaves.defined() && leaves.dtype() == DType::f64 && leaves.is_contiguous() &&
            leaves.device() == ctx.device() &&
            leaves.numel() * kNormLeaf >= (end + cols - 1) / cols * cols,
        "normalize_rows_by_leaves: leaves ", tensor_text(leaves, "(undefined)"),
        " do not cover the rows of elements [", first, ", ", end, ")");
  if (gate.defined())
    check_result_tensor(ctx, gate, DType::f32, {kGateSlots}, "normalize_rows_by_leaves", "gate");
  // One span per row piece: span s lies in row first / cols + s.
  SpanList<1> spans;
  auto* data = static_cast<float*>(values.data_ptr());
  for (std::int64_t at = first; at < end;) {
    const std::int64_t stop = std::min(end, (at / cols + 1) * cols);
    Span<1> span;
    span.data[0] = data + (at - first);
    span.size = stop - at;
    spans.push_back(span);
    at = stop;
  }
  if (spans.empty()) return;
  B::apply(ctx,
           RowNormalizeFunctor{leaves.data<double>(), first / cols, cols / kNormLeaf, eps,
                               gate.defined() ? gate.data<float>() : nullptr},
           spans);
}

namespace detail {

// What a quantised format's values must be: a contiguous f32, f16 or bf16 tensor (read flat)
// on ctx's device.
inline void check_quant_values(const Context& ctx, const Tensor& values, const char* op) {
  check(values.defined() && values.is_contiguous() &&
            (values.dtype() == DType::f32 || values.dtype() == DType::f16 ||
             values.dtype() == DType::bf16) &&
            values.device() == ctx.device(),
        op, ": values must be a contiguous f32, f16 or bf16 tensor on ", ctx.device(), ", got ",
        tensor_text(values));
}

// The checks both directions of the block formats make: backend B and ctx's device, a block
// that the format takes, `values` a contiguous f32, f16 or bf16 tensor (read flat) and `payload`
// contiguous u8 of at least quant_payload_bytes, aligned for its f32 scales, both on ctx's
// device. Returns whether there is anything to do (values not empty).
template <class B>
bool check_quant_blocks(const Context& ctx, QuantFormat format, const Tensor& values,
                        std::int64_t block, const Tensor& payload, const char* op) {
  SK_REQUIRE_OPS_BACKEND(B, "quantize_blocks / dequantize_blocks");
  B::check_context(ctx, op);
  check(block >= 1 && block <= kMaxQuantBlock, op, ": a block of ", block,
        " values; pass 1 to 2^24 (DeepSpeed's qwZ uses ", kDefaultQuantBlock, ")");
  check(quant_block_fits(format, block), op, ": an ", quant_format_name(format), " block of ",
        block, " values; ", quant_format_name(format),
        " packs two codes to a byte and a block must start on one: pass an even block (",
        kDefaultQuantBlock, " is the default)");
  check_quant_values(ctx, values, op);
  const std::int64_t bytes = quant_payload_bytes(values.numel(), block, format);
  check(payload.defined() && payload.dtype() == DType::u8 && payload.is_contiguous() &&
            payload.numel() >= bytes && payload.device() == ctx.device(),
        op, ": payload must be a contiguous u8 tensor of at least ", bytes, " bytes on ",
        ctx.device(), " (quant_payload_bytes(", values.numel(), ", ", block, ", ",
        quant_format_name(format), ")), got ", tensor_text(payload));
  check(reinterpret_cast<std::uintptr_t>(payload.data_ptr()) % 4 == 0, op,
        ": payload starts at an address that is not a multiple of 4; its f32 scales need one "
        "(runs laid end to end at quant_payload_bytes offsets keep it)");
  return values.numel() > 0;
}

}  // namespace detail

// `values` (n elements) into one run of quantize.hpp's blocks of `format` codes, in `payload`.
template <class B>
void quantize_blocks(Context& ctx, QuantFormat format, const Tensor& values, std::int64_t block,
                     const Tensor& payload) {
  if (detail::check_quant_blocks<B>(ctx, format, values, block, payload, "quantize_blocks"))
    B::quantize_blocks(ctx, format, values.dtype(), values.data_ptr(), values.numel(), block,
                       static_cast<std::uint8_t*>(payload.data_ptr()));
}

// One run of `format` blocks in `payload` back into `values` (its n elements, in its dtype).
template <class B>
void dequantize_blocks(Context& ctx, QuantFormat format, const Tensor& payload, std::int64_t block,
                       const Tensor& values) {
  if (detail::check_quant_blocks<B>(ctx, format, values, block, payload, "dequantize_blocks"))
    B::dequantize_blocks(ctx, format, values.dtype(),
                         static_cast<const std::uint8_t*>(payload.data_ptr()), values.numel(),
                         block, values.data_ptr(), false);
}

// values += the run's values (f32 `values`): dequantize_blocks into a temporary, then add_, in
// one pass and without the temporary -- the same bits (the product and the sum rounded apart).
// qgZ's owner sums the ranks' runs this way.
template <class B>
void dequantize_add_blocks(Context& ctx, QuantFormat format, const Tensor& payload,
                           std::int64_t block, const Tensor& values) {
  check(!values.defined() || values.dtype() == DType::f32,
        "dequantize_add_blocks: values must be f32 (the sum is formed in f32), got ",
        tensor_text(values));
  if (detail::check_quant_blocks<B>(ctx, format, values, block, payload, "dequantize_add_blocks"))
    B::dequantize_blocks(ctx, format, values.dtype(),
                         static_cast<const std::uint8_t*>(payload.data_ptr()), values.numel(),
                         block, values.data_ptr(), true);
}

namespace detail {

// The checks of the per-tensor-scaled ops (quantize.hpp): backend B and ctx's device; `values`
// contiguous f32, f16 or bf16; `chunks` contiguous i64 [C, 3] rows (slot_chunks' table, whose
// bounds were checked when it was made); `amax` contiguous f32 with a value per slot; all on
// ctx's device; a one-byte code; `codes` (when given) contiguous u8 of at least values' numel on
// ctx's device. Returns the chunk count (0: nothing to do).
template <class B>
std::int64_t check_slot_chunks(const Context& ctx, QuantFormat format, const Tensor& values,
                               const Tensor& chunks, const Tensor& amax, const char* op,
                               const Tensor* codes = nullptr) {
  SK_REQUIRE_OPS_BACKEND(B, "slot_abs_max / quantize_by_slots / dequantize_by_slots");
  B::check_context(ctx, op);
  check(quant_code_bits(format) == 8, op, ": ", quant_format_name(format),
        " codes with a per-tensor scale; those take one-byte codes (int8 or f8_e4m3)");
  const auto on_device = [&](const Tensor& t, DType dtype) {
    return t.defined() && t.is_contiguous() && t.dtype() == dtype && t.device() == ctx.device();
  };
  check_quant_values(ctx, values, op);
  check(on_device(chunks, DType::i64) && chunks.dim() == 2 && chunks.size(1) == 3, op,
        ": chunks must be slot_chunks' table, a contiguous i64 [C, 3] tensor on ", ctx.device(),
        ", got ", tensor_text(chunks, "none"));
  check(codes == nullptr || (on_device(*codes, DType::u8) && codes->numel() >= values.numel()), op,
        ": codes must be a contiguous u8 tensor of at least ", values.numel(), " bytes on ",
        ctx.device(), ", got ", TensorText(codes, "none"));
  check(on_device(amax, DType::f32), op,
        ": amax must be a contiguous f32 tensor (a value per "
        "slot) on ",
        ctx.device(), ", got ", tensor_text(amax, "none"));
  return values.numel() > 0 ? chunks.size(0) : 0;
}

}  // namespace detail

// amax[slot] = max(amax[slot], |x|) over each chunk of `values` (a run; quantize.hpp's
// slot_chunks table in `chunks`): each rank's maxima of its pieces of the tensors, before the
// all-reduce that makes them the tensors'. Start from zeros.
template <class B>
void slot_abs_max(Context& ctx, const Tensor& values, const Tensor& chunks, const Tensor& amax) {
  if (const std::int64_t count = detail::check_slot_chunks<B>(ctx, QuantFormat::int8, values,
                                                              chunks, amax, "slot_abs_max"))
    B::slot_abs_max(ctx, values.dtype(), values.data_ptr(),
                    static_cast<const std::int64_t*>(chunks.data_ptr()), count,
                    static_cast<float*>(amax.data_ptr()));
}

// `values` into one-byte `format` codes (`codes`: u8, at least values' numel), each with its
// slot's scale amax / kMax.
template <class B>
void quantize_by_slots(Context& ctx, QuantFormat format, const Tensor& values, const Tensor& chunks,
                       const Tensor& amax, const Tensor& codes) {
  const std::int64_t count =
      detail::check_slot_chunks<B>(ctx, format, values, chunks, amax, "quantize_by_slots", &codes);
  if (count > 0)
    B::quantize_by_slots(ctx, format, values.dtype(), values.data_ptr(),
                         static_cast<const std::int64_t*>(chunks.data_ptr()), count,
                         static_cast<const float*>(amax.data_ptr()),
                         static_cast<std::uint8_t*>(codes.data_ptr()));
}

// The codes back into `values` (its dtype), each with its slot's scale.
template <class B>
void dequantize_by_slots(Context& ctx, QuantFormat format, const Tensor& codes,
                         const Tensor& chunks, const Tensor& amax, const Tensor& values) {
  const std::int64_t count = detail::check_slot_chunks<B>(ctx, format, values, chunks, amax,
                                                          "dequantize_by_slots", &codes);
  if (count > 0)
    B::dequantize_by_slots(ctx, format, values.dtype(),
                           static_cast<const std::uint8_t*>(codes.data_ptr()),
                           static_cast<const std::int64_t*>(chunks.data_ptr()), count,
                           static_cast<const float*>(amax.data_ptr()), values.data_ptr());
}

}  // namespace shardkit::ops
