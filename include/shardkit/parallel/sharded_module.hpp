// ShardedModule: trains an nn::Module under a ZeRO stage -- the module-level entry point, as
// PyTorch's DistributedDataParallel / FairScale's ShardedDataParallel and FSDP wrap a module.
//
//   ShardedModule model(ctx, comm, net, optimizer_config, {.stage = Stage::sdp});
//   auto loss = criterion(model(ctx, x));
//   autograd::backward(ctx, loss);  // gradients reduced while backward runs
//   model.step(lr);                 // sharded optimizer step, parameters back in sync
//   model.zero_grad();
//
// It holds one Engine (engine.hpp) over the module's param groups (module_groups.hpp: one group
// under ddp, oss and sdp; one per unit under fsdp), binds the module's parameters to it
// (module_binding.hpp: each becomes a view of its group's buffer, its gradient goes straight
// into the engine's buckets) and, under fsdp, gathers and frees the units from module hooks
// (unit_hooks.hpp). Parameters the loss did not reach count as zero gradients.
//
// Buffers (batch-norm running statistics): rank 0's are broadcast when the module is wrapped
// and, with broadcast_buffers (default, as PyTorch DDP), before every training-mode forward:
// after each step every rank holds rank 0's statistics, which were updated from rank 0's batch
// only. Without broadcast_buffers each rank keeps statistics of its own batches.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/nn/deferred_init.hpp"
#include "shardkit/nn/module.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/module_binding.hpp"
#include "shardkit/parallel/module_groups.hpp"
#include "shardkit/parallel/root_recipes.hpp"
#include "shardkit/parallel/unit_hooks.hpp"

namespace shardkit::parallel {

// Makes every rank's module buffers equal to rank `root`'s. Integer buffers (batch counts)
// travel as f64, exact below 2^53.
inline void broadcast_module_buffers(Context& ctx, nn::Module& module, comm::Communicator& comm,
                                     int root = 0) {
  for (const auto& [name, buffer] : module.named_buffers()) {
    if (buffer.numel() == 0) continue;
    if (is_floating(buffer.dtype())) {
      comm.broadcast(buffer, root).wait_on_stream();
      continue;
    }
    Tensor wire = cast(ctx, buffer, DType::f64);
    comm.broadcast(wire, root).wait_on_stream();
    copy(ctx, buffer, wire);
  }
}

class ShardedModule {
 public:
  ShardedModule(Context& ctx, comm::Communicator& comm, std::shared_ptr<nn::Module> module,
                optim::OptimizerConfig optimizer, const ParallelOptions& options = {})
      : ShardedModule(ctx, comm, nullptr, std::move(module), std::move(optimizer), options) {}

  // Hybrid sharding: oss, sdp and fsdp shard inside the mesh's groups and replicate across them
  // (comm/hybrid_mesh.hpp; PyTorch's HYBRID_SHARD). Buffers still come from world rank 0. The
  // mesh must outlive the module.
  ShardedModule(Context& ctx, const comm::HybridMesh& mesh, std::shared_ptr<nn::Module> module,
                optim::OptimizerConfig optimizer, const ParallelOptions& options = {})
      : ShardedModule(ctx, mesh.world(), &mesh, std::move(module), std::move(optimizer), options) {}

