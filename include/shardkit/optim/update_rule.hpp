// UpdateRule: the algorithm of the sharded optimizer -- SGD (with per-parameter weight decay
// groups), LARC-SGD (trust ratios from whole-parameter norms, ParamNorms) or Adam / AdamW --
// applied to the pieces one rank updates through the fused ops, on whichever context holds them
// (the parameters', or the offload host's). Where the masters live and how updates reach the
// parameters is MasterCopies'; what crosses to the host and back, OffloadTransport's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardkit/ops/device_ops.hpp"
#include "shardkit/optim/optimizer_config.hpp"
#include "shardkit/optim/param_norms.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

// The operands of one update: per piece, the f32 values (p), gradients (g), state buffers
// (a: momentum or exp_avg; b: exp_avg_sq) and rounded outputs (low), each list empty when unused.
struct UpdateTensors {
  const std::vector<Tensor>& p;
  const std::vector<Tensor>& g;
  const std::vector<Tensor>& a;
  const std::vector<Tensor>& b;
  const std::vector<Tensor>& low;
};

class UpdateRule {
 public:
  UpdateRule(OptimizerConfig config, const shard::PieceTable& table, int rank, ParamNorms& norms)
      : config_(std::move(config)), table_(&table), rank_(rank), norms_(&norms) {
    check_whole_config();
    if (config_.kind == OptimizerKind::larc_sgd) {
      // LARC takes the weight decay over (docs/semantics.md): the wrapped SGD runs without it.
      ops::validate(config_.sgd);  // (before its decay is moved: a negative one is named)
      if (config_.larc.weight_decay == 0) config_.larc.weight_decay = config_.sgd.weight_decay;
      config_.sgd.weight_decay = 0;
      ops::validate(config_.larc);
    }
    if (config_.kind == OptimizerKind::adamw) config_.adam.decoupled_weight_decay = true;
    // The rule's own options are refused here, on every rank -- not at the first step, and
    // only on the ranks holding pieces (one holding none would go on into the step's
    // collectives while the others threw).
    if (config_.kind == OptimizerKind::sgd || config_.kind == OptimizerKind::larc_sgd) {
      ops::validate(config_.sgd);
    } else {
      ops::AdamOptions adam = config_.adam;
      adam.step = 1;  // (set at each step)
      ops::validate(adam);
    }
    set_decay_groups();
  }

  const OptimizerConfig& config() const { return config_; }

  // What a step's chunks share: the options at this step's rate and count, and the per-piece
  // coefficients of the SGD rule (LARC's trust ratios need every norm first, unless each chunk
  // can form its own: `larc_in_pass`). `done` when there is nothing to update here.
  struct Prepared {
    ops::SgdOptions sgd;
    ops::AdamOptions adam;
    Tensor coefficients;  // [n, 2] per-piece (grad, param) factors, or none
    // LARC in one pass per chunk: each piece's norms, coefficients and update together
    // (ops::larc_sgd_step_tree), with `decays` per piece when no_weight_decay names any.
    bool larc_in_pass = false;
    std::vector<double> decays;
    bool done = false;
  };
  // Whether LARC's chunks will each form their own norms (Prepared::larc_in_pass, below).
  bool larc_in_pass(const Context& c, const Tensor& gate) const {
    return config_.kind == OptimizerKind::larc_sgd && !gate.defined() && norms_->pieces_whole() &&
           ops::has_larc_sgd_step_tree(c);
  }

