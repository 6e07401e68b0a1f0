// Fused SGD (PyTorch semantics, docs/semantics.md): weight decay, momentum with PyTorch's
// first-step rule, dampening, nesterov, an unscale of the gradient folded in, and an optional
// f16/bf16 copy of the updated parameter written in the same call (on the CPU converted from
// each chunk's new parameters right after the rule: cpu_apply.hpp, LowCopy).
#pragma once

#include <cstdint>
#include <type_traits>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/step_gate.hpp"

namespace shardkit::ops {

struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  // PyTorch's momentum buffer does not exist before the first step: then buf <- g (no
  // dampening) and the buffer is written, never read.
  bool first_step = true;
  // Gradients are multiplied by this first (1 / loss scale).
  float inv_grad_scale = 1.0f;
  // Optional: the step gate (step_gate.hpp, f32 [4] on the context's device). The gradients are
  // then multiplied by its factor too, the pass is skipped where it says so, its count of
  // applied steps decides the first-step rule and its rate is the rate (first_step and lr are
  // not used).
  Tensor gate = Tensor();
};

inline void validate(const SgdOptions& o) {
  check(o.lr >= 0, "SGD lr must be >= 0, got ", o.lr);
  check(o.momentum >= 0, "SGD momentum must be >= 0, got ", o.momentum);
  check(o.weight_decay >= 0, "SGD weight_decay must be >= 0, got ", o.weight_decay);
  check(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
        "SGD nesterov needs momentum > 0 and dampening 0 (as PyTorch), got momentum ", o.momentum,
        " and dampening ", o.dampening);
}

// The gradient the SGD rule uses, per span: g' = grad·g + param·w. Plain SGD: (inv_grad_scale,
// weight_decay) everywhere; LARC: per-tensor values from larc.hpp.
struct SgdCoefficients {
  float grad = 1.0f;
  float param = 0.0f;
};

enum class MomentumMode : std::uint8_t { none, first_step, running };

// A gated step decides the first-step rule on the device: it runs the running rule, whose
// per-span factors then make the buffer g (segment_of below).
inline MomentumMode momentum_mode(const SgdOptions& o) {
  if (o.momentum == 0) return MomentumMode::none;
  return o.first_step && !o.gate.defined() ? MomentumMode::first_step : MomentumMode::running;
}

// What the SGD rule reads besides its operands, whatever their storage (SgdFunctor). Every
// field belongs here, not in SgdFunctor: without_copy() carries these alone.
struct SgdRule {
  float lr = 0;
  float momentum = 0;
  float dampening_complement = 1;  // 1 - dampening
  // 1 for Nesterov momentum, else 0: a float, since g++ 12 vectorises a select on a float
  // comparison but not one on a bool it cannot hoist out of the loop.
  float nesterov = 0;
  SgdCoefficients uniform{};
  const SgdCoefficients* per_segment = nullptr;  // when set, overrides `uniform` per span
  const float* gate = nullptr;                   // the step gate (step_gate.hpp), or none
};

// Operands: 0 param (f32), 1 grad (Grad: f32, or the copy's dtype under mixed precision),
// 2 momentum buffer (f32), 3 low-precision copy (Low).
template <MomentumMode Mode, class Low = void, class Grad = float>
struct SgdFunctor : SgdRule {
  static constexpr int kDepth = 4;
  using Types = TypeList<float, Grad, float, low_storage_t<Low>>;
  static constexpr unsigned kReads = 0b0011u | (Mode == MomentumMode::running ? 0b0100u : 0u);
  static constexpr unsigned kWrites =
      0b0001u | (Mode != MomentumMode::none ? 0b0100u : 0u) | (std::is_void_v<Low> ? 0u : 0b1000u);
  static constexpr int kSums = 0;

  // The rule without the copy: the CPU writes the copy from the updated parameters itself
  // (cpu_apply.hpp, LowCopy).
  using LowStorage = Low;
  using WithoutCopy = SgdFunctor<Mode, void, Grad>;
  WithoutCopy without_copy() const {
    WithoutCopy f;
    static_cast<SgdRule&>(f) = *this;
    return f;
  }

