// Central finite differences in float64 against the tape's gradients, for the autograd tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "shardkit/autograd/autograd.hpp"

namespace shardkit::autograd::testing {

// An f64 CPU tensor with values uniform in [low, high) from the context's stream.
inline Variable random_variable(Context& ctx, Shape shape, double low, double high,
                                bool requires_grad = true) {
  Tensor t = empty(ctx, std::move(shape), DType::f64, MemoryCategory::parameters);
  uniform_(ctx, t, low, high);
  return Variable(t, requires_grad);
}

// Values in +-[margin, high): away from the kink of relu / max so a finite step never crosses it.
inline Variable random_away_from_zero(Context& ctx, Shape shape, double margin, double high) {
  Variable v = random_variable(ctx, std::move(shape), -high, high);
  auto* p = v.data().data<double>();
  for (std::int64_t i = 0; i < v.numel(); ++i) p[i] = p[i] < 0 ? p[i] - margin : p[i] + margin;
  return v;
}

struct GradcheckResult {
  double worst_relative_error = 0;  // over inputs: |analytic - numeric|_2 / |numeric|_2
  std::size_t worst_input = 0;
};

using Forward = std::function<Variable(const std::vector<Variable>&)>;

inline double weighted_sum(Context& ctx, const Variable& out, const std::vector<double>& weights) {
  const auto values = to_vector<double>(ctx, contiguous(ctx, out.data()));
  double s = 0;
  for (std::size_t i = 0; i < values.size(); ++i) s += values[i] * weights[i];
  return s;
}

// Checks d/d(input) of sum(forward(inputs) * W) for a random W, for every input that requires
// grad; `corrupt` (tests of this checker) perturbs the analytic gradient first.
inline GradcheckResult gradcheck(Context& ctx, const std::vector<Variable>& inputs,
                                 const Forward& forward, double step = 1e-6, double corrupt = 0) {
  for (const auto& in : inputs) in.impl()->grad = Tensor();
  Variable out = forward(inputs);
  Variable weights_var = random_variable(ctx, out.shape(), -1, 1, false);
  const auto weights = to_vector<double>(ctx, weights_var.data());
  backward(ctx, out, weights_var.data());
  GradcheckResult result;
  NoGradGuard no_grad(ctx);
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const Variable& in = inputs[k];
    if (!in.requires_grad()) continue;
    REQUIRE_MESSAGE(in.grad().defined(), "input " << k << " got no gradient");
    auto analytic = to_vector<double>(ctx, in.grad());
    if (corrupt != 0) analytic[0] += corrupt;
    double* p = in.data().data<double>();
    double diff = 0, norm = 0;
    for (std::int64_t i = 0; i < in.numel(); ++i) {
      const double saved = p[i];
      p[i] = saved + step;
      const double plus = weighted_sum(ctx, forward(inputs), weights);
      p[i] = saved - step;
      const double minus = weighted_sum(ctx, forward(inputs), weights);
      p[i] = saved;
      const double numeric = (plus - minus) / (2 * step);
      diff += (analytic[static_cast<std::size_t>(i)] - numeric) *
              (analytic[static_cast<std::size_t>(i)] - numeric);
      norm += numeric * numeric;
    }
    const double error = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
    if (error > result.worst_relative_error) {
      result.worst_relative_error = error;
      result.worst_input = k;
    }
  }
  return result;
}

// Largest |a - b| over the largest |b|: an error relative to the values' scale.
inline double scaled_error(const std::vector<double>& a, const std::vector<double>& b) {
  check(a.size() == b.size(), "scaled_error: ", a.size(), " values against ", b.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

}  // namespace shardkit::autograd::testing
