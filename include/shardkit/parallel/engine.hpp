// Engine: the one engine under every stage -- its param groups (param_groups.hpp: one for ddp,
// oss and sdp, one per unit for fsdp) and one sharded optimizer over the pieces this rank
// updates of all of them. What a training step needs is written here once:
//
//   backward   grad(i) / ready(i) (ParamGroups): a group's complete buckets are reduced as the
//              backward goes; finish() waits for the rest
//   step(lr)   the fused optimizer update of every piece, the post-step hooks on this rank's
//              pieces, then (oss, sdp) the owners' ranges all-gathered; fsdp gathers nothing
//              here, the next use gathers the new values
//   and        step(lr, scaler), clip_grad_norm, no_sync, set_full_params, full_params,
//              training_state, optimizer-state consolidation
//
// Custom loops construct it as DataParallel or FsdpEngine; ShardedModule drives it from module
// hooks. What every engine offers: the concept TrainingEngine (engine_contract.hpp).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/optim/consolidation.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/param_groups.hpp"
#include "shardkit/parallel/training_state.hpp"

namespace shardkit::parallel {

class Engine : public ParamGroups {
 public:
  // Called after every applied step, on the pieces this rank updated, before the owners'
  // ranges are gathered (torch.optim's register_step_post_hook, where a change to this rank's
  // pieces costs no extra collective): param_rows.hpp's normalize_rows_after_step is one.
  using StepHook = std::function<void(Engine&)>;

  Engine(Context& ctx, comm::Communicator& comm, comm::Communicator* replicas,
         std::vector<ParamGroupSpec> groups, optim::OptimizerConfig optimizer,
         ResolvedPolicy policy)
      : ParamGroups(ctx, comm, replicas, std::move(groups), std::move(policy)),
        ctx_(&ctx),
        comm_(&comm),
        replicas_(replicas),
        table_(comm.size(), this->policy().every_rank_updates) {
    std::vector<Tensor> piece_params;
    for (std::size_t u = 0; u < unit_count(); ++u) {
      first_piece_.push_back(piece_grads_.size());
      table_.append_plan(group(u).plan(), this->policy().every_rank_updates);
      const auto& views = group(u).piece_params();
      piece_params.insert(piece_params.end(), views.begin(), views.end());
      const auto& grads = group(u).piece_grads();
      piece_grads_.insert(piece_grads_.end(), grads.begin(), grads.end());
    }
    optimizer_ = std::make_unique<optim::ShardedOptimizer>(
        ctx, table_, comm.rank(), std::move(piece_params), std::move(optimizer), &comm,
        optim::OptimizerOffload{host(), this->policy().offload.params, disk(),
                                this->policy().offload.chunk_numel, &grads_context() == host(),
                                shards_on_disk()});
    check_same_everywhere();
  }

  // Sets every parameter from exact f32 values: fill(i, view) writes parameter i (an f32 view)
  // on every rank, then rank `root`'s values hold everywhere -- the f32 masters exactly, the
  // compute copy rounded under mixed precision; a sharded group is whole only meanwhile, one at
  // a time. Collective.
  template <class Fill>
  void set_full_params(Fill&& fill, int root = 0) {
    set_params(
        fill, [](std::size_t, std::int64_t, const Tensor&) {}, [](std::size_t) { return false; },
        root);
  }

  // As set_full_params, except that a unit whose every parameter i is `makeable(i)` -- every
  // rank can make rank root's values of it itself (its recipe, parallel/root_recipes.hpp) -- is
  // made where it is kept: make(i, first, view) writes elements [first, first + view.numel())
  // of parameter i into an f32 view, with no collective, and a sharded unit is never whole
  // (set_kept_from_f32). `makeable` must answer alike on every rank.
  template <class Fill, class Make, class Makeable>
  void set_params(Fill&& fill, Make&& make, Makeable&& makeable, int root = 0) {
    shards_will_change();
    for (std::size_t u = 0; u < unit_count(); ++u) {
      ParamGroup& group = mutable_group(u);
      const std::size_t first = first_param(u);
      const std::size_t count = group.flat().plan().layout().size();
      bool local = true;
      for (std::size_t i = first; i < first + count; ++i) local = local && makeable(i);
      auto master = [&](std::size_t k, const Tensor& values) {
        if (optimizer_->separate_master()) optimizer_->set_master(first_piece_[u] + k, values);
      };
      if (local) {
        set_kept_from_f32(
            group.flat(),
            [&](std::size_t i, std::int64_t from, const Tensor& view) {
              make(first + i, from, view);
            },
            master, group.pieces());
        group.release();  // (a gathered buffer would now be stale)
        continue;
      }
      if (group.flat().sharded()) group.flat().materialize();
      set_from_f32(
          group.flat(), [&](std::size_t i, const Tensor& view) { fill(first + i, view); }, master,
          group.pieces(), root);
      group.release();
    }
    optimizer_->spill_state();  // (offload to NVMe: the masters' first values out of RAM)
  }

