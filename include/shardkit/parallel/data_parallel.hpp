// DataParallel: DDP, OSS (ZeRO-1) and SDP (ZeRO-2) for training loops whose forward and
// backward the user writes. The user reads parameters from params(), adds each gradient into
// grad(i) and calls ready(i) from the backward; finish() waits for the communication; step()
// updates the parameters. Results equal DDP's; memory per rank follows the ZeRO stage:
//
//   ddp: full gradients, averaged in buckets (all-reduce); every rank steps every parameter.
//   oss: as ddp, but optimizer state only for the rank's range; owners update it and the
//        parameters are re-assembled with one all_gather_v (optionally f16 on the wire, while
//        the owner's f32 master stays exact -- FairScale rounds it; we do not).
//   sdp: gradients reduced to their owners (reduce_scatter_v per bucket); a rank keeps only its
//        range's gradients plus transient bucket buffers; then as oss.
//
// consolidate_optimizer_state() gathers the whole optimizer state on one rank, by parameter
// name; load_optimizer_state() re-shards it for any stage, partition or world size.
//
// Options: ParallelOptions (options.hpp), resolved once (policy.hpp).
//
// Mixed precision (options.precision, mixed_precision.hpp): param(i) is the f16/bf16 compute
// copy, whole on every rank; gradients are kept in it and reduced in reduce_dtype; the f32
// master lives in the optimizer for the pieces this rank updates (every piece under ddp,
// the rank's range under oss/sdp), and after a step the owners' rounded copies are
// all-gathered in the compute dtype. Initialise with set_full_params (exact f32 masters).
//
// CPU offload (options.offload.optimizer, offload.hpp): the optimizer's master, state and step
// live on host_context(); results are the same bits on the CPU path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/flat_param_group.hpp"
#include "shardkit/parallel/grad_bucketer.hpp"
#include "shardkit/parallel/mixed_precision.hpp"
#include "shardkit/parallel/offload.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/param_rows.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/stage.hpp"
#include "shardkit/parallel/training_state.hpp"

namespace shardkit::parallel {

class DataParallel {
 public:
  DataParallel(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
               optim::OptimizerConfig optimizer, const ParallelOptions& options = {})
      : DataParallel(ctx, comm, nullptr, specs, std::move(optimizer), options) {}

  // Hybrid sharding: oss and sdp shard inside the mesh's groups and replicate across them
  // (comm/hybrid_mesh.hpp); ddp reduces in two levels. The mesh must outlive the engine.
  DataParallel(Context& ctx, const comm::HybridMesh& mesh,
               const std::vector<shard::ParamSpec>& specs, optim::OptimizerConfig optimizer,
               const ParallelOptions& options = {})
      : DataParallel(ctx, mesh.shard(), mesh.replicate(), specs, std::move(optimizer), options) {}

 private:
  DataParallel(Context& ctx, comm::Communicator& comm, comm::Communicator* replicas,
               const std::vector<shard::ParamSpec>& specs, optim::OptimizerConfig optimizer,
               const ParallelOptions& options)
      : comm_(&comm),
        replicas_(replicas),
        policy_(checked(options)),
        group_(ctx, comm, specs, policy_.partition, policy_.residency, policy_.param_dtype,
               replicas),
        bucketer_(ctx, comm, group_.plan(), policy_.grad_sync, policy_.buckets, nullptr, replicas),
        table_(shard::PieceTable::of_plan(group_.plan(), policy_.every_rank_updates)),
        pieces_(group_.updated_pieces(policy_.every_rank_updates)),
        host_(offload_context(ctx, policy_.offload)),
        optimizer_(ctx, table_, comm.rank(), group_.piece_params(pieces_), optimizer, &comm,
                   optim::OptimizerOffload{host_.get()}) {
    for (const auto& piece : pieces_) piece_grads_.push_back(bucketer_.piece_grad(piece));
    group_.check_same_everywhere();
  }

 public:
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Stage stage() const { return policy_.stage; }
  const ResolvedPolicy& policy() const { return policy_; }
  const shard::ShardPlan& plan() const { return group_.plan(); }
  const parallel::FlatBuffer& params() const { return group_.params(); }
  const Tensor& param(std::size_t i) const { return group_.param(i); }
  // The ranks this engine shards over (the shard group under hybrid sharding).
  comm::Communicator& communicator() const { return *comm_; }
  // Hybrid sharding's other groups (nullptr without hybrid sharding).
  comm::Communicator* replicas() const { return replicas_; }

  // Makes every rank's parameters equal to `root`'s (after each rank initialised its own).
  // Under mixed precision the masters then take the compute copy's (rounded) values: use
  // set_full_params for exact ones.
  void broadcast_parameters(int root = 0) {
    group_.broadcast(root);
    optimizer_.copy_params_to_masters();
  }

  // Sets every parameter from exact f32 values: fill(i, view) writes parameter i (an f32 view,
  // spec order) on every rank, then rank `root`'s values hold everywhere -- the f32 masters
  // exactly, the compute copy rounded under mixed precision. Collective.
  template <class Fill>
  void set_full_params(Fill&& fill, int root = 0) {
    group_.set_from_f32(
        fill,
        [&](std::size_t k, const Tensor& values) {
          if (optimizer_.separate_master()) optimizer_.set_master(k, values);
        },
        pieces_, root);
  }

  // Backward side: add the gradient of parameter i into grad(i), then ready(i).
  Tensor grad(std::size_t i) { return bucketer_.grad(i); }
  void ready(std::size_t i) { bucketer_.ready(i); }
  void finish() { bucketer_.finish(); }
  void zero_grad() { bucketer_.zero_grad(); }
  parallel::GradBucketer& bucketer() { return bucketer_; }

