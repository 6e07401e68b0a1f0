// The values a loss-scaled optimizer step depends on, kept where the step runs, so that the
// host queues a whole step without waiting for the device (docs/design.md, "A step the host
// does not wait for"):
//
//   the step gate        f32 [4] the fused SGD and Adam passes read (SgdOptions::gate,
//                        AdamOptions::gate): [0] a factor on the gradients (1 / the loss scale),
//                        [1] skip -- nonzero: the pass writes nothing (an overflow on some rank),
//                        [2] the updates applied before this one (Adam's bias correction, SGD's
//                        first-step rule: a skipped step does not count), [3] the learning
//                        rate (the options' lr is not used: a captured step's rate is set
//                        before each replay, outside it)
//   the loss scale state f32 [4] optim::DynamicLossScaler keeps: [0] the scale, [1] the inverse
//                        of the scale this step's gradients carry, [2] found_inf (the max over
//                        ranks), [3] the growth tracker (finite steps in a row)
//
// and the element functors that advance them on the device (one element each: the launch is the
// cost, not the work). f32 holds every value exactly: scales are the initial scale times powers
// of the factors (as torch.cuda.amp.GradScaler's f32 scale), counts exact to 2^24.
#pragma once

#include <cstdint>

#include "shardkit/ops/functor.hpp"

namespace shardkit::ops {

enum StepGateSlot : int {
  kGateGradFactor = 0,
  kGateSkip = 1,
  kGateStepsBefore = 2,
  kGateRate = 3,
  kGateSlots = 4
};
enum LossScaleSlot : int {
  kLossScale = 0,
  kLossInvScale = 1,
  kLossFoundInf = 2,
  kLossGrowthTracker = 3,
  kLossScaleSlots = 4
};

// Whether a gated pass writes nothing: read by the launchers (cpu_apply.hpp, the CUDA apply
// kernel) where the pass runs, for functors with a `gate` member (null: always runs).
template <class F>
SK_HOST_DEVICE SK_INLINE bool gate_skips(const F& op) {
  if constexpr (requires { op.gate; })
    return op.gate != nullptr && op.gate[kGateSkip] != 0.0f;
  else
    return false;
}

// The gate's count advances past a step that was applied: steps_before += (skip == 0).
// Operands: 0 steps_before, 1 skip (one element each).
struct CountAppliedStepFunctor {
  static constexpr int kDepth = 2;
  using Types = TypeList<float, float>;
  static constexpr unsigned kReads = 0b11u;
  static constexpr unsigned kWrites = 0b01u;
  static constexpr int kSums = 0;

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }
  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[2], const Segment&, double (&)[1]) const {
    x[0] += x[1] != 0.0f ? 0.0f : 1.0f;
  }
};

// GradScaler's rules as numbers the functor carries.
struct LossScaleRule {
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  float growth_interval = 2000.0f;  // exact in f32 (checked below 2^24)
};

// The loss scale state over one step. Operands: the state's four slots, one element each.
//   begin   before the gradients are checked: inv_scale <- 1 / scale, found_inf <- 0
//   update  after the step: back off on found_inf (the tracker restarts), else count the finite
//           step and grow after growth_interval of them in a row (torch's _amp_update_scale_);
//           inv_scale keeps the inverse of the scale the step's gradients carried, so
//           scale · inv_scale is the scale's change (what error feedback follows)
struct LossScaleFunctor {
  enum class Phase : std::uint8_t { begin, update };
  static constexpr int kDepth = 4;
  using Types = TypeList<float, float, float, float>;
  static constexpr unsigned kReads = 0b1111u;
  static constexpr unsigned kWrites = 0b1111u;
  static constexpr int kSums = 0;

  Phase phase = Phase::begin;
  LossScaleRule rule{};

  struct Segment {};
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const { return {}; }
  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[4], const Segment&, double (&)[1]) const {
    if (phase == Phase::begin) {
      x[kLossInvScale] = 1.0f / x[kLossScale];
      x[kLossFoundInf] = 0.0f;
      return;
    }
    if (x[kLossFoundInf] != 0.0f) {
      x[kLossScale] *= rule.backoff_factor;
      x[kLossGrowthTracker] = 0.0f;
    } else if (x[kLossGrowthTracker] + 1.0f == rule.growth_interval) {
      // (GradScaler keeps the scale where growing it would leave f32: an infinite scale would
      // skip every later step, backed off or not)
      const float grown = x[kLossScale] * rule.growth_factor;
      if (grown <= 3.40282347e38f) x[kLossScale] = grown;
      x[kLossGrowthTracker] = 0.0f;
    } else {
      x[kLossGrowthTracker] += 1.0f;
    }
  }
};

// Values kept across steps in the scaled units (qgZ's error-feedback residuals) follow the
// scale after its update: times scale · inv_scale (new / old; exact for power-of-two factors),
// or dropped (0) after an overflow, whose residuals may hold an inf. Operand: the values (f32).
struct FollowLossScaleFunctor {
  static constexpr int kDepth = 1;
  using Types = TypeList<float>;
  static constexpr unsigned kReads = 1u;
  static constexpr unsigned kWrites = 1u;
  static constexpr int kSums = 0;

  const float* state = nullptr;  // the loss scale state, on the values' device

  struct Segment {
    float factor;
  };
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t) const {
    return {state[kLossFoundInf] != 0.0f ? 0.0f : state[kLossScale] * state[kLossInvScale]};
  }
  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[1], const Segment& s, double (&)[1]) const {
    // A select, so that an inf residual becomes 0, not NaN, when the factor is 0.
    x[0] = s.factor == 0.0f ? 0.0f : x[0] * s.factor;
  }
};

}  // namespace shardkit::ops
