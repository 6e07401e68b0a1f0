// ShardedModule: trains an nn::Module under a ZeRO stage -- the module-level entry point, as
// PyTorch's DistributedDataParallel / FairScale's ShardedDataParallel and FSDP wrap a module.
//
//   ShardedModule model(ctx, comm, net, optimizer_config, {.stage = Stage::sdp});
//   auto loss = criterion(model(ctx, x));
//   autograd::backward(ctx, loss);  // gradients reduced while backward runs
//   model.step(lr);                 // sharded optimizer step, parameters back in sync
//   model.zero_grad();
//
// The module's parameters move into flat buffers and stay Variables viewing them (FairScale's
// FlattenParamsWrapper idea), so names, state_dict(), hooks, train()/eval() and activation
// checkpointing work unchanged. Each parameter's gradient goes straight into its bucket's
// storage (a grad provider), its grad-ready hook feeds the bucketer, and the end of the backward
// waits for the last bucket. Parameters the loss did not reach count as zero gradients.
//
// Buffers (batch-norm running statistics): rank 0's are broadcast when the module is wrapped
// and, with broadcast_buffers (default, as PyTorch DDP), before every training-mode forward:
// after each step every rank holds rank 0's statistics, which were updated from rank 0's batch
// only. Without broadcast_buffers each rank keeps statistics of its own batches.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/nn/module.hpp"
#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/fsdp.hpp"
#include "shardkit/parallel/param_rows.hpp"