  // Per span: the gradient's coefficients, the running rule's buf = g_weight·g +
  // buf_keep·buf -- (1 - dampening, momentum), or (1, 0) on a gated first step, which makes
  // the zero-initialised buffer g as PyTorch's first step does (up to the sign of a -0) --
  // and the rate: `lr`, or the gate's.
  struct Segment {
    float grad, param;
    float g_weight, buf_keep;
    float rate;
  };
  SK_HOST_DEVICE SK_INLINE Segment segment_of(SgdCoefficients c) const {
    Segment s{c.grad, c.param, dampening_complement, momentum, lr};
    if (gate != nullptr) {
      s.grad *= gate[kGateGradFactor];
      s.rate = gate[kGateRate];
      if (gate[kGateStepsBefore] == 0.0f) {
        s.g_weight = 1.0f;
        s.buf_keep = 0.0f;
      }
    }
    return s;
  }
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t index) const {
    return segment_of(per_segment != nullptr ? per_segment[index] : uniform);
  }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[kDepth], const Segment& c,
                                           double (&)[1]) const {
    // Each multiply-add rounds once, as PyTorch's add(..., alpha=) does (mul_add, element.hpp).
    // The options' choices are selects between values both computed, not branches: g++ can
    // then vectorise the loop without first splitting it per choice, which it stops doing once
    // the body grows (bf16 gradients and a bf16 copy left the loop scalar).
    const float scaled = c.grad * x[1];
    // Not taken, rather than multiplied by 0, when there is no decay: an inf parameter must not
    // turn the gradient into NaN (PyTorch skips the add too; here the select drops it).
    const float decayed = mul_add(c.param, x[0], scaled);
    const float g = c.param != 0.0f ? decayed : scaled;
    float d = g;
    if constexpr (Mode == MomentumMode::first_step) {
      x[2] = g;
      const float ahead = mul_add(momentum, g, g);
      d = nesterov != 0.0f ? ahead : g;
    } else if constexpr (Mode == MomentumMode::running) {
      const float buf = mul_add(c.g_weight, g, c.buf_keep * x[2]);
      x[2] = buf;
      const float ahead = mul_add(momentum, buf, g);
      d = nesterov != 0.0f ? ahead : buf;
    }
    x[0] = mul_add(-c.rate, d, x[0]);
    if constexpr (!std::is_void_v<Low>) x[3] = x[0];
  }
};

static_assert(sizeof(SgdFunctor<MomentumMode::running, Half>) == sizeof(SgdRule),
              "SgdFunctor's fields belong in SgdRule (without_copy() copies SgdRule alone)");

template <MomentumMode Mode, class Low, class Grad>
SgdFunctor<Mode, Low, Grad> make_sgd_functor(const SgdOptions& o,
                                             const SgdCoefficients* per_segment) {
  SgdFunctor<Mode, Low, Grad> f;
  f.lr = o.lr;
  f.momentum = o.momentum;
  f.dampening_complement = 1.0f - o.dampening;
  f.nesterov = o.nesterov ? 1.0f : 0.0f;
  f.uniform = SgdCoefficients{o.inv_grad_scale, o.weight_decay};
  f.per_segment = per_segment;
  f.gate = o.gate.defined() ? o.gate.data<float>() : nullptr;
  return f;
}

// Calls fn(functor) with the SgdFunctor instantiation the run-time options select. `grad` is
// the gradients' dtype and `low` the dtype of the low-precision copies (f32 = none).
template <class Fn>
void visit_sgd_functor(const SgdOptions& o, DType grad, DType low,
                       const SgdCoefficients* per_segment, Fn&& fn) {
  visit_grad_and_low(grad, low, "sgd_step", [&]<class Grad, class Low>() {
    switch (momentum_mode(o)) {
      case MomentumMode::none:
        return fn(make_sgd_functor<MomentumMode::none, Low, Grad>(o, per_segment));
      case MomentumMode::first_step:
        return fn(make_sgd_functor<MomentumMode::first_step, Low, Grad>(o, per_segment));
      case MomentumMode::running:
        return fn(make_sgd_functor<MomentumMode::running, Low, Grad>(o, per_segment));
    }
  });
}

}  // namespace shardkit::ops
