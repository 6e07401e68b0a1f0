// Fsdp: ZeRO-3 over an nn::Module -- every rank keeps 1/N of each unit's flat parameter (f32
// master), of its gradient and of its optimizer state; full parameters exist only around
// their use. The units and their mechanics are an FsdpEngine (fsdp_engine.hpp, also what
// custom loops use); this file drives it from module hooks. One step (docs/design.md has the
// picture):
//
//   forward   unit u's forward-pre hook waits for (or starts) u's all-gather and starts the
//             next `prefetch` units' gathers in the recorded forward order; its forward hook
//             frees u again when reshard_after_forward (the root unit stays: its backward
//             comes first).
//   backward  u's backward-pre hook gathers u again (prefetching the next units in reverse
//             forward order); gradients land in u's transient full-gradient buckets (grad
//             providers); when a bucket is complete it is reduce-scattered (averaged) into the
//             rank's gradient shard and freed; when all of u's gradients are final, u's full
//             parameters are freed. Recomputation under activation checkpointing re-gathers
//             through the forward-pre hook, frees after the recomputed forward like any
//             forward, and the backward-pre hook gathers once more.
//   end       the end of the backward waits for the last reductions and frees what is still
//             gathered; step() updates the shards with one sharded optimizer over all units.
//
// Gradient accumulation: no_sync() keeps each unit's full gradients locally (costs the whole
// model's f32 gradients on every rank, Psi x 4 bytes) and reduces their sum once; without it,
// each synchronised backward reduce-scatters and adds to the shard (A + avg(g)).
// Frozen parameters stay outside the flat parameters: whole on every rank, with no gradient,
// no optimizer state and no traffic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/fsdp_units.hpp"

namespace shardkit::parallel {

class Fsdp {
 public:
  Fsdp(Context& ctx, comm::Communicator& comm, nn::Module& root, optim::OptimizerConfig optimizer,
       const ParallelOptions& options)
      : Fsdp(ctx, comm, nullptr, root, std::move(optimizer), options) {}