namespace shardkit::parallel {

// The parameter specs of a module: state-dict names, shapes, trainable = requires_grad.
inline std::vector<shard::ParamSpec> module_param_specs(const nn::Module& module) {
  std::vector<shard::ParamSpec> specs;
  for (const auto& [name, p] : module.named_parameters()) {
    check(p.dtype() == DType::f32, "parameter '", name, "' is ", dtype_name(p.dtype()),
          "; sharded modules keep f32 parameters (build the model in f32)");
    specs.push_back(shard::ParamSpec{name, p.shape(), p.requires_grad()});
  }
  return specs;
}

// Makes every rank's module buffers equal to rank `root`'s. Integer buffers (batch counts)
// travel as f64, exact below 2^53.
inline void broadcast_module_buffers(Context& ctx, nn::Module& module, comm::Communicator& comm,
                                     int root = 0) {
  for (const auto& [name, buffer] : module.named_buffers()) {
    if (buffer.numel() == 0) continue;
    if (is_floating(buffer.dtype())) {
      comm.broadcast(buffer, root).wait();
      continue;
    }
    Tensor wire = cast(ctx, buffer, DType::f64);
    comm.broadcast(wire, root).wait();
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
      : ctx_(&ctx),
        comm_(mesh != nullptr ? &mesh->shard() : &world),
        world_(&world),
        module_(checked_module(std::move(module))),
        policy_(resolve(options)) {
    if (options.stage == Stage::fsdp) {
      fsdp_ = mesh != nullptr ? std::make_unique<Fsdp>(ctx, *mesh, *module_, optimizer, options)
                              : std::make_unique<Fsdp>(ctx, world, *module_, optimizer, options);
      broadcast_module_buffers(ctx, *module_, world);
      return;
    }
    engine_ = mesh != nullptr ? std::make_unique<DataParallel>(
                                    ctx, *mesh, module_param_specs(*module_), optimizer, options)
                              : std::make_unique<DataParallel>(
                                    ctx, world, module_param_specs(*module_), optimizer, options);
    bind_parameters();
    broadcast_module_buffers(ctx, *module_, world);
  }

 public:
  ~ShardedModule() { unbind(); }
  ShardedModule(const ShardedModule&) = delete;
  ShardedModule& operator=(const ShardedModule&) = delete;

  // The module's forward; in training mode first rank 0's buffers (broadcast_buffers). Under
  // mixed precision a floating-point input is cast to the compute dtype first (PyTorch FSDP's
  // cast_root_forward_inputs).
  autograd::Variable operator()(Context& ctx, const autograd::Variable& input) {
    if (policy_.broadcast_buffers && module_->is_training())
      broadcast_module_buffers(ctx, *module_, *world_);
    const DType compute = policy_.param_dtype;
    if (policy_.mixed_precision() && is_floating(input.dtype()) && input.dtype() != compute)
      return (*module_)(ctx, autograd::cast(ctx, input, compute));
    return (*module_)(ctx, input);
  }

  // Updates the parameters with the averaged gradients of the synchronised backwards since
  // zero_grad(); `lr` is this step's rate (schedules live in the training loop).
  void step(float lr, float inv_grad_scale = 1.0f) {
    if (fsdp_) return fsdp_->step(lr, inv_grad_scale);
    engine_->step(lr, inv_grad_scale);
  }

  // torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between the backward and
  // step(): returns the gradients' global L2 norm (exact and the same under every stage, frozen
  // parameters having none); the next step() applies the clipping in its fused pass.
  double clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    if (fsdp_) return fsdp_->clip_grad_norm(max_norm, inv_grad_scale);
    return engine_->clip_grad_norm(max_norm, inv_grad_scale);
  }

  // The loss-scaled step (f16 mixed precision): after autograd::backward(ctx, loss,
  // scaler.scale()), every rank skips a step whose gradients overflowed on some rank, else
  // steps with them unscaled; the scale follows (optim/loss_scaler.hpp). Returns whether it
  // stepped.
  bool step(float lr, optim::DynamicLossScaler& scaler) {
    if (fsdp_) return fsdp_->step(lr, scaler);
    return engine_->step(lr, scaler);
  }

  void zero_grad() {
    if (fsdp_) return fsdp_->zero_grad();
    engine_->zero_grad();
    for (auto& p : params_) p.clear_grad();
  }

  // Gradient accumulation: while the returned scope lives, backwards sum gradients locally and
  // communicate nothing; the next synchronised backward reduces the sums.
  class NoSync {
   public:
    explicit NoSync(ShardedModule& m) : module_(&m) { module_->set_sync(false); }
    ~NoSync() { module_->set_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ShardedModule* module_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  nn::Module& module() const { return *module_; }
  Stage stage() const { return policy_.stage; }
  // The engine behind the stage: DataParallel (ddp/oss/sdp) or Fsdp.
  DataParallel& engine() {
    check<StateError>(engine_ != nullptr, "engine(): this module runs fsdp; use fsdp()");
    return *engine_;
  }
  Fsdp& fsdp() {
    check<StateError>(fsdp_ != nullptr, "fsdp(): this module runs ", stage_name(policy_.stage));
    return *fsdp_;
  }
  // The ranks the model states are sharded over (the shard group under hybrid sharding).
  comm::Communicator& communicator() const { return *comm_; }

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
    if (fsdp_) {
      auto& engine = fsdp_->engine();
      for (std::size_t u = 0; u < engine.unit_count(); ++u) {
        const bool was_gathered = engine.holds_full(u);
        engine.gather(u);
        const auto& group = engine.group(u);
        for (std::size_t i = 0; i < group.plan().layout().size(); ++i)
          take(group.plan().layout()[i].name, group.param(i));
        if (!was_gathered) engine.release(u);
      }
    }
    // Buffers and frozen parameters (and under ddp/oss/sdp everything: whole on every rank).
    for (const auto& [name, t] : module_->state_dict())
      if (!copies.count(name)) take(name, t);
    std::vector<std::pair<std::string, Tensor>> out;
    if (!keep) return out;
    for (const auto& [name, t] : module_->state_dict()) out.emplace_back(name, copies.at(name));
    return out;
  }

  // Row-wise L2 normalisation of a trainable 2-D parameter after a step (SwAV's prototypes),
  // exact and alike under every stage (parallel/param_rows.hpp). Collective. Under OSS/SDP
  // this gathers the parameters again: normalize_rows_after_step does it inside the step.
  void normalize_rows(const std::string& name, double eps = 1e-12) {
    auto state = training_state();
    parallel::normalize_rows(*ctx_, state, name, eps);
  }

  // From now on every applied step ends with normalize_rows(name), done on the owners' pieces
  // before the parameter all-gather the step makes anyway.
  void normalize_rows_after_step(const std::string& name, double eps = 1e-12) {
    if (fsdp_)
      fsdp_->engine().normalize_rows_after_step(name, eps);
    else
      engine_->normalize_rows_after_step(name, eps);
  }

  // Sets a parameter's averaged gradient to 0 between the backward and the step (VISSL's
  // TEMP_FROZEN_PARAMS_ITER_MAP; see parallel/param_rows.hpp for what that equals).
  void zero_grad_of(const std::string& name) {
    if (fsdp_)
      parallel::zero_grad_of(*ctx_, fsdp_->engine().optimizer(), fsdp_->engine().piece_grads(),
                             name);
    else
      parallel::zero_grad_of(*ctx_, engine_->optimizer(), engine_->piece_grads(), name);
  }

  // What checkpoints save and load (io/checkpoint.hpp): the engine's state, plus the module's
  // buffers and (fsdp) its frozen parameters, whole on every rank, by state-dict names.
  TrainingState training_state() {
    TrainingState state = fsdp_ ? fsdp_->engine().training_state() : engine_->training_state();
    if (fsdp_)
      for (const auto& [name, p] : module_->named_parameters())
        if (!p.requires_grad()) state.replicated.emplace_back(name, p.data());
    for (const auto& [name, buffer] : module_->named_buffers())
      state.replicated.emplace_back(name, buffer);
    return state;
  }

 private:
  static std::shared_ptr<nn::Module> checked_module(std::shared_ptr<nn::Module> module) {
    check(module != nullptr, "ShardedModule: no module given");
    return module;
  }

  // Parameter i becomes a view of flat-buffer slot i (values kept); its gradients go to the
  // bucketer and its readiness starts the bucket's reduction.
  // Rank 0's f32 values become the engine's (exact masters under mixed precision), and every
  // parameter a view of the engine's buffer (the compute copy).
  void bind_parameters() {
    for (const auto& [name, p] : module_->named_parameters()) params_.push_back(p);
    ready_.assign(params_.size(), false);
    engine_->set_full_params(
        [&](std::size_t i, const Tensor& view) { copy(*ctx_, view, params_[i].data()); });
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.set_data(engine_->param(i));
      p.clear_grad();
      if (!p.requires_grad()) continue;
      p.set_grad_provider([this, i] { return engine_->grad(i); });
      p.register_grad_ready_hook([this, i](autograd::Variable&) { on_grad_ready(i); });
    }
  }
  void set_sync(bool enabled) {
    if (fsdp_) return fsdp_->set_sync(enabled);
    engine_->bucketer().set_sync(enabled);
  }

  void unbind() {
    for (auto& p : params_) {
      p.set_grad_provider({});
      p.clear_grad_ready_hooks();
    }
  }

  void on_grad_ready(std::size_t i) {
    if (!in_backward_) {
      in_backward_ = true;
      autograd::tape(*ctx_).queue_callback([this] { end_backward(); });
    }
    ready_[i] = true;
    engine_->ready(i);
  }

  // Runs once when the outermost backward ends: parameters the loss did not reach contribute
  // zero gradients; then wait for every bucket.
  void end_backward() {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].requires_grad() && !ready_[i]) engine_->ready(i);
    engine_->finish();
    std::fill(ready_.begin(), ready_.end(), false);
    in_backward_ = false;
  }

  Context* ctx_;
  comm::Communicator* comm_;   // the ranks the states are sharded over
  comm::Communicator* world_;  // every rank (the same as comm_ without hybrid sharding)
  std::shared_ptr<nn::Module> module_;
  ResolvedPolicy policy_;
  std::unique_ptr<DataParallel> engine_;
  std::unique_ptr<Fsdp> fsdp_;
  std::vector<autograd::Variable> params_;  // named_parameters() order = layout index
  std::vector<bool> ready_;
  bool in_backward_ = false;
};

}  // namespace shardkit::parallel
