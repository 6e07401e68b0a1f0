// DynamicLossScaler: dynamic loss scaling for f16 training, with the semantics and defaults of
// torch.cuda.amp.GradScaler and FairScale's ShardedGradScaler (docs/semantics.md):
//
//   the loss is multiplied by scale() before the backward (autograd::backward(ctx, loss,
//   scale)); after it, grads_finite() checks the gradients each rank holds -- its pieces under
//   a sharded stage -- and one max all-reduce of the found-inf flag makes every rank agree, so
//   every rank skips the same steps; the engines' step(lr, scaler) then either steps with the
//   gradients unscaled by 1 / scale() inside the fused optimizer pass, or skips the step
//   entirely (parameters, optimizer state and step count untouched); update() halves the
//   scale after an overflow and doubles it after growth_interval finite steps in a row.
//
// The state (scale, growth tracker) is what checkpoints keep (TrainingState::scaler).
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
    check(options.init_scale > 0 && std::isfinite(options.init_scale),
          "loss scaler: init_scale must be a positive finite number, got ", options.init_scale);
    check(options.growth_factor > 1, "loss scaler: growth_factor must be > 1, got ",
          options.growth_factor);
    check(options.backoff_factor > 0 && options.backoff_factor < 1,
          "loss scaler: backoff_factor must be in (0, 1), got ", options.backoff_factor);
    check(options.growth_interval >= 1, "loss scaler: growth_interval must be >= 1, got ",
          options.growth_interval);
    scale_ = options.init_scale;
  }

  double scale() const { return scale_; }
  float inv_scale() const { return static_cast<float>(1.0 / scale_); }
  // Finite steps in a row since the last change of scale.
  std::int64_t growth_tracker() const { return growth_tracker_; }
  const LossScalerOptions& options() const { return options_; }

  // Whether the gradients are finite on every rank. `grads` are the gradients this rank holds
  // (all of them under ddp, its pieces under a sharded stage); `comm` joins the ranks
  // (nullptr: one rank). Collective.
  bool grads_finite(Context& ctx, comm::Communicator* comm, const std::vector<Tensor>& grads) {
    Tensor found = zeros(ctx, {1}, DType::f32, MemoryCategory::other);
    if (!grads.empty()) ops::check_finite(ctx, grads, found);
    if (comm != nullptr && comm->size() > 1)
      comm->all_reduce(found, comm::ReduceOp::max).wait_on_stream();
    return to_vector<float>(ctx, found)[0] == 0.0f;
  }

  // After each step (taken or skipped): back off on an overflow, grow after growth_interval
  // finite steps in a row.
  void update(bool found_inf) {
    if (found_inf) {
      scale_ *= options_.backoff_factor;
      growth_tracker_ = 0;
      return;
    }
    if (++growth_tracker_ == options_.growth_interval) {
      scale_ *= options_.growth_factor;
      growth_tracker_ = 0;
    }
  }

  // Resuming from a checkpoint.
  void load(double scale, std::int64_t growth_tracker) {
    check(scale > 0 && std::isfinite(scale), "loss scaler: a saved scale of ", scale,
          " is not a positive finite number");
    check(growth_tracker >= 0 && growth_tracker < options_.growth_interval,
          "loss scaler: a saved growth tracker of ", growth_tracker, " is outside [0, ",
          options_.growth_interval, ")");
    scale_ = scale;
    growth_tracker_ = growth_tracker;
  }

 private:
  LossScalerOptions options_;
  double scale_ = 65536.0;
  std::int64_t growth_tracker_ = 0;
};

}  // namespace shardkit::optim
