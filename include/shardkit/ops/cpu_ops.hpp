// The fused ops on the CPU: the functors of this folder run through cpu_apply.hpp. The CUDA
// entry points in kernels/ops/ops.cuh take exactly the same arguments.
#pragma once

#include <span>
#include <vector>

#include "shardkit/ops/cast.hpp"
#include "shardkit/ops/cpu_apply.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/op_args.hpp"

namespace shardkit::ops::cpu {

namespace detail {
inline void check_cpu(const Context& ctx, const char* op) {
  check(ctx.device().is_cpu(), op, ": sk::ops::cpu needs a CPU context, got ",
        ctx.device().str(), "; use sk::ops::cuda from <kernels/ops/ops.cuh>");
}
// Sums of squares of operands 0 and 1 of a span, one operand after the other: the same bits
// as SumOfSquaresFunctor<2> (each operand keeps its own lanes), but single-operand loops
// vectorise fully where the paired one does not.
template <int Depth>
std::array<double, 2> sums_of_pair(const Span<Depth>& span) {
  std::array<double, 2> out{};
  for (int k = 0; k < 2; ++k) {
    Span<1> one;
    one.data = {span.data[static_cast<std::size_t>(k)]};
    one.size = span.size;
    out[static_cast<std::size_t>(k)] = apply_span(SumOfSquaresFunctor<1>{}, one, 0)[0];
  }
  return out;
}

}  // namespace detail

// SGD over all parameters with the options' weight decay and unscale.
inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors) {
  detail::check_cpu(ctx, "sgd_step");
  const auto spans = sgd_spans(ctx, options, tensors);
  visit_sgd_functor(options, low_copy_dtype(tensors.low_copies, "sgd_step"), nullptr,
                    [&](const auto& op) { apply(op, spans, nullptr); });
}

// SGD with per-parameter gradient coefficients (f32 [n, 2], e.g. from larc_coefficients): the
// rule uses g' = c[i][0]·g + c[i][1]·w, so options.weight_decay and inv_grad_scale must already
// be folded into them (both must be at their neutral values here).
inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors,
                     const Tensor& coefficients) {
  detail::check_cpu(ctx, "sgd_step");
  check(options.weight_decay == 0 && options.inv_grad_scale == 1,
        "sgd_step with coefficients: fold weight_decay and inv_grad_scale into the coefficients "
        "(larc_coefficients does) and leave them at 0 and 1 in the options");
  const auto spans = sgd_spans(ctx, options, tensors);
  const auto* per_segment = coefficients_data(ctx, coefficients, spans.size(), "sgd_step");
  visit_sgd_functor(options, low_copy_dtype(tensors.low_copies, "sgd_step"), per_segment,
                    [&](const auto& op) { apply(op, spans, nullptr); });
}

// Sums of squares per span: sums is f64 [1, n] for one list, [2, n] with a second list (e.g.
// params and grads in one pass). Partial sums, to be added over the segments of one tensor
// (and over ranks) before the square root.
inline void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                    std::span<const Tensor> second, const Tensor& sums) {
  detail::check_cpu(ctx, "segment_sums_of_squares");
  const auto n = static_cast<std::int64_t>(first.size());
  if (second.empty()) {
    const auto spans = make_spans<1>(ctx, "segment_sums_of_squares",
                                     {OperandList{first, DType::f32, "tensors"}}, {true});
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "segment_sums_of_squares", "sums");
    apply(SumOfSquaresFunctor<1>{}, spans, sums.data<double>());
  } else {
    const auto spans = make_spans<2>(
        ctx, "segment_sums_of_squares",
        {OperandList{first, DType::f32, "first"}, OperandList{second, DType::f32, "second"}},
        {true, true});
    check_result_tensor(ctx, sums, DType::f64, {2, n}, "segment_sums_of_squares", "sums");
    double* out = sums.data<double>();
    for (std::size_t s = 0; s < spans.size(); ++s) {
      const auto pair = detail::sums_of_pair(spans[s]);
      out[s] = pair[0];
      out[static_cast<std::size_t>(n) + s] = pair[1];
    }
  }
}