  // Makes every rank's parameters equal to `root`'s (after each rank initialised its own).
  // Under mixed precision the masters then take the compute copy's (rounded) values: use
  // set_full_params for exact ones. ddp, oss, sdp. Collective.
  void broadcast_parameters(int root = 0) {
    for (std::size_t u = 0; u < unit_count(); ++u) {
      FlatParam& flat = mutable_group(u).flat();
      check<StateError>(!flat.sharded(),
                        "broadcast_parameters: fsdp keeps shards only; set the "
                        "parameters with set_full_params");
      broadcast_from(flat, flat.params().flat(), root);
    }
    optimizer_->copy_params_to_masters();
    optimizer_->spill_state();
  }

  // Every unit gathered while the scope lives (FSDP's summon_full_params), to read or write
  // parameters between steps; values written go back to the shards when it ends (f32 only:
  // under mixed precision set values with set_full_params).
  class FullParams {
   public:
    explicit FullParams(Engine& engine) : engine_(&engine) {
      for (std::size_t u = 0; u < engine_->unit_count(); ++u) engine_->gather_exact(u);
    }
    ~FullParams() {
      const bool writeback = !engine_->optimizer_->mixed_precision();
      if (writeback) engine_->shards_will_change();
      for (std::size_t u = 0; u < engine_->unit_count(); ++u) {
        FlatParam& flat = engine_->mutable_group(u).flat();
        if (writeback && flat.sharded()) flat.copy_range_to_shard();
        engine_->release(u);
      }
      if (!writeback) return;
      engine_->optimizer_->copy_params_to_masters();  // (offload's f32 master)
      try {
        engine_->optimizer_->spill_state();  // (offload to NVMe: out of RAM again)
      } catch (...) {  // (a destructor: the next step's spill reports a failing disk)
      }
    }
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    Engine* engine_;
  };
  [[nodiscard]] FullParams full_params() { return FullParams(*this); }

  // --- the step --------------------------------------------------------------------------------
  // Gradients from zero for the next backward, and a clip_grad_norm of the old ones forgotten.
  // Under offload to NVMe it also makes sure of the
  // step's first chunk of the master and state, beside the forward and backward: the chunk the
  // last step kept in RAM, what the kernel reclaimed of it read back, or read whole after a
  // drop (ShardedOptimizer::prefetch_state).
  void zero_grad() {
    ParamGroups::zero_grad();
    optimizer_->discard_clip();  // (a clip of the gradients zeroed here: PyTorch's go with them)
    optimizer_->prefetch_state();
  }
  // The learning rate of the next steps (schedules live in the training loop): a step
  // captured by a StepGraph (core/step_graph.hpp) reads it on the device, so a loop that
  // captures sets it before each run, outside the step, and calls step() inside.
  void set_lr(float lr) { optimizer_->set_lr(lr); }
  // Updates the parameters with the averaged gradients of the synchronised backwards since
  // zero_grad(), at the rate set_lr() set.
  void step() { step_unscaling_by(1.0f); }
  // set_lr(lr), then the step; `inv_grad_scale` unscales gradients scaled by hand.
  void step(float lr, float inv_grad_scale = 1.0f) {
    set_lr(lr);
    step_unscaling_by(inv_grad_scale);
  }