 private:
  ShardedModule(Context& ctx, comm::Communicator& world, const comm::HybridMesh* mesh,
                std::shared_ptr<nn::Module> module, optim::OptimizerConfig optimizer,
                const ParallelOptions& options)
      : ctx_(&ctx), world_(&world), module_(checked_module(std::move(module))) {
    const ResolvedPolicy policy = resolve(options);
    nn::check_deferred_initialised(*module_);  // (before any collective)
    ModuleGroups groups = module_groups(ctx, world, *module_, policy);
    engine_ = std::make_unique<Engine>(ctx, mesh != nullptr ? mesh->shard() : world,
                                       mesh != nullptr ? mesh->replicate() : nullptr,
                                       std::move(groups.groups), std::move(optimizer), policy);
    // Rank 0's f32 values become the engine's (exact masters under mixed precision); then every
    // parameter a view of its group's buffer (the compute copy). Where rank 0's parameters are
    // deferred (core/deferred_init.hpp), every rank makes rank 0's values itself from its
    // recipes (root_recipes.hpp), only the range it keeps: a unit is then never whole, and no
    // values travel. A unit with another parameter (built eagerly, or a view of part of a
    // deferred tensor, which is made whole first) is filled whole and broadcast. (The table
    // covers the frozen parameters outside fsdp's units too, after the engine's.)
    const std::size_t engine_params = groups.params.size();
    std::vector<Tensor> values;
    for (const auto& p : groups.params) values.push_back(p.data());
    for (const auto& p : groups.outside) values.push_back(p.data());
    const auto recipes = root_recipes(ctx, world, values);
    engine_->set_params(
        [&](std::size_t i, const Tensor& view) {
          if (fillable_from_recipe(values[i]))
            return fill_from_recipe(ctx, view, values[i], "a parameter");
          materialize(ctx, values[i], "a parameter");
          copy(ctx, view, values[i]);
        },
        [&](std::size_t i, std::int64_t first, const Tensor& view) {
          make_from_recipe(ctx, view, recipes[i]->recipe, recipes[i]->dtype, first);
        },
        [&](std::size_t i) { return recipes[i].has_value(); });
    values.clear();
    binding_ = std::make_unique<ModuleBinding>(
        ctx, *engine_, std::move(groups.params), [this](std::size_t i) { hooks_->after_ready(i); },
        [this] { hooks_->after_backward(); });
    hooks_ = std::make_unique<UnitHooks>(ctx, *engine_, *binding_, std::move(groups.unit_modules),
                                         groups.root_unit);
    // What stays whole (buffers, frozen parameters outside fsdp's units) gets its deferred
    // values now, before it is cast or broadcast.
    nn::materialize(ctx, *module_);
    // Frozen parameters outside the groups (fsdp): rank 0's values everywhere, like the
    // sharded ones, in the compute dtype -- made here from rank 0's recipe where it has one,
    // else broadcast.
    for (std::size_t j = 0; j < groups.outside.size(); ++j) {
      auto& p = groups.outside[j];
      const auto& recipe = recipes[engine_params + j];
      if (recipe) make_from_recipe(ctx, p.data(), recipe->recipe, recipe->dtype);
      if (p.dtype() != policy.param_dtype) p.set_data(cast(ctx, p.data(), policy.param_dtype));
      if (!recipe) world.broadcast(p.data(), 0).wait();
    }
    broadcast_module_buffers(ctx, *module_, world);
  }

 public:
  ShardedModule(const ShardedModule&) = delete;
  ShardedModule& operator=(const ShardedModule&) = delete;

  // The module's forward; in training mode first rank 0's buffers (broadcast_buffers). Under
  // mixed precision a floating-point input is cast to the compute dtype first (PyTorch FSDP's
  // cast_root_forward_inputs).
  autograd::Variable operator()(Context& ctx, const autograd::Variable& input) {
    const ResolvedPolicy& policy = engine_->policy();
    if (policy.broadcast_buffers && module_->is_training())
      broadcast_module_buffers(ctx, *module_, *world_);
    const DType compute = policy.param_dtype;
    if (policy.mixed_precision() && is_floating(input.dtype()) && input.dtype() != compute)
      return (*module_)(ctx, autograd::cast(ctx, input, compute));
    return (*module_)(ctx, input);
  }

  // Updates the parameters with the averaged gradients of the synchronised backwards since
  // zero_grad(); `lr` is this step's rate (schedules live in the training loop).
  void step(float lr, float inv_grad_scale = 1.0f) { engine_->step(lr, inv_grad_scale); }
  // A captured step (core/step_graph.hpp) reads its rate on the device: the loop sets it before
  // each run, outside the step, and the step calls step() or step(scaler) without one.
  //   model.set_lr(schedule(s));
  //   graph.run(key, [&] { ...; model.step(scaler); });
  void set_lr(float lr) { engine_->set_lr(lr); }
  void step() { engine_->step(); }
  void step(optim::DynamicLossScaler& scaler) { engine_->step(scaler); }
  // The loss-scaled step (f16 mixed precision): after autograd::backward(ctx, loss,
  // scaler.seed(ctx, loss.value())), every rank skips a step whose gradients overflowed on some
  // rank, else steps with them unscaled; the scale follows (optim/loss_scaler.hpp). Decided on
  // the device: scaler.found_inf() says afterwards (a host read) whether it was skipped.
  void step(float lr, optim::DynamicLossScaler& scaler) { engine_->step(lr, scaler); }
  // torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between the backward and
  // step(): returns the gradients' global L2 norm (exact and the same under every stage, frozen
  // parameters having none) as f64 [1] on the device; the next step() applies the clipping in
  // its fused pass.
  Tensor clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    return engine_->clip_grad_norm(max_norm, inv_grad_scale);
  }
  void zero_grad() {
    engine_->zero_grad();
    binding_->clear_grads();
  }
  // Gradient accumulation: while the returned scope lives, backwards sum gradients locally and
  // communicate nothing; the next synchronised backward reduces the sums.
  [[nodiscard]] Engine::NoSync no_sync() { return engine_->no_sync(); }
  void register_post_step_hook(Engine::StepHook hook, bool gated = false) {
    engine_->register_post_step_hook(std::move(hook), gated);
  }