  // Gradient accumulation: while the returned scope lives, backwards accumulate locally.
  class NoSync {
   public:
    explicit NoSync(parallel::GradBucketer& b) : bucketer_(&b) { bucketer_->set_sync(false); }
    ~NoSync() { bucketer_->set_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    parallel::GradBucketer* bucketer_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(bucketer_); }

  // Updates the parameters with the averaged gradients of the last synchronised backward.
  void step(float lr, float inv_grad_scale = 1.0f) {
    check<StateError>(bucketer_.finished(),
                      "optimizer step before the gradients are finished: call finish() after "
                      "the (synchronised) backward, then step()");
    optimizer_.step(piece_grads_, lr, inv_grad_scale);
    for (const auto& rows : row_normalized_)
      normalize_owned_rows(optimizer_.context(), optimizer_, comm_, rows.name, rows.eps);
    if (policy_.gather_after_step) group_.all_gather_owned(policy_.broadcast_fp16);
  }

  // From now on every applied step ends with w[r] <- w[r] / max(|w[r]|, eps) for each row of
  // trainable 2-D parameter `name` (SwAV's prototypes; param_rows.hpp), on the owners' pieces
  // before the parameter all-gather: exact and alike under every stage, with no extra
  // collective beyond the row norms' small exchange.
  void normalize_rows_after_step(const std::string& name, double eps = 1e-12) {
    (void)detail::row_param(optimizer_.table(), name);
    row_normalized_.push_back({name, eps});
  }

  // torch.nn.utils.clip_grad_norm_ after the backward: the gradients' global L2 norm (exact,
  // the same bits under every stage) is returned, and the next step() scales them by
  // max_norm / (norm + 1e-6) when that is below 1. Collective.
  // (With a loss scaler, pass its inv_scale(): the norm is of the unscaled gradients.)
  double clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    check<StateError>(bucketer_.finished(),
                      "clip_grad_norm before the gradients are finished: call finish() after "
                      "the backward, then clip_grad_norm(), then step()");
    return optimizer_.clip_grad_norm(piece_grads_, max_norm, inv_grad_scale);
  }

  // The loss-scaled step (f16 mixed precision, optim/loss_scaler.hpp): every rank skips a step
  // whose gradients are not finite on some rank (nothing changes but the scale), else steps
  // with the gradients unscaled in the fused pass. Returns whether it stepped. Collective.
  bool step(float lr, optim::DynamicLossScaler& scaler) {
    check<StateError>(bucketer_.finished(),
                      "optimizer step before the gradients are finished: call finish() after "
                      "the (synchronised) backward, then step()");
    const bool finite = scaler.grads_finite(optimizer_.context(), comm_, piece_grads_);
    const float inv_scale = scaler.inv_scale();
    scaler.update(!finite);
    if (!finite) {
      optimizer_.discard_clip();
      return false;
    }
    step(lr, inv_scale);
    return true;
  }

  const optim::ShardedOptimizer& optimizer() const { return optimizer_; }
  // Offload: the host context of the optimizer's state and step (its memory statistics are the
  // host's share); without offload, the engine's own context.
  Context& host_context() const { return optimizer_.host_context(); }
  // After finish(): the averaged gradient of each piece this rank updates (optimizer().pieces()
  // order; under ddp, every trainable parameter whole).
  const std::vector<Tensor>& piece_grads() const { return piece_grads_; }

  // The whole optimizer state on `recipient`, an empty OptimizerState on the other ranks
  // (FairScale's consolidate_state_dict; optim/consolidation.hpp). Collective.
  optim::OptimizerState consolidate_optimizer_state(int recipient = 0) {
    return optim::consolidate_optimizer_state(optimizer_, *comm_, recipient);
  }

  // What checkpoints save and load (io/checkpoint.hpp): the optimizer's pieces and state,
  // frozen parameters (whole on every rank), and the parameter sync after a load.
  TrainingState training_state() {
    TrainingState state;
    state.optimizer = &optimizer_;
    state.comm = comm_;
    state.replicas = replicas_;
    const auto& layout = group_.plan().layout();
    for (std::size_t i = 0; i < layout.size(); ++i)
      if (!layout[i].trainable) state.replicated.emplace_back(layout[i].name, group_.param(i));
    state.after_load = [this] {  // (the optimizer wrote the owners' compute copies)
      if (policy_.gather_after_step) group_.all_gather_owned(false);
    };
    state.stage = std::string(stage_name(policy_.stage));
    return state;
  }

  // Takes this rank's share of a whole optimizer state (from consolidate_optimizer_state, on any
  // stage, partition or world size); parameters are matched by name.
  void load_optimizer_state(const optim::OptimizerState& state) {
    optim::load_optimizer_state(optimizer_, state);
  }

 private:
  static ResolvedPolicy checked(const ParallelOptions& options) {
    check(options.stage != Stage::fsdp,
          "DataParallel runs ddp, oss and sdp; for fsdp (ZeRO-3) "
          "use parallel::FsdpEngine (custom loops) or ShardedModule with Stage::fsdp");
    return resolve(options);
  }

  comm::Communicator* comm_;
  comm::Communicator* replicas_;  // hybrid sharding's other groups (nullptr: none)
  ResolvedPolicy policy_;
  FlatParamGroup group_;
  parallel::GradBucketer bucketer_;
  shard::PieceTable table_;
  std::vector<shard::ParamPiece> pieces_;  // what this rank updates, in table order
  std::unique_ptr<Context> host_;          // offload: where the optimizer lives (else null)
  optim::ShardedOptimizer optimizer_;
  std::vector<RowNormalization> row_normalized_;  // normalize_rows_after_step
  std::vector<Tensor> piece_grads_;  // the averaged gradient of each piece the optimizer updates
};

}  // namespace shardkit::parallel