  // The loss-scaled step (optim/loss_scaler.hpp), queued on the device without a host wait
  // where the optimizer allows (SGD, Adam, AdamW without offload): the scaler checks every
  // rank's gradients, the fused pass unscales them or -- after an overflow on some rank -- is
  // skipped on every rank (nothing changes but the scale), and the scale follows. The owners'
  // gathers run either way (over unchanged values they change nothing). Post-step hooks run
  // after applied steps only: they are host work, so with any registered the host reads the
  // verdict (one read). scaler.found_inf() says afterwards whether the step was skipped.
  // Collective.
  void step(optim::DynamicLossScaler& scaler) {
    check_finished("optimizer step");
    scaler.check_grads(*ctx_, comm_, piece_grads_, &grads_context());
    shards_will_change();
    optimizer_->step(piece_grads_, scaler);
    const bool needs_verdict = std::any_of(post_step_hooks_.begin(), post_step_hooks_.end(),
                                           [](const PostStepHook& h) { return !h.gated; });
    const std::exception_ptr hook_error = after_update(!needs_verdict || !scaler.found_inf());
    scaler.update(*ctx_);
    // qgZ's error feedback is in the scaled units: it follows the new scale, and a skipped
    // step's residuals (which may hold an inf) are dropped.
    follow_loss_scale(scaler.state(*ctx_));
    if (hook_error) std::rethrow_exception(hook_error);
  }
  void step(float lr, optim::DynamicLossScaler& scaler) {
    set_lr(lr);
    step(scaler);
  }

  // torch.nn.utils.clip_grad_norm_ after the backward: the gradients' global L2 norm (exact,
  // the same bits under every stage) is returned as f64 [1] on the device, as PyTorch returns a
  // tensor (read it to log it: nothing else waits), and the next step() scales them by
  // max_norm / (norm + 1e-6) when that is below 1. With a loss scaler, pass its inv_scale():
  // the norm is of the unscaled gradients. Collective.
  Tensor clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    check_finished("clip_grad_norm");
    clip_measured_ = finished_backwards();
    return optimizer_->clip_grad_norm(piece_grads_, max_norm, inv_grad_scale);
  }

  // `hook` runs after each applied step (after a loss-scaled step the host reads the verdict for
  // it). A `gated` hook runs after every step and leaves a skipped one alone by itself, on the
  // device (it reads the optimizer's step gate: normalize_rows_after_step's), so no verdict is
  // read for it -- a loss-scaled step with only gated hooks can be captured.
  void register_post_step_hook(StepHook hook, bool gated = false) {
    post_step_hooks_.push_back({std::move(hook), gated});
  }

  // --- state -----------------------------------------------------------------------------------
  Context& context() const { return *ctx_; }
  // The ranks this engine shards over (the shard group under hybrid sharding).
  comm::Communicator& communicator() const { return *comm_; }
  // Hybrid sharding's other groups (nullptr without hybrid sharding).
  comm::Communicator* replicas() const { return replicas_; }
  const shard::PieceTable& table() const { return table_; }
  optim::ShardedOptimizer& optimizer() { return *optimizer_; }
  const optim::ShardedOptimizer& optimizer() const { return *optimizer_; }
  // After finish(): the averaged gradient of each piece this rank updates (optimizer order), in
  // grads_context()'s memory (the host's under offload with sdp or fsdp).
  const std::vector<Tensor>& piece_grads() const { return piece_grads_; }
  // Offload: the host context of the optimizer's state and step (its memory statistics are the
  // host's share); without offload, the engine's own context.
  Context& host_context() const { return optimizer_->host_context(); }

  // What checkpoints save and load (checkpoint/training_checkpoint.hpp): the optimizer's pieces
  // and state, frozen parameters (whole on every rank), and how the ranks agree again after a
  // load has written their pieces (oss, sdp: the owners' ranges all-gathered; fsdp: units
  // gathered at that moment are gathered again).
  TrainingState training_state() {
    TrainingState state;
    state.optimizer = optimizer_.get();
    state.comm = comm_;
    state.replicas = replicas_;
    for (std::size_t u = 0; u < unit_count(); ++u) {
      const auto& layout = group(u).plan().layout();
      for (std::size_t i = 0; i < layout.size(); ++i)
        if (!layout[i].trainable) state.replicated.emplace_back(layout[i].name, group(u).param(i));
    }
    // A loaded run resumes as a new process would: qgZ's residuals of the replaced trajectory
    // are not carried into it (nor are they saved).
    state.forget_trajectory = [this] { reset_error_feedback(); };
    state.after_load = [this] {
      shards_will_change();
      for (std::size_t u = 0; u < unit_count(); ++u) {
        FlatParam& flat = mutable_group(u).flat();
        if (policy().gather_after_step) all_gather_owned(flat, false);
        if (flat.sharded() && flat.gathered()) start_all_gather(flat).wait();
      }
    };
    state.stage = std::string(stage_name(policy().stage));
    return state;
  }
  // The whole optimizer state on `recipient`, an empty OptimizerState on the other ranks
  // (FairScale's consolidate_state_dict; optim/consolidation.hpp). Collective.
  optim::OptimizerState consolidate_optimizer_state(int recipient = 0) {
    return optim::consolidate_optimizer_state(*optimizer_, *comm_, recipient);
  }
  // Takes this rank's share of a whole optimizer state (from consolidate_optimizer_state, on any
  // stage, partition or world size); parameters are matched by name.
  void load_optimizer_state(const optim::OptimizerState& state) {
    optim::load_optimizer_state(*optimizer_, state);
  }