  nn::Module& module() const { return *module_; }
  Stage stage() const { return engine_->stage(); }
  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  // The ranks the model states are sharded over (the shard group under hybrid sharding).
  comm::Communicator& communicator() const { return engine_->communicator(); }
  // FSDP's summon_full_params: every unit gathered while the scope lives (to read or write the
  // module's parameters between steps); written values go back to the shards at exit. Under
  // ddp, oss and sdp the parameters are whole anyway.
  [[nodiscard]] Engine::FullParams full_params() { return engine_->full_params(); }
  // fsdp: the most units gathered at once since construction (the root unit not counted).
  int max_gathered_units() const { return hooks_->max_gathered_units(); }

  // The module's full state dict (parameters and buffers by state-dict name, PyTorch's
  // state_dict()) as host copies. Under fsdp the parameters are gathered one unit at a time,
  // so a rank never holds more than one unit beyond its shards and the copies; with
  // `rank0_only` (PyTorch's FullStateDictConfig(rank0_only=True), the default) only rank 0
  // receives them and the others return an empty list. Collective under fsdp.
  std::vector<std::pair<std::string, Tensor>> state_dict(bool rank0_only = true) {
    Context host_ctx;
    const bool keep = !rank0_only || world_->rank() == 0;
    std::map<std::string, Tensor> copies;
    auto take = [&](const std::string& name, const Tensor& t) {
      if (!keep) return;
      Tensor host = empty(host_ctx, t.shape(), t.dtype());
      copy(*ctx_, host, t);
      copies.emplace(name, std::move(host));
    };
    for (std::size_t u = 0; u < engine_->unit_count(); ++u) {
      const bool was_gathered = engine_->holds_full(u);
      engine_->gather_exact(u);  // (exact under qwZ too)
      const auto& group = engine_->group(u);
      for (std::size_t i = 0; i < group.size(); ++i)
        take(group.plan().layout()[i].name, group.param(i));
      if (!was_gathered) engine_->release(u);
    }
    // Buffers, and frozen parameters outside the groups.
    for (const auto& [name, t] : module_->state_dict())
      if (!copies.count(name)) take(name, t);
    std::vector<std::pair<std::string, Tensor>> out;
    if (!keep) return out;
    for (const auto& [name, t] : module_->state_dict()) out.emplace_back(name, copies.at(name));
    return out;
  }

  // What checkpoints save and load (checkpoint/training_checkpoint.hpp): the engine's state,
  // plus the module's buffers and the frozen parameters outside its groups, whole on every
  // rank, by state-dict names.
  TrainingState training_state() {
    TrainingState state = engine_->training_state();
    std::set<std::string> held;
    for (const auto& [name, t] : state.replicated) held.insert(name);
    for (const auto& [name, p] : module_->named_parameters())
      if (!p.requires_grad() && !held.count(name)) state.replicated.emplace_back(name, p.data());
    for (const auto& [name, buffer] : module_->named_buffers())
      state.replicated.emplace_back(name, buffer);
    return state;
  }

 private:
  static std::shared_ptr<nn::Module> checked_module(std::shared_ptr<nn::Module> module) {
    check(module != nullptr, "ShardedModule: no module given");
    return module;
  }

  Context* ctx_;
  comm::Communicator* world_;  // every rank (the shard group's world under hybrid sharding)
  std::shared_ptr<nn::Module> module_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ModuleBinding> binding_;  // after the engine: unbinds before it goes
  std::unique_ptr<UnitHooks> hooks_;        // after the binding: removes its hooks first
};

}  // namespace shardkit::parallel
