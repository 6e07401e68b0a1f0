// DynamicLossScaler: dynamic loss scaling for f16 training, with the semantics and defaults of
// torch.cuda.amp.GradScaler and FairScale's ShardedGradScaler (docs/semantics.md), kept on the
// device so that a step never waits for it (docs/design.md, "A step the host does not wait for"):
//
//   the backward is seeded with the scale (autograd::backward(ctx, loss, scaler.seed(ctx,
//   loss.value()))); the engines' step(lr, scaler) then checks the gradients each rank holds --
//   its pieces under a sharded stage -- into a found-inf flag that one max all-reduce makes every
//   rank agree on (check_grads), steps through the step gate with the gradients unscaled by
//   1 / scale in the fused pass or skips it where an overflow was found (the optimizer's count of
//   applied steps does not advance), and update()s the scale: halved after an overflow, doubled
//   after growth_interval finite steps in a row. All of it is queued on the device; the host
//   reads the state only when asked (scale(), found_inf(): logging, checkpoints, tests).
//
// The state (scale, growth tracker) is what checkpoints keep (TrainingState::scaler). Until the
// first step it lives on the host; the first step moves it to that step's device (one upload).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/device_ops.hpp"

namespace shardkit::optim {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {}) : options_(options) {
    check(
        options.init_scale > 0 && std::isfinite(options.init_scale) && options.init_scale <= 3.0e38,
        "loss scaler: init_scale must be a positive finite f32 number, got ", options.init_scale);
    check(options.growth_factor > 1 && options.growth_factor <= 3.0e38,
          "loss scaler: growth_factor must be a finite f32 number > 1, got ",
          options.growth_factor);
    check(options.backoff_factor > 0 && options.backoff_factor < 1,
          "loss scaler: backoff_factor must be in (0, 1), got ", options.backoff_factor);
    check(options.growth_interval >= 1 && options.growth_interval <= (std::int64_t{1} << 24),
          "loss scaler: growth_interval must be in [1, 2^24] (the device counts in f32), got ",
          options.growth_interval);
    host_ = initial_state(options.init_scale, 0);
  }
  // One scaler, one state: a copy would share the device state with the original.
  DynamicLossScaler(const DynamicLossScaler&) = delete;
  DynamicLossScaler& operator=(const DynamicLossScaler&) = delete;
  DynamicLossScaler(DynamicLossScaler&&) = default;
  DynamicLossScaler& operator=(DynamicLossScaler&&) = default;

  // --- host reads (each waits for the device once the state is there) -------------------------
  double scale() const { return values()[ops::kLossScale]; }
  float inv_scale() const { return static_cast<float>(1.0 / scale()); }
  // Finite steps in a row since the last change of scale.
  std::int64_t growth_tracker() const {
    return static_cast<std::int64_t>(values()[ops::kLossGrowthTracker]);
  }
  // Whether the last checked step found an inf or NaN on some rank (and so was skipped).
  bool found_inf() const { return values()[ops::kLossFoundInf] != 0.0f; }
  const LossScalerOptions& options() const { return options_; }
  // The checked step's verdict in one read, for a step formed on the host.
  struct Verdict {
    bool found_inf;
    float inv_scale;  // 1 / the scale the gradients carry
  };
  Verdict read_verdict() const {
    const auto v = values();
    return {v[ops::kLossFoundInf] != 0.0f, v[ops::kLossInvScale]};
  }

  // --- the step's parts, queued on the device ---------------------------------------------------
  // The backward's seed for `loss` (one element; any float dtype): the scale, on the device.
  Tensor seed(Context& ctx, const Tensor& loss) {
    check(loss.numel() == 1, "loss scaler: seed() is for a one-element loss, got ", loss,
          "; reduce the loss to one value first (e.g. its mean)");
    const Tensor& s = state(ctx);
    const Tensor value = s.slice(0, ops::kLossScale, ops::kLossScale + 1).view(loss.shape());
    return value.dtype() == loss.dtype() ? clone(ctx, value) : cast(ctx, value, loss.dtype());
  }

  // Checks the gradients this rank holds (all of them under ddp, its pieces under a sharded
  // stage) into found_inf, agreed over `comm`'s ranks (nullptr: one rank), and sets the inverse
  // scale the step unscales by. Collective.
  // `grads_ctx`: where the gradients are when not on ctx's device (CPU offload keeps them on
  // the host): they are checked there and the verdict goes up.
  void check_grads(Context& ctx, comm::Communicator* comm, const std::vector<Tensor>& grads,
                   Context* grads_ctx = nullptr) {
    const Tensor& s = state(ctx);
    ops::loss_scale_phase(ctx, ops::LossScaleFunctor::Phase::begin, rule(), s);
    const Tensor found = s.slice(0, ops::kLossFoundInf, ops::kLossFoundInf + 1);
    if (!grads.empty() && grads_ctx != nullptr && grads_ctx != &ctx) {
      const Tensor found_there = zeros(*grads_ctx, {1}, DType::f32, MemoryCategory::other);
      ops::check_finite(*grads_ctx, grads, found_there);
      copy(ctx, found, found_there);
    } else if (!grads.empty()) {
      ops::check_finite(ctx, grads, found);
    }
    if (comm != nullptr && comm->size() > 1)
      comm->all_reduce(found, comm::ReduceOp::max).wait_on_stream();
  }

  // After the step (taken or skipped): back off on an overflow, grow after growth_interval
  // finite steps in a row.
  void update(Context& ctx) {
    ops::loss_scale_phase(ctx, ops::LossScaleFunctor::Phase::update, rule(), state(ctx));
  }

  // The state on the device: f32 [4] (ops/step_gate.hpp's LossScaleSlot), created on `ctx`'s
  // device at the first use.
  const Tensor& state(Context& ctx) {
    if (!state_.defined()) {
      state_ = from_vector(ctx, host_, {ops::kLossScaleSlots}, MemoryCategory::other);
      ctx_ = &ctx;
    }
    check(ctx.device() == state_.device(), "loss scaler: its state is on ", state_.device(),
          " but this step runs on ", ctx.device(), "; use one scaler per device");
    return state_;
  }

  // Whether load() takes this state; throws naming the value otherwise (a checkpoint's load
  // asks before it writes anything).
  void check_loadable(double scale, std::int64_t growth_tracker) const {
    check(scale > 0 && std::isfinite(scale) && scale <= 3.0e38, "loss scaler: a saved scale of ",
          scale, " is not a positive finite f32 number");
    check(growth_tracker >= 0 && growth_tracker < options_.growth_interval,
          "loss scaler: a saved growth tracker of ", growth_tracker, " is outside [0, ",
          options_.growth_interval, ")");
  }
  // Resuming from a checkpoint.
  void load(double scale, std::int64_t growth_tracker) {
    check_loadable(scale, growth_tracker);
    host_ = initial_state(scale, growth_tracker);
    if (state_.defined()) copy(*ctx_, state_, from_vector(*ctx_, host_, {ops::kLossScaleSlots}));
  }

 private:
  static std::vector<float> initial_state(double scale, std::int64_t growth_tracker) {
    const auto s = static_cast<float>(scale);
    return {s, 1.0f / s, 0.0f, static_cast<float>(growth_tracker)};
  }
  ops::LossScaleRule rule() const {
    return {static_cast<float>(options_.growth_factor), static_cast<float>(options_.backoff_factor),
            static_cast<float>(options_.growth_interval)};
  }
  std::vector<float> values() const {
    return state_.defined() ? to_vector<float>(*ctx_, state_) : host_;
  }

  LossScalerOptions options_;
  std::vector<float> host_;  // the state before it moves to the device
  Tensor state_;             // f32 [4] on ctx_'s device, once a step used it
  Context* ctx_ = nullptr;
};

}  // namespace shardkit::optim