 private:
  void step_unscaling_by(float inv_grad_scale) {
    check_finished("optimizer step");
    shards_will_change();
    optimizer_->step_unscaling_by(piece_grads_, inv_grad_scale);
    if (const std::exception_ptr hook_error = after_update(true))
      std::rethrow_exception(hook_error);
  }

  // After the fused update: the post-step hooks on this rank's pieces (after an applied step),
  // then (oss, sdp) the owners' ranges all-gathered, and (fsdp) units still gathered released.
  // A hook's error is returned for the caller to throw once the step's bookkeeping is done:
  // thrown here, it would leave the replicas out of step (each rank's own range new, the others
  // old) and a peer waiting in the gather.
  [[nodiscard]] std::exception_ptr after_update(bool applied) {
    std::exception_ptr hook_error;
    try {
      for (auto& hook : post_step_hooks_)
        if (applied || hook.gated) hook.run(*this);
    } catch (...) {
      hook_error = std::current_exception();
    }
    if (policy().gather_after_step)
      for (std::size_t u = 0; u < unit_count(); ++u)
        all_gather_owned(mutable_group(u).flat(), policy().broadcast_fp16);
    // A unit still gathered (a forward without its backward, with grad mode on, or with
    // reshard_after_forward off) holds the values from before the step: freed, the next use
    // gathers the new ones -- kept, the next forward would compute with the old, and a
    // full_params() scope write them back over the step.
    for (std::size_t u = 0; u < unit_count(); ++u)
      if (group(u).flat().sharded() && holds_full(u)) release(u);
    return hook_error;
  }

  void check_finished(const char* what) const {
    // (a sharded accumulation's second backward cut short would otherwise leave the first's
    // averages with some of its buckets added in, and look finished)
    if (backward_open())
      fail<StateError>(what,
                       " while a backward is open: it has not finished, or an exception cut it "
                       "short and its gradients are partial; call zero_grad() and run the "
                       "backward again");
    for (std::size_t u = 0; u < unit_count(); ++u)
      if (!group(u).finished())
        fail<StateError>(what, " before the gradients are finished",
                         unit_count() > 1 ? " (unit '" + unit_name(u) + "')" : std::string(),
                         ": run the (synchronised, outside no_sync) backward, then finish()");
    // (PyTorch clips the gradients there and then: a backward after it adds unclipped ones,
    // which a coefficient applied at the step would scale too)
    if (optimizer_->clip_pending() && clip_measured_ != finished_backwards())
      fail<StateError>(what,
                       " after clip_grad_norm and another backward: the clip measured the "
                       "gradients before that backward, and would scale the ones it added "
                       "too; call clip_grad_norm after the last backward (zero_grad() "
                       "drops it)");
  }

  Context* ctx_;
  comm::Communicator* comm_;
  comm::Communicator* replicas_;  // hybrid sharding's other groups (nullptr: none)
  shard::PieceTable table_;
  std::vector<std::size_t> first_piece_;  // per group: its first piece in the optimizer's list
  std::vector<Tensor> piece_grads_;
  std::unique_ptr<optim::ShardedOptimizer> optimizer_;
  std::uint64_t clip_measured_ = 0;  // the backward clip_grad_norm measured (finished_backwards)
  struct PostStepHook {
    StepHook run;
    bool gated = false;  // leaves a skipped step alone on the device (register_post_step_hook)
  };
  std::vector<PostStepHook> post_step_hooks_;
};

}  // namespace shardkit::parallel
