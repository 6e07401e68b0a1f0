// The fused ops on a CUDA GPU: the same calls as sk::ops::cpu (include/shardkit/ops/
// cpu_ops.hpp), run through the multi-tensor launcher on the context's stream. Every call is
// asynchronous; results land in device tensors.
#pragma once

#include <span>
#include <vector>

#include "kernels/ops/multi_tensor_apply.cuh"
#include "shardkit/ops/cast.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/op_args.hpp"

namespace shardkit::ops::cuda {

namespace detail {

inline void check_cuda(const Context& ctx, const char* op) {
  check(ctx.device().is_cuda(), op, ": sk::ops::cuda needs a CUDA context, got ",
        ctx.device().str(), "; use sk::ops::cpu for the CPU");
}

// One thread per tensor: sums (f64 [2, n], read from the back when `reversed`) -> coefficients.
__global__ void larc_coefficients_kernel(const double* sums, std::int64_t n, bool reversed,
                                         LarcOptions larc, float lr, float inv_grad_scale,
                                         SgdCoefficients* out) {
  const std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (i >= n) return;
  const std::int64_t at = reversed ? n - 1 - i : i;
  out[i] = ops::larc_coefficients(sums[at], sums[n + at], larc, lr, inv_grad_scale);
}

inline void launch_larc_coefficients(Context& ctx, const double* sums, std::int64_t n,
                                     bool reversed, const LarcOptions& larc, float lr,
                                     float inv_grad_scale, SgdCoefficients* out) {
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  larc_coefficients_kernel<<<blocks, kThreads, 0, ctx.stream()>>>(sums, n, reversed, larc, lr,
                                                                   inv_grad_scale, out);
  SK_CUDA_CHECK_LAUNCH("ops::cuda::larc_coefficients_kernel");
}

}  // namespace detail

inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors) {
  detail::check_cuda(ctx, "sgd_step");
  const auto spans = sgd_spans(ctx, options, tensors);
  visit_sgd_functor(options, low_copy_dtype(tensors.low_copies, "sgd_step"), nullptr,
                    [&](const auto& op) { apply(ctx, op, spans); });
}

// SGD with per-parameter coefficients (device f32 [n, 2]); see the CPU twin.
inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors,
                     const Tensor& coefficients) {
  detail::check_cuda(ctx, "sgd_step");
  check(options.weight_decay == 0 && options.inv_grad_scale == 1,
        "sgd_step with coefficients: fold weight_decay and inv_grad_scale into the coefficients "
        "(larc_coefficients does) and leave them at 0 and 1 in the options");
  const auto spans = sgd_spans(ctx, options, tensors);
  const auto* per_segment = coefficients_data(ctx, coefficients, spans.size(), "sgd_step");
  visit_sgd_functor(options, low_copy_dtype(tensors.low_copies, "sgd_step"), per_segment,
                    [&](const auto& op) { apply(ctx, op, spans); });
}

// Per-span sums of squares into device f64 [1, n] or [2, n]; see the CPU twin.
inline void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                    std::span<const Tensor> second, const Tensor& sums) {
  detail::check_cuda(ctx, "segment_sums_of_squares");
  const auto n = static_cast<std::int64_t>(first.size());
  if (second.empty()) {
    const auto spans = make_spans<1>(ctx, "segment_sums_of_squares",
                                     {OperandList{first, DType::f32, "tensors"}}, {true});
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "segment_sums_of_squares", "sums");
    apply(ctx, SumOfSquaresFunctor<1>{}, spans, sums.data<double>());
  } else {
    const auto spans = make_spans<2>(
        ctx, "segment_sums_of_squares",
        {OperandList{first, DType::f32, "first"}, OperandList{second, DType::f32, "second"}},
        {true, true});
    check_result_tensor(ctx, sums, DType::f64, {2, n}, "segment_sums_of_squares", "sums");
    apply(ctx, SumOfSquaresFunctor<2>{}, spans, sums.data<double>());
  }
}

inline void larc_coefficients(Context& ctx, const LarcOptions& larc, float lr,
                              float inv_grad_scale, const Tensor& sums,
                              const Tensor& coefficients) {
  detail::check_cuda(ctx, "larc_coefficients");
  validate(larc);
  check(sums.dim() == 2 && sums.size(0) == 2, "larc_coefficients: sums must be f64 [2, n], got ",
        sums.str());
  const auto n = sums.size(1);
  check_result_tensor(ctx, sums, DType::f64, {2, n}, "larc_coefficients", "sums");
  check_result_tensor(ctx, coefficients, DType::f32, {n, 2}, "larc_coefficients",
                      "coefficients");
  detail::launch_larc_coefficients(ctx, sums.data<double>(), n, false, larc, lr, inv_grad_scale,
                                   static_cast<SgdCoefficients*>(coefficients.data_ptr()));
}

