// ShardedOptimizer: SGD, LARC-SGD, Adam or AdamW over the pieces of the flat parameter buffer
// that one rank updates, with optimizer state for those pieces only (MemoryCategory::
// optimizer_state). Under DDP the pieces are every parameter; under OSS/SDP the rank's range.
//
// LARC needs each parameter's whole norm. Pieces of one parameter are summed here, and when a
// parameter spans ranks (flat partition) one small all-reduce of per-parameter partial sums
// completes them, so LARC under every stage equals LARC under DDP.
#pragma once

#include <string_view>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/adam.hpp"
#include "shardkit/ops/fused_ops.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/op_args.hpp"
#include "shardkit/ops/sgd.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::optim {

enum class OptimizerKind { sgd, larc_sgd, adam, adamw };

inline std::string_view optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::sgd:
      return "sgd";
    case OptimizerKind::larc_sgd:
      return "larc_sgd";
    case OptimizerKind::adam:
      return "adam";
    case OptimizerKind::adamw:
      return "adamw";
  }
  return "?";
}

inline OptimizerKind parse_optimizer_kind(std::string_view name) {
  for (auto kind :
       {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adam, OptimizerKind::adamw})
    if (optimizer_kind_name(kind) == name) return kind;
  fail<InvalidArgument>("unknown optimizer '", name, "'; use sgd, larc_sgd, adam or adamw");
}

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  ops::SgdOptions sgd;    // sgd, larc_sgd (lr is set per step)
  ops::LarcOptions larc;  // larc_sgd: takes sgd.weight_decay over
  ops::AdamOptions adam;  // adam, adamw
};

template <class Backend>
class ShardedOptimizer {
 public:
  // `pieces` lie inside flat-buffer elements [region_begin, region_begin + region_numel); the
  // state covers that region. `norm_comm` completes LARC norms of parameters spanning ranks
  // (nullptr when every parameter is whole here).
  ShardedOptimizer(Context& ctx, const shard::ShardPlan& plan,
                   std::vector<shard::ParamPiece> pieces, std::int64_t region_begin,
                   std::int64_t region_numel, OptimizerConfig config, comm::Communicator* norm_comm)
      : ctx_(&ctx),
        plan_(&plan),
        pieces_(std::move(pieces)),
        region_begin_(region_begin),
        config_(config),
        norm_comm_(norm_comm) {
    if (config_.kind == OptimizerKind::larc_sgd) {
      // LARC takes the weight decay over (docs/semantics.md): the wrapped SGD runs without it.
      if (config_.larc.weight_decay == 0) config_.larc.weight_decay = config_.sgd.weight_decay;
      config_.sgd.weight_decay = 0;
      ops::validate(config_.larc);
    }
    if (config_.kind == OptimizerKind::adamw) config_.adam.decoupled_weight_decay = true;
    const bool two_states =
        config_.kind == OptimizerKind::adam || config_.kind == OptimizerKind::adamw;
    const bool one_state = !two_states && config_.sgd.momentum != 0;
    if (one_state || two_states)
      state_a_ = zeros(ctx, {region_numel}, DType::f32, MemoryCategory::optimizer_state);
    if (two_states)
      state_b_ = zeros(ctx, {region_numel}, DType::f32, MemoryCategory::optimizer_state);
  }

  // One step. `params` is the whole flat parameter buffer; `grads` holds one gradient view per
  // piece, in pieces() order. `lr` overrides the configured rate (schedules); `inv_grad_scale`
  // unscales loss-scaled gradients.
  void step(const Tensor& params, const std::vector<Tensor>& grads, float lr,
            float inv_grad_scale = 1.0f) {
    check(grads.size() == pieces_.size(), "ShardedOptimizer::step: ", grads.size(),
          " gradients for ", pieces_.size(), " pieces; pass one per piece, in pieces() order");
    std::vector<Tensor> p, a, b;
    const std::vector<Tensor>& g = grads;
    for (const auto& piece : pieces_) {
      p.push_back(params.slice(0, piece.flat_begin, piece.flat_begin + piece.numel()));
      const std::int64_t at = piece.flat_begin - region_begin_;
      if (state_a_.defined()) a.push_back(state_a_.slice(0, at, at + piece.numel()));
      if (state_b_.defined()) b.push_back(state_b_.slice(0, at, at + piece.numel()));
    }
    ++steps_;
    if (pieces_.empty()) {  // more ranks than parameters: nothing to update here, but the
      if (config_.kind == OptimizerKind::larc_sgd && norm_comm_ != nullptr)  // norm all-reduce
        (void)larc_coefficients(p, g, lr, inv_grad_scale);                   // is collective
      return;
    }
    switch (config_.kind) {
      case OptimizerKind::sgd: {
        ops::SgdOptions o = config_.sgd;
        o.lr = lr;
        o.first_step = steps_ == 1;
        o.inv_grad_scale = inv_grad_scale;
        ops::sgd_step<Backend>(*ctx_, o, ops::SgdTensors{p, g, a, {}});
        break;
      }
      case OptimizerKind::larc_sgd: {
        ops::SgdOptions o = config_.sgd;
        o.lr = lr;
        o.first_step = steps_ == 1;
        const Tensor coefficients = larc_coefficients(p, g, lr, inv_grad_scale);
        ops::sgd_step<Backend>(*ctx_, o, ops::SgdTensors{p, g, a, {}}, coefficients);
        break;
      }
      case OptimizerKind::adam:
      case OptimizerKind::adamw: {
        ops::AdamOptions o = config_.adam;
        o.lr = lr;
        o.step = steps_;
        o.inv_grad_scale = inv_grad_scale;
        ops::adam_step<Backend>(*ctx_, o, ops::AdamTensors{p, g, a, b, {}});
        break;
      }
    }
  }

