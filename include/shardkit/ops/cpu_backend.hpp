// The CPU backend of the fused ops: the functors run through cpu_apply.hpp's loops on the host.
#pragma once

#include <array>
#include <string_view>
#include <type_traits>

#include "shardkit/ops/backend.hpp"
#include "shardkit/ops/cpu_apply.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::ops {

struct Cpu {
  static constexpr std::string_view name = "cpu";

  static void check_context(const Context& ctx, const char* op) {
    check(ctx.device().is_cpu(), op, "<sk::ops::Cpu> needs a CPU context, got ", ctx.device().str(),
          "; use sk::ops::Cuda from <kernels/ops/cuda_backend.cuh>");
  }

  template <class F>
  static void apply(Context&, const F& op, const SpanList<F::kDepth>& spans) {
    static_assert(F::kSums == 0, "summing functors go through apply_sums");
    cpu::apply(op, spans, nullptr);
  }

  template <class F>
  static void apply_sums(Context&, const F& op, const SpanList<F::kDepth>& spans,
                         const Tensor& sums, const Tensor& found_nonfinite) {
    static_assert(F::kSums > 0, "apply_sums needs a summing functor");
    const auto n = spans.size();
    double* out = sums.data<double>();
    if constexpr (std::is_same_v<F, SumOfSquaresFunctor<2>>) {
      // Each operand in its own loop: the same bits as the paired functor (each operand keeps
      // its own lanes), but single-operand loops vectorise fully where the paired one does not.
      for (std::size_t s = 0; s < n; ++s) {
        const auto pair = sums_of_pair(spans[s]);
        out[s] = pair[0];
        out[n + s] = pair[1];
      }
    } else {
      cpu::apply(op, spans, out);
    }
    if (found_nonfinite.defined())
      for (std::size_t s = 0; s < F::kSums * n; ++s)
        if (!is_finite_sum(out[s])) found_nonfinite.data<float>()[0] = 1.0f;
  }

  static void larc_coefficients(Context&, const LarcOptions& larc, float lr, float inv_grad_scale,
                                const Tensor& sums, const Tensor& coefficients) {
    const auto n = sums.size(1);
    const double* s = sums.data<double>();
    auto* out = static_cast<SgdCoefficients*>(coefficients.data_ptr());
    const bool per_param_decay = sums.size(0) == 3;
    for (std::int64_t i = 0; i < n; ++i)
      out[i] = per_param_decay
                   ? ops::larc_coefficients(s[i], s[n + i], larc, lr, inv_grad_scale, s[2 * n + i])
                   : ops::larc_coefficients(s[i], s[n + i], larc, lr, inv_grad_scale);
  }

  static void leaf_sums_of_squares(Context&, const SpanList<1>& spans, DType dtype,
                                   double* leaves) {
    auto run = [&]<class T>() {
      for (const auto& span : spans) {
        const auto* x = static_cast<const T*>(span.data[0]);
        std::int64_t at = 0;
        for (; at + kNormLeaf <= span.size; at += kNormLeaf)
          *leaves++ = leaf_sum_of_squares(x + at, static_cast<int>(kNormLeaf));
        if (at < span.size)
          *leaves++ = leaf_sum_of_squares(x + at, static_cast<int>(span.size - at));
      }
    };
    if (dtype == DType::f16) return run.template operator()<Half>();
    if (dtype == DType::bf16) return run.template operator()<BFloat16>();
    run.template operator()<float>();
  }

  // Per tensor: norms, coefficients and update back to back, so the update's reads of a tensor
  // come from the cache the norms pass just filled.
  template <class Sgd>
  static void larc_sgd(Context&, Sgd op, const SpanList<4>& spans, const LarcOptions& larc,
                       float lr, float inv_grad_scale) {
    for (std::size_t s = 0; s < spans.size(); ++s) {
      const auto sumsq = sums_of_pair(spans[s]);
      op.uniform = ops::larc_coefficients(sumsq[0], sumsq[1], larc, lr, inv_grad_scale);
      cpu::apply_span(op, spans[s], static_cast<std::int64_t>(s));
    }
  }

 private:
  // Sums of squares of operands 0 and 1 of a span, one operand after the other.
  template <int Depth>
  static std::array<double, 2> sums_of_pair(const Span<Depth>& span) {
    std::array<double, 2> out{};
    for (int k = 0; k < 2; ++k) {
      Span<1> one;
      one.data = {span.data[static_cast<std::size_t>(k)]};
      one.size = span.size;
      out[static_cast<std::size_t>(k)] = cpu::apply_span(SumOfSquaresFunctor<1>{}, one, 0)[0];
    }
    return out;
  }
};

static_assert(OpsBackend<Cpu>);

}  // namespace shardkit::ops