// LARC-SGD where every tensor lies whole on this GPU: one norms pass (params and grads
// together), one tiny coefficient kernel, one update pass. The norms pass walks the tensors
// last to first, so the update's first reads find the L2 holding what it needs.
inline void larc_sgd_step(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                          const SgdTensors& tensors) {
  detail::check_cuda(ctx, "larc_sgd_step");
  validate(larc);
  check(options.weight_decay == 0, "larc_sgd_step: LARC takes weight decay over; pass it as ",
        "LarcOptions::weight_decay and leave SgdOptions::weight_decay at 0 (got ",
        options.weight_decay, ")");
  const auto spans = sgd_spans(ctx, options, tensors);
  const auto n = static_cast<std::int64_t>(spans.size());
  if (n == 0) return;
  SpanList<2> reversed(spans.size());
  for (std::size_t s = 0; s < spans.size(); ++s) {
    const auto& span = spans[spans.size() - 1 - s];
    reversed[s].data = {span.data[0], span.data[1]};
    reversed[s].size = span.size;
  }
  Tensor sums = empty(ctx, {2, n}, DType::f64);
  Tensor coefficients = empty(ctx, {n, 2}, DType::f32);
  apply(ctx, SumOfSquaresFunctor<2>{}, reversed, sums.data<double>());
  detail::launch_larc_coefficients(ctx, sums.data<double>(), n, true, larc, options.lr,
                                   options.inv_grad_scale,
                                   static_cast<SgdCoefficients*>(coefficients.data_ptr()));
  SgdOptions plain = options;
  plain.inv_grad_scale = 1.0f;  // folded into the coefficients
  visit_sgd_functor(plain, low_copy_dtype(tensors.low_copies, "larc_sgd_step"),
                    static_cast<const SgdCoefficients*>(coefficients.data_ptr()),
                    [&](const auto& op) { apply(ctx, op, spans); });
}

inline void adam_step(Context& ctx, const AdamOptions& options, const AdamTensors& tensors) {
  detail::check_cuda(ctx, "adam_step");
  const auto spans = adam_spans(ctx, options, tensors);
  visit_adam_functor(options, low_copy_dtype(tensors.low_copies, "adam_step"),
                     [&](const auto& op) { apply(ctx, op, spans); });
}

inline void cast(Context& ctx, std::span<const Tensor> src, std::span<const Tensor> dst) {
  detail::check_cuda(ctx, "cast");
  DType from, to;
  const auto spans = cast_spans(ctx, src, dst, from, to);
  if (from == DType::f32 && to == DType::f16) return apply(ctx, CastFunctor<float, Half>{}, spans);
  if (from == DType::f32) return apply(ctx, CastFunctor<float, BFloat16>{}, spans);
  if (from == DType::f16) return apply(ctx, CastFunctor<Half, float>{}, spans);
  apply(ctx, CastFunctor<BFloat16, float>{}, spans);
}

// See the CPU twin; found_nonfinite and sums are device tensors.
inline void unscale_and_check(Context& ctx, float inv_scale, std::span<const Tensor> grads,
                              const Tensor& found_nonfinite, const Tensor& sums = Tensor()) {
  detail::check_cuda(ctx, "unscale_and_check");
  const auto spans =
      make_spans<1>(ctx, "unscale_and_check", {OperandList{grads, DType::f32, "grads"}}, {true});
  const auto n = static_cast<std::int64_t>(spans.size());
  check_result_tensor(ctx, found_nonfinite, DType::f32, {1}, "unscale_and_check",
                      "found_nonfinite");
  Tensor out = sums;
  if (sums.defined())
    check_result_tensor(ctx, sums, DType::f64, {1, n}, "unscale_and_check", "sums");
  else
    out = empty(ctx, {1, n}, DType::f64);
  UnscaleFunctor op;
  op.inv_scale = inv_scale;
  apply(ctx, op, spans, out.data<double>(), found_nonfinite.data<float>());
}

}  // namespace shardkit::ops::cuda