  std::int64_t steps() const { return steps_; }
  // Resuming from a checkpoint: the step count drives SGD's first-step rule and Adam's bias
  // correction, so it travels with the state (OptimizerState::steps).
  void set_steps(std::int64_t steps) {
    check(steps >= 0, "ShardedOptimizer::set_steps: steps must be >= 0, got ", steps);
    steps_ = steps;
  }
  std::int64_t region_begin() const { return region_begin_; }
  const OptimizerConfig& config() const { return config_; }
  const std::vector<shard::ParamPiece>& pieces() const { return pieces_; }
  // Momentum (SGD) or exp_avg (Adam) over the region; undefined without state. The handles
  // share the storage: DataParallel::load_optimizer_state() writes through them.
  const Tensor& state_a() const { return state_a_; }
  const Tensor& state_b() const { return state_b_; }

 private:
  // Per-piece [n, 2] coefficients from whole-parameter sums of squares.
  Tensor larc_coefficients(const std::vector<Tensor>& p, const std::vector<Tensor>& g, float lr,
                           float inv_grad_scale) {
    const auto n = static_cast<std::int64_t>(pieces_.size());
    std::vector<double> piece_values(static_cast<std::size_t>(2 * n), 0.0);
    if (n > 0) {
      const Tensor piece_sums = empty(*ctx_, {2, n}, DType::f64, MemoryCategory::other);
      ops::segment_sums_of_squares<Backend>(*ctx_, p, g, piece_sums);
      piece_values = to_vector<double>(*ctx_, piece_sums);
    }
    // Add the pieces of each parameter, then (if needed) over ranks, on the host: 2 x P values.
    const std::size_t count = plan_->layout().size();
    std::vector<double> whole(2 * count, 0.0);
    for (std::size_t s = 0; s < pieces_.size(); ++s) {
      whole[pieces_[s].param] += piece_values[s];
      whole[count + pieces_[s].param] += piece_values[static_cast<std::size_t>(n) + s];
    }
    if (norm_comm_ != nullptr) {
      Tensor on_device = from_vector(*ctx_, whole, {static_cast<std::int64_t>(2 * count)});
      norm_comm_->all_reduce(on_device, comm::ReduceOp::sum).wait();
      whole = to_vector<double>(*ctx_, on_device);
    }
    if (n == 0) return Tensor();
    std::vector<double> per_piece(static_cast<std::size_t>(2 * n));
    for (std::size_t s = 0; s < pieces_.size(); ++s) {
      per_piece[s] = whole[pieces_[s].param];
      per_piece[static_cast<std::size_t>(n) + s] = whole[count + pieces_[s].param];
    }
    const Tensor sums = from_vector(*ctx_, per_piece, {2, n});
    const Tensor coefficients = empty(*ctx_, {n, 2}, DType::f32, MemoryCategory::other);
    ops::larc_coefficients<Backend>(*ctx_, config_.larc, lr, inv_grad_scale, sums, coefficients);
    return coefficients;
  }

  Context* ctx_;
  const shard::ShardPlan* plan_;
  std::vector<shard::ParamPiece> pieces_;
  std::int64_t region_begin_;
  OptimizerConfig config_;
  comm::Communicator* norm_comm_;
  Tensor state_a_, state_b_;
  std::int64_t steps_ = 0;
};

}  // namespace shardkit::optim