// LARC coefficients per parameter from whole-tensor sums (f64 [2, n]: params' then grads'
// sums of squares, already added over segments and ranks) into f32 [n, 2].
inline void larc_coefficients(Context& ctx, const LarcOptions& larc, float lr,
                              float inv_grad_scale, const Tensor& sums,
                              const Tensor& coefficients) {
  detail::check_cpu(ctx, "larc_coefficients");
  validate(larc);
  check(sums.dim() == 2 && sums.size(0) == 2, "larc_coefficients: sums must be f64 [2, n], got ",
        sums.str());
  const auto n = sums.size(1);
  check_result_tensor(ctx, sums, DType::f64, {2, n}, "larc_coefficients", "sums");
  check_result_tensor(ctx, coefficients, DType::f32, {n, 2}, "larc_coefficients",
                      "coefficients");
  const double* s = sums.data<double>();
  auto* out = static_cast<SgdCoefficients*>(coefficients.data_ptr());
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = ops::larc_coefficients(s[i], s[n + i], larc, lr, inv_grad_scale);
}

// LARC-SGD where every tensor lies whole in this process (no shards): norms, coefficients and
// update per tensor, back to back, so the second read of a tensor comes from the cache.
// options.weight_decay must be 0: LARC takes larc.weight_decay over.
inline void larc_sgd_step(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                          const SgdTensors& tensors) {
  detail::check_cpu(ctx, "larc_sgd_step");
  validate(larc);
  check(options.weight_decay == 0, "larc_sgd_step: LARC takes weight decay over; pass it as ",
        "LarcOptions::weight_decay and leave SgdOptions::weight_decay at 0 (got ",
        options.weight_decay, ")");
  const auto spans = sgd_spans(ctx, options, tensors);
  visit_sgd_functor(
      options, low_copy_dtype(tensors.low_copies, "larc_sgd_step"), nullptr,
      [&](auto op) {
        for (std::size_t s = 0; s < spans.size(); ++s) {
          const auto sumsq = detail::sums_of_pair(spans[s]);
          op.uniform = ops::larc_coefficients(sumsq[0], sumsq[1], larc, options.lr,
                                              options.inv_grad_scale);
          apply_span(op, spans[s], static_cast<std::int64_t>(s));
        }
      });
}

inline void adam_step(Context& ctx, const AdamOptions& options, const AdamTensors& tensors) {
  detail::check_cpu(ctx, "adam_step");
  const auto spans = adam_spans(ctx, options, tensors);
  visit_adam_functor(options, low_copy_dtype(tensors.low_copies, "adam_step"),
                     [&](const auto& op) { apply(op, spans, nullptr); });
}

// dst[i] = src[i] converted: f32 -> f16/bf16 (round to nearest even) or f16/bf16 -> f32.
inline void cast(Context& ctx, std::span<const Tensor> src, std::span<const Tensor> dst) {
  detail::check_cpu(ctx, "cast");
  DType from, to;
  const auto spans = cast_spans(ctx, src, dst, from, to);
  if (from == DType::f32 && to == DType::f16) return apply(CastFunctor<float, Half>{}, spans, nullptr);
  if (from == DType::f32) return apply(CastFunctor<float, BFloat16>{}, spans, nullptr);
  if (from == DType::f16) return apply(CastFunctor<Half, float>{}, spans, nullptr);
  apply(CastFunctor<BFloat16, float>{}, spans, nullptr);
}

// The loss scaler's pass: grads *= inv_scale; found_nonfinite (f32 [1]) is set to 1 when any
// unscaled gradient is inf or NaN and left alone otherwise (zero it first; several calls
// accumulate, as PyTorch's found_inf does). If `sums` is defined (f64 [1, n]) it receives each
// span's sum of squares of the unscaled gradients: the gradient norms, for free.
inline void unscale_and_check(Context& ctx, float inv_scale, std::span<const Tensor> grads,
                              const Tensor& found_nonfinite, const Tensor& sums = Tensor()) {
  detail::check_cpu(ctx, "unscale_and_check");
  const auto spans =
      make_spans<1>(ctx, "unscale_and_check", {OperandList{grads, DType::f32, "grads"}}, {true});
  const auto n = static_cast<std::int64_t>(spans.size());
  check_result_tensor(ctx, found_nonfinite, DType::f32, {1}, "unscale_and_check",
                      "found_nonfinite");
  std::vector<double> scratch;
  double* out = nullptr;
  if (sums.defined()) {
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "unscale_and_check", "sums");
    out = sums.data<double>();
  } else {
    scratch.resize(static_cast<std::size_t>(n));
    out = scratch.data();
  }
  UnscaleFunctor op;
  op.inv_scale = inv_scale;
  apply(op, spans, out);
  for (std::int64_t s = 0; s < n; ++s)
    if (!is_finite_sum(out[s])) found_nonfinite.data<float>()[0] = 1.0f;
}

}  // namespace shardkit::ops::cpu