  // `gate`: the step gate (ops/step_gate.hpp) the passes read, or none.
  Prepared prepare(Context& c, const UpdateTensors& t, float lr, float inv_grad_scale,
                   std::int64_t step, const Tensor& gate = Tensor()) {
    const auto& pieces = table_->pieces(rank_);
    Prepared out;
    if (pieces.empty()) {  // more ranks than parameters: nothing to update here, but the
      if (config_.kind == OptimizerKind::larc_sgd)  // norms' exchange may be collective
        (void)larc_coefficients(c, t, lr, inv_grad_scale, gate);
      out.done = true;
      return out;
    }
    out.sgd = config_.sgd;
    out.sgd.lr = lr;
    out.sgd.first_step = step == 1;
    out.adam = config_.adam;
    out.adam.lr = lr;
    out.adam.step = step;
    out.adam.inv_grad_scale = inv_grad_scale;
    out.sgd.gate = gate;
    out.adam.gate = gate;
    // Every piece whole here (DDP, or one rank) on a device that pipelines it (the CPU): each
    // piece's norms need only the piece, so every chunk forms its own in the pass that updates
    // it, with ParamNorms' bits -- the state is read once, and a chunk streamed from disk needs
    // no other chunk in RAM. (Not gated: the pass would need the gate's factor before its norms;
    // the composed path below reads it.)
    if (larc_in_pass(c, gate)) {
      out.larc_in_pass = true;
      out.sgd.inv_grad_scale = inv_grad_scale;
      if (!decay_.empty())
        for (const auto& piece : pieces) out.decays.push_back(decay_[piece.param]);
      return out;
    }
    if (config_.kind == OptimizerKind::larc_sgd) {
      out.coefficients = larc_coefficients(c, t, lr, inv_grad_scale, gate);
      // The coefficients now hold the gate's factor: the pass must not apply it again. (The
      // optimizer sets the factor afresh before every gated step.)
      if (gate.defined())
        fill(c, gate.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1), 1.0);
    } else if (config_.kind == OptimizerKind::sgd && !decay_.empty()) {
      std::vector<float> factors;  // per-parameter decay: g' = inv_grad_scale·g + decay·w
      for (const auto& piece : pieces) {
        factors.push_back(inv_grad_scale);
        factors.push_back(static_cast<float>(decay_[piece.param]));
      }
      out.sgd.weight_decay = 0;
      out.coefficients = from_vector(c, factors, {static_cast<std::int64_t>(pieces.size()), 2});
    } else {
      out.sgd.inv_grad_scale = inv_grad_scale;
    }
    return out;
  }

  // The fused update of pieces [begin, end).
  void apply(Context& c, const Prepared& step, const UpdateTensors& t, std::size_t begin,
             std::size_t end) const {
    const auto part = [&](const std::vector<Tensor>& v) {
      return v.empty() ? v
                       : std::vector<Tensor>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                                             v.begin() + static_cast<std::ptrdiff_t>(end));
    };
    if (step.larc_in_pass) {
      const auto decays = std::span<const double>(step.decays);
      return ops::larc_sgd_step_tree(c, step.sgd, config_.larc,
                                     ops::SgdTensors{part(t.p), part(t.g), part(t.a), part(t.low)},
                                     decays.empty() ? decays : decays.subspan(begin, end - begin));
    }
    if (is_adam(config_.kind))
      return ops::adam_step(
          c, step.adam, ops::AdamTensors{part(t.p), part(t.g), part(t.a), part(t.b), part(t.low)});
    // (The operand lists are temporaries: each call builds its tensors' spans in place.)
    if (!step.coefficients.defined())
      return ops::sgd_step(c, step.sgd,
                           ops::SgdTensors{part(t.p), part(t.g), part(t.a), part(t.low)});
    ops::sgd_step(c, step.sgd, ops::SgdTensors{part(t.p), part(t.g), part(t.a), part(t.low)},
                  step.coefficients.slice(0, static_cast<std::int64_t>(begin),
                                          static_cast<std::int64_t>(end)));
  }

 private:
  // What no rule's validate can see: fields of one rule that another one's take over or that
  // the optimizer sets at each step.
  void check_whole_config() const {
    const float lr = is_adam(config_.kind) ? config_.adam.lr : config_.sgd.lr;
    check(std::isfinite(lr), "OptimizerConfig: the ", optimizer_kind_name(config_.kind), " lr is ",
          lr, "; give a finite rate (the first step would take it)");
    check(config_.kind != OptimizerKind::adam || !config_.adam.decoupled_weight_decay,
          "OptimizerConfig: kind adam with adam.decoupled_weight_decay set is AdamW; set kind "
          "adamw (its state and checkpoints are named by the kind)");
    check(config_.kind != OptimizerKind::larc_sgd || config_.larc.weight_decay == 0 ||
              config_.sgd.weight_decay == 0 ||
              config_.larc.weight_decay == config_.sgd.weight_decay,
          "OptimizerConfig: larc.weight_decay ", config_.larc.weight_decay,
          " and sgd.weight_decay ", config_.sgd.weight_decay,
          " are both set; LARC takes one decay over from the SGD it wraps: set one of them");
    check(config_.sgd.first_step && config_.sgd.inv_grad_scale == 1.0f &&
              !config_.sgd.gate.defined() && config_.adam.step == 1 &&
              config_.adam.inv_grad_scale == 1.0f && !config_.adam.gate.defined(),
          "OptimizerConfig: sgd.first_step, sgd.inv_grad_scale, sgd.gate, adam.step, "
          "adam.inv_grad_scale and adam.gate are the optimizer's own, set at each step; leave "
          "them at their defaults (unscale gradients with step_unscaling_by or a loss scaler)");
  }

  // Per-piece [n, 2] coefficients from whole-parameter sums of squares, formed on context `c`
  // (where p and g live) without the host: the sums land in rows 0 and 1 of sums_, whose row 2
  // holds the per-parameter decays (uploaded once). `gate`: its factor is read on the device.
  Tensor larc_coefficients(Context& c, const UpdateTensors& t, float lr, float inv_grad_scale,
                           const Tensor& gate) {
    const auto& pieces = table_->pieces(rank_);
    const auto n = static_cast<std::int64_t>(pieces.size());
    if (!sums_.defined() || sums_.device() != c.device()) {
      const std::int64_t rows = decay_.empty() ? 2 : 3;  // row 2: per-parameter decays
      sums_ = empty(c, {rows, n}, DType::f64, MemoryCategory::other);
      if (rows == 3) {
        std::vector<double> decays;
        for (const auto& piece : pieces) decays.push_back(decay_[piece.param]);
        copy(c, sums_.select(0, 2), from_vector(c, decays, {n}));
      }
    }
    norms_->roots(c, {t.p, t.g}, ParamNorms::Layout::pieces,
                  sums_.slice(0, 0, 2));  // collective when split
    if (n == 0) return Tensor();
    const Tensor coefficients = empty(c, {n, 2}, DType::f32, MemoryCategory::other);
    ops::larc_coefficients(c, config_.larc, lr, inv_grad_scale, sums_, coefficients, gate);
    return coefficients;
  }

  // decay_[p]: table parameter p's weight decay, when config_.no_weight_decay names any.
  void set_decay_groups() {
    if (config_.no_weight_decay.empty()) return;
    check(!is_adam(config_.kind), "ShardedOptimizer: no_weight_decay names ",
          config_.no_weight_decay.size(), " parameters, but per-parameter weight decay is ",
          "implemented for sgd and larc_sgd only, not ", optimizer_kind_name(config_.kind),
          "; leave no_weight_decay empty");
    const double decay = config_.kind == OptimizerKind::larc_sgd ? config_.larc.weight_decay
                                                                 : config_.sgd.weight_decay;
    const auto& params = table_->params();
    decay_.assign(params.size(), decay);
    for (const auto& name : config_.no_weight_decay) {
      auto it = std::find_if(params.begin(), params.end(),
                             [&](const auto& param) { return param.name == name; });
      if (it == params.end()) {
        std::string known;
        for (const auto& param : params) known += (known.empty() ? "" : ", ") + param.name;
        fail<InvalidArgument>("ShardedOptimizer: no_weight_decay names '", name,
                              "', which is not a trainable parameter; trainable ones: ", known);
      }
      decay_[static_cast<std::size_t>(it - params.begin())] = 0.0;
    }
  }

  OptimizerConfig config_;
  const shard::PieceTable* table_;
  int rank_;
  ParamNorms* norms_;
  std::vector<double> decay_;  // per table parameter; empty: one decay for all
  Tensor sums_;                // LARC's [2 or 3, n] sums (larc_coefficients), kept
};

}  // namespace shardkit::optim