  // Hybrid sharding (PyTorch's HYBRID_SHARD): units sharded inside the mesh's groups and
  // replicated across them (comm/hybrid_mesh.hpp). The mesh must outlive the module.
  Fsdp(Context& ctx, const comm::HybridMesh& mesh, nn::Module& root,
       optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : Fsdp(ctx, mesh.world(), &mesh, root, std::move(optimizer), options) {}

 private:
  Fsdp(Context& ctx, comm::Communicator& comm, const comm::HybridMesh* mesh, nn::Module& root,
       optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : ctx_(&ctx), policy_(resolve(options)) {
    std::map<std::string, autograd::Variable> by_name;
    for (const auto& [name, p] : root.named_parameters()) {
      check(p.dtype() == DType::f32, "parameter '", name, "' is ", dtype_name(p.dtype()),
            "; FSDP keeps f32 parameters (build the model in f32)");
      by_name.emplace(name, p);
    }
    const auto specs = plan_fsdp_units(root, policy_.wrap);
    check_same_units(ctx, comm, specs, by_name);
    std::vector<FsdpUnitParams> engine_units;
    for (const auto& spec : specs) {
      FsdpUnitParams unit{spec.path.empty() ? std::string("<root>") : spec.path, {}};
      std::vector<autograd::Variable> params;
      for (const auto& name : spec.params) {
        const auto& p = by_name.at(name);
        if (!p.requires_grad()) continue;  // frozen: stays whole on every rank
        unit.params.push_back(shard::ParamSpec{name, p.shape(), true});
        params.push_back(p);
      }
      if (params.empty()) continue;
      engine_units.push_back(std::move(unit));
      modules_.push_back(spec.module);
      for (auto& p : params) params_.push_back(p);
      if (spec.path.empty()) root_unit_ = modules_.size() - 1;
    }
    check(!engine_units.empty(), "FSDP: the model has no trainable parameter to shard");
    engine_ =
        mesh != nullptr
            ? std::make_unique<FsdpEngine>(ctx, *mesh, std::move(engine_units), optimizer, options)
            : std::make_unique<FsdpEngine>(ctx, comm, std::move(engine_units), optimizer, options);
    // The module's values become rank 0's, sharded; each parameter then views its unit's
    // gathered buffer (freed until a forward gathers it).
    engine_->set_full_params(
        [&](std::size_t i, const Tensor& view) { copy(ctx, view, params_[i].data()); });
    for (std::size_t i = 0; i < params_.size(); ++i) {
      params_[i].set_data(engine_->param(i));  // (the compute copy under mixed precision)
      params_[i].clear_grad();
      params_[i].set_grad_provider([this, i] { return engine_->grad(i); });
      params_[i].register_grad_ready_hook([this, i](autograd::Variable&) { on_grad_ready(i); });
    }
    for (std::size_t u = 0; u < modules_.size(); ++u) bind_hooks(u);
    // Frozen parameters are replicated: rank 0's values everywhere, like the sharded ones, in
    // the compute dtype.
    for (auto& [name, p] : root.named_parameters()) {
      if (p.requires_grad() || p.numel() == 0) continue;
      if (p.dtype() != policy_.param_dtype) p.set_data(cast(ctx, p.data(), policy_.param_dtype));
      comm.broadcast(p.data(), 0).wait();
    }
  }

 public:
  ~Fsdp() {
    for (std::size_t u = 0; u < modules_.size(); ++u)
      for (auto id : hooks_[u]) modules_[u]->remove_hook(id);
    for (auto& p : params_) {
      p.set_grad_provider({});
      p.clear_grad_ready_hooks();
    }
  }
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  // Updates every unit's shard with the averaged gradients of the synchronised backwards since
  // zero_grad().
  void step(float lr, float inv_grad_scale = 1.0f) { engine_->step(lr, inv_grad_scale); }
  void zero_grad() { engine_->zero_grad(); }
  double clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    return engine_->clip_grad_norm(max_norm, inv_grad_scale);
  }
  bool step(float lr, optim::DynamicLossScaler& scaler) { return engine_->step(lr, scaler); }
  void set_sync(bool enabled) { engine_->set_sync(enabled); }

  // The engine (units, gather/release, optimizer) and the module each unit belongs to.
  FsdpEngine& engine() { return *engine_; }
  const FsdpEngine& engine() const { return *engine_; }
  std::size_t unit_count() const { return engine_->unit_count(); }
  // FSDP's summon_full_params: every unit gathered while the scope lives (to read or write
  // the module's parameters between steps); written values go back to the shards at exit.
  [[nodiscard]] FsdpEngine::FullParams full_params() { return engine_->full_params(); }

  // The most units gathered at once since construction (the root unit not counted).
  int max_gathered_units() const { return max_gathered_; }
  const optim::ShardedOptimizer& optimizer() const { return engine_->optimizer(); }

 private:
  bool is_root(std::size_t u) const { return u == root_unit_; }

  // Every rank must have the same units with the same parameters, frozen ones included, or
  // collectives would pair up wrongly: one fingerprint before any of them.
  static void check_same_units(Context& ctx, comm::Communicator& comm,
                               const std::vector<FsdpUnitSpec>& specs,
                               const std::map<std::string, autograd::Variable>& by_name) {
    std::vector<shard::ParamSpec> all;
    for (const auto& spec : specs) {
      all.push_back(shard::ParamSpec{"unit:" + spec.path, {1}, false});
      for (const auto& name : spec.params) {
        const auto& p = by_name.at(name);
        all.push_back(shard::ParamSpec{name, p.shape(), p.requires_grad()});
      }
    }
    check_same_fingerprint(ctx, comm, shard::ParamLayout(all).fingerprint(),
                           "the module tree or its FSDP units differ between ranks (paths, "
                           "parameter names, shapes or frozen flags); build the same model and "
                           "wrap policy on every rank");
  }

  void bind_hooks(std::size_t u) {
    nn::Module& m = *modules_[u];
    hooks_.resize(modules_.size());
    auto& ids = hooks_[u];
    ids.push_back(m.register_forward_pre_hook(
        [this, u](nn::Module&, const autograd::Variable&) { pre_forward(u); }));
    ids.push_back(
        m.register_forward_hook([this, u](nn::Module&, const autograd::Variable&,
                                          const autograd::Variable&) { post_forward(u); }));
    ids.push_back(
        m.register_backward_pre_hook([this, u](nn::Module&, const Tensor&) { pre_backward(u); }));
    // Post-backward: the gradient leaving through the unit's input means its backward is done
    // (also inside a checkpoint's recomputed backward, where grad-ready hooks wait for the
    // outer pass). Units whose input needs no gradient free at their last grad-ready instead.
    ids.push_back(
        m.register_backward_hook([this, u](nn::Module&, const Tensor&) { engine_->release(u); }));
  }

  // --- gather / release -------------------------------------------------------------------
  void start_gather(std::size_t u) {
    engine_->start_gather(u);
    int gathered = 0;
    for (std::size_t k = 0; k < engine_->unit_count(); ++k)
      if (!is_root(k) && engine_->holds_full(k)) ++gathered;
    max_gathered_ = std::max(max_gathered_, gathered);
  }
  void ensure_gathered(std::size_t u) {
    start_gather(u);
    engine_->gather(u);
  }
  void prefetch_after(std::size_t u, const std::vector<std::size_t>& order) {
    if (policy_.prefetch == 0) return;
    auto it = std::find(order.begin(), order.end(), u);
    if (it == order.end()) return;
    for (int k = 0; k < policy_.prefetch && ++it != order.end(); ++k) start_gather(*it);
  }

  // --- hooks ------------------------------------------------------------------------------
  void pre_forward(std::size_t u) {
    auto& tape = autograd::tape(*ctx_);
    if (!tape.recomputing() && !order_recorded_ &&
        std::find(forward_order_.begin(), forward_order_.end(), u) == forward_order_.end())
      forward_order_.push_back(u);
    ensure_gathered(u);
    if (order_recorded_ && !tape.recomputing()) prefetch_after(u, forward_order_);
  }
  void post_forward(std::size_t u) {
    // (During checkpoint recomputation too: the recomputed graph's backward-pre hook gathers the
    // unit again when its backward comes, so a segment of many units never holds them all.)
    auto& tape = autograd::tape(*ctx_);
    if (is_root(u)) {
      if (tape.recomputing()) return;
      if (!forward_order_.empty()) order_recorded_ = true;
      if (!tape.grad_enabled())  // no backward follows: free everything
        for (std::size_t k = 0; k < engine_->unit_count(); ++k) engine_->release(k);
      return;
    }
    if (policy_.reshard_after_forward || !tape.grad_enabled()) engine_->release(u);
  }
  void pre_backward(std::size_t u) {
    begin_backward();
    engine_->poll_reductions();
    ensure_gathered(u);
    if (order_recorded_) {
      std::vector<std::size_t> reverse(forward_order_.rbegin(), forward_order_.rend());
      prefetch_after(u, reverse);
    }
  }
  void on_grad_ready(std::size_t i) {
    begin_backward();
    engine_->ready(i);
    const std::size_t u = engine_->unit_of(i);
    if (engine_->unit_ready(u)) engine_->release(u);  // post-backward
  }
  void begin_backward() {
    if (in_backward_) return;
    in_backward_ = true;
    autograd::tape(*ctx_).queue_callback([this] { end_backward(); });
  }
  // Parameters the loss did not reach contribute zero gradients; wait for every reduction;
  // free what is still gathered (the root, units without a backward-pre hook).
  void end_backward() {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (!engine_->is_ready(i)) engine_->ready(i);
    engine_->finish();
    for (std::size_t u = 0; u < engine_->unit_count(); ++u) engine_->release(u);
    order_recorded_ = order_recorded_ || !forward_order_.empty();
    in_backward_ = false;
  }

  Context* ctx_;
  ResolvedPolicy policy_;
  std::unique_ptr<FsdpEngine> engine_;
  std::vector<nn::Module*> modules_;            // per unit: whose hooks gather it
  std::vector<std::vector<nn::HookId>> hooks_;  // per unit
  std::vector<autograd::Variable> params_;      // engine parameter order
  std::size_t root_unit_ = static_cast<std::size_t>(-1);
  std::vector<std::size_t> forward_order_;  // units by first forward-pre hook, recorded once
  bool order_recorded_ = false;
  bool in_backward_ = false;
  int max_gathered_ = 0;
};

}  // namespace shardkit::parallel
