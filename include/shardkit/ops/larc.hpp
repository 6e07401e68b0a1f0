// LARC (apex.parallel.LARC, docs/semantics.md) as per-tensor SGD coefficients: from a
// tensor's sums of squares of parameter and gradient, the factors of g' = grad·g + param·w.
// LARC takes the optimizer's weight decay over: run the SGD rule with weight_decay 0.
#pragma once

#include <cmath>

#include "shardkit/core/error.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::ops {

struct LarcOptions {
  float trust_coefficient = 0.02f;  // apex's default; SwAV/VISSL use 0.001
  bool clip = true;                 // apex's default; SwAV/VISSL use false
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // the wrapped optimizer's decay, taken over by LARC
};

inline void validate(const LarcOptions& o) {
  check(o.trust_coefficient > 0, "LARC trust_coefficient must be > 0, got ", o.trust_coefficient);
  check(o.eps >= 0, "LARC eps must be >= 0, got ", o.eps);
  check(o.weight_decay >= 0, "LARC weight_decay must be >= 0, got ", o.weight_decay);
}

// `param_sumsq` and `grad_sumsq` are the whole tensor's sums of squares (all its segments, on
// all ranks); the gradient's are of the stored (still loss-scaled) values, `inv_grad_scale`
// unscales them. `decay` is this tensor's weight decay (o.weight_decay, or 0 for a parameter in
// a no-decay group). Computed in double from the exact sums; apex computes the same in f32.
SK_HOST_DEVICE SK_INLINE SgdCoefficients larc_coefficients(double param_sumsq, double grad_sumsq,
                                                           const LarcOptions& o, float lr,
                                                           float inv_grad_scale, double decay) {
  const double param_norm = sqrt(param_sumsq);
  // Each product rounded on its own (mul_rn): nvcc would otherwise fuse one into the sum below
  // and the device's rate could differ from the host's in its last bit.
  const double grad_norm = mul_rn(sqrt(grad_sumsq), static_cast<double>(inv_grad_scale));
  // The zero-norm rule: the gradient is left alone and gets no weight decay this step.
  // (A NaN norm compares unequal to 0 and flows on, as in apex.)
  if (!(param_norm != 0.0 && grad_norm != 0.0)) return SgdCoefficients{inv_grad_scale, 0.0f};
  double rate = static_cast<double>(o.trust_coefficient) * param_norm /
                (grad_norm + mul_rn(param_norm, decay) + static_cast<double>(o.eps));
  if (o.clip) {
    rate /= static_cast<double>(lr);
    rate = 1.0 < rate ? 1.0 : rate;  // Python's min(rate, 1): a NaN rate stays NaN
  }
  return SgdCoefficients{static_cast<float>(rate * inv_grad_scale),
                         static_cast<float>(rate * decay)};
}

SK_HOST_DEVICE SK_INLINE SgdCoefficients larc_coefficients(double param_sumsq, double grad_sumsq,
                                                           const LarcOptions& o, float lr,
                                                           float inv_grad_scale) {
  return larc_coefficients(param_sumsq, grad_sumsq, o, lr, inv_grad_scale,
                           static_cast<double>(o.weight_decay));
}

// The SGD options LARC runs with: the caller's, with the decay taken over.
inline SgdOptions sgd_options_under_larc(SgdOptions o) {
  o.weight_decay = 0.0f;
  return o;
}

}  // namespace shardkit::ops
