// Fused Adam and AdamW (PyTorch semantics): bias correction, eps added to sqrt(v_hat), L2
// weight decay (Adam) or decoupled decay (AdamW), unscale folded in, and an optional f16/bf16
// copy of the updated parameter written in the same call (on the CPU converted from each chunk's
// new parameters right after the rule: cpu_apply.hpp, LowCopy).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/step_gate.hpp"

namespace shardkit::ops {

struct AdamOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // true: AdamW
  std::int64_t step = 1;                // this step's number, from 1 (bias correction)
  float inv_grad_scale = 1.0f;
  // Optional: the step gate (step_gate.hpp, f32 [4] on the context's device). The gradients are
  // then multiplied by its factor too, the pass is skipped where it says so, the step's number
  // is its count of applied steps + 1 and the rate its rate (`step` and `lr` are not used).
  Tensor gate = Tensor();
};

inline void validate(const AdamOptions& o) {
  check(o.lr >= 0, "Adam lr must be >= 0, got ", o.lr);
  check(o.beta1 >= 0 && o.beta1 < 1, "Adam beta1 must be in [0, 1), got ", o.beta1);
  check(o.beta2 >= 0 && o.beta2 < 1, "Adam beta2 must be in [0, 1), got ", o.beta2);
  check(o.eps >= 0, "Adam eps must be >= 0, got ", o.eps);
  check(o.weight_decay >= 0, "Adam weight_decay must be >= 0, got ", o.weight_decay);
  check(o.gate.defined() || o.step >= 1,
        "Adam step counts from 1 (the first update is step 1), got ", o.step);
}

// What Adam's rule takes from the step's number (from 1): as PyTorch, the corrections in double
// (Python floats), then used as f32 scalars. One formula for the host and the device (a gated
// step forms them where it runs, from the gate's count).
struct AdamStepScalars {
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};
SK_HOST_DEVICE SK_INLINE AdamStepScalars adam_step_scalars(float lr, float beta1, float beta2,
                                                           double step) {
#if SK_DEVICE_CODE
  const double bc1 = 1.0 - ::pow(static_cast<double>(beta1), step);
  const double bc2 = 1.0 - ::pow(static_cast<double>(beta2), step);
  return {static_cast<float>(static_cast<double>(lr) / bc1), static_cast<float>(::sqrt(bc2))};
#else
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), step);
  return {static_cast<float>(static_cast<double>(lr) / bc1), static_cast<float>(std::sqrt(bc2))};
#endif
}

// What the Adam rule reads besides its operands, whatever their storage (AdamFunctor). Every
// field belongs here, not in AdamFunctor: without_copy() carries these alone.
struct AdamRule {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float l2_decay = 0;         // Adam: g += l2_decay · w
  float decoupled_decay = 0;  // AdamW: w *= param_keep = 1 - lr · decoupled_decay (one rounding)
  float param_keep = 1;
  AdamStepScalars at{0.0f, 1.0f};
  float inv_grad_scale = 1;
  const float* gate = nullptr;  // the step gate (step_gate.hpp), or none
};

// Operands: 0 param, 1 grad (Grad: f32, or the copy's dtype under mixed precision), 2 exp_avg,
// 3 exp_avg_sq (f32; the moments start at 0, as PyTorch's state does), 4 low-precision copy
// (Low).
template <class Low = void, class Grad = float>
struct AdamFunctor : AdamRule {
  static constexpr int kDepth = 5;
  using Types = TypeList<float, Grad, float, float, low_storage_t<Low>>;
  static constexpr unsigned kReads = 0b01111u;
  static constexpr unsigned kWrites = 0b01101u | (std::is_void_v<Low> ? 0u : 0b10000u);
  static constexpr int kSums = 0;

  // The rule without the copy: the CPU writes the copy from the updated parameters itself
  // (cpu_apply.hpp, LowCopy).
  using LowStorage = Low;
  using WithoutCopy = AdamFunctor<void, Grad>;
  WithoutCopy without_copy() const {
    WithoutCopy f;
    static_cast<AdamRule&>(f) = *this;
    return f;
  }

  // The step's scalars: the host's, or on a gated step formed from the gate where it runs
  // (with the host's formulas: the same bits).
  struct Segment {
    AdamStepScalars at;
    float grad_factor;
    float param_keep;
  };
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const {
    if (gate == nullptr) return {at, inv_grad_scale, param_keep};
    const float rate = gate[kGateRate];
    return {
        adam_step_scalars(rate, beta1, beta2, static_cast<double>(gate[kGateStepsBefore]) + 1.0),
        inv_grad_scale * gate[kGateGradFactor], mul_add(-rate, decoupled_decay, 1.0f)};
  }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[kDepth], const Segment& s,
                                           double (&)[1]) const {
    float w = x[0];
    float g = x[1] * s.grad_factor;
    // Selects, not branches, so the loop stays one vectorisable block whatever the operand
    // types (GCC unswitches invariant branches only in small loops): the decay is still
    // skipped, not multiplied by 0, when there is none (an inf parameter must not make the
    // gradient NaN, and -0 must stay -0), and w * 1 is w exactly.
    g = l2_decay != 0.0f ? mul_add(l2_decay, w, g) : g;
    // Rounded before the update is subtracted (mul_rn), as PyTorch's mul_ then addcdiv_: nvcc
    // would fuse the two into one fma and the device's bits would leave the host's.
    w = mul_rn(w, s.param_keep);
    // One rounding per multiply-add (mul_add, element.hpp), as PyTorch's add(..., alpha=).
    const float m = mul_add(1.0f - beta1, g, beta1 * x[2]);
    const float v = mul_add((1.0f - beta2) * g, g, beta2 * x[3]);
    const float denom = sqrtf(v) / s.at.bias_correction2_sqrt + eps;
    w -= s.at.step_size * m / denom;
    x[0] = w;
    x[2] = m;
    x[3] = v;
    if constexpr (!std::is_void_v<Low>) x[4] = w;
  }
};

static_assert(sizeof(AdamFunctor<Half>) == sizeof(AdamRule),
              "AdamFunctor's fields belong in AdamRule (without_copy() copies AdamRule alone)");

template <class Low, class Grad>
AdamFunctor<Low, Grad> make_adam_functor(const AdamOptions& o) {
  AdamFunctor<Low, Grad> f;
  f.lr = o.lr;
  f.beta1 = o.beta1;
  f.beta2 = o.beta2;
  f.eps = o.eps;
  f.l2_decay = o.decoupled_weight_decay ? 0.0f : o.weight_decay;
  f.decoupled_decay = o.decoupled_weight_decay ? o.weight_decay : 0.0f;
  // 1 - lr · decay rounded once, on the host and the device alike (GCC formed it with an fma
  // from 1.0f - lr * decay already).
  f.param_keep = mul_add(-o.lr, f.decoupled_decay, 1.0f);
  if (!o.gate.defined())
    f.at = adam_step_scalars(o.lr, o.beta1, o.beta2, static_cast<double>(o.step));
  f.inv_grad_scale = o.inv_grad_scale;
  f.gate = o.gate.defined() ? o.gate.data<float>() : nullptr;
  return f;
}

template <class Fn>
void visit_adam_functor(const AdamOptions& o, DType grad, DType low, Fn&& fn) {
  visit_grad_and_low(grad, low, "adam_step",
                     [&]<class Grad, class Low>() { return fn(make_adam_functor<Low, Grad>(o)); });
}

}  // namespace shardkit::ops
