// FsdpEngine: ZeRO-3 for training loops whose forward and backward the user writes, and the
// engine under the module-level Fsdp (fsdp.hpp). Parameters are grouped into units; each unit
// is one FlatParamGroup with sharded residency -- a rank keeps only its 1/N shard of the unit's
// flat parameter (the f32 master), of its gradient and of its optimizer state -- plus one
// reduce-scatter GradBucketer; one ShardedOptimizer updates every unit's shard.
//
// A custom loop drives it as it drives DataParallel, with gather/release around each use:
//
//   for each unit u in forward order:  engine.gather(u); ...forward with engine.param(i)...;
//                                       engine.release(u);            // reshard after forward
//   for each unit u in backward order: engine.gather(u); ...backward: add into engine.grad(i),
//                                       engine.ready(i)...; engine.release(u);
//   engine.finish(); engine.step(lr); engine.zero_grad();
//
// start_gather(u) begins a unit's all-gather without waiting (prefetch); gather(u) waits for
// it. A unit's gradients are reduce-scattered bucket by bucket as they become ready (averaged,
// added into the rank's gradient shard); the full-gradient buckets are transient
// (MemoryCategory::communication) and freed once reduced. Accumulation: synchronised backwards
// add each one's average into the shard (A + avg(g)); no_sync() keeps full local gradients
// (the whole model's f32 gradients on every rank) and reduces their sum once.
//
// Mixed precision (options.precision): each rank keeps its shard of the compute copy (f16 /
// bf16) and the optimizer the f32 master of it; units are gathered in the compute dtype,
// gradients kept in it and reduce-scattered in reduce_dtype; the fused step updates the
// master and writes the rounded shard. full_params() is then for reading (writes would not
// reach the masters): set values with set_full_params.
//
// CPU offload (options.offload, offload.hpp): `optimizer` puts the master, the optimizer state
// and the step on host_context(); `params` also keeps each unit's parameter shard there, sent
// up into the gathered buffer at each gather, so between uses the device holds no parameters.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/flat_param_group.hpp"
#include "shardkit/parallel/grad_bucketer.hpp"
#include "shardkit/parallel/mixed_precision.hpp"
#include "shardkit/parallel/offload.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/param_rows.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/training_state.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::parallel {

// One unit: a name (for messages; a module path under the module-level Fsdp) and its
// parameters, all trainable (frozen parameters stay outside FSDP units: whole on every rank).
struct FsdpUnitParams {
  std::string name;
  std::vector<shard::ParamSpec> params;
};

class FsdpEngine {
 public:
  // options.stage must be fsdp (what this engine runs).
  FsdpEngine(Context& ctx, comm::Communicator& comm, std::vector<FsdpUnitParams> units,
             optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : FsdpEngine(ctx, comm, nullptr, std::move(units), std::move(optimizer), options) {}

  // Hybrid sharding (PyTorch's HYBRID_SHARD): each unit is sharded inside the mesh's group and
  // replicated across groups; gathers stay inside the group, and only each shard's gradient
  // all-reduce crosses groups (comm/hybrid_mesh.hpp). The mesh must outlive the engine.
  FsdpEngine(Context& ctx, const comm::HybridMesh& mesh, std::vector<FsdpUnitParams> units,
             optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : FsdpEngine(ctx, mesh.shard(), mesh.replicate(), std::move(units), std::move(optimizer),
                   options) {}

 private:
  FsdpEngine(Context& ctx, comm::Communicator& comm, comm::Communicator* replicas,
             std::vector<FsdpUnitParams> units, optim::OptimizerConfig optimizer,
             const ParallelOptions& options)
      : ctx_(&ctx),
        comm_(&comm),
        replicas_(replicas),
        policy_(checked(options)),
        host_(offload_context(ctx, policy_.offload)),
        table_(comm.size(), false) {
    Context* shard_home = policy_.offload.params ? host_.get() : nullptr;
    if (policy_.coalesce_bytes > 0)
      coalescer_ = std::make_unique<ReduceScatterCoalescer>(ctx, comm, policy_.coalesce_bytes);
    std::vector<Tensor> piece_params;
    for (auto& spec : units) {
      check(!spec.params.empty(), "FSDP unit '", spec.name,
            "' has no parameter; give every unit at least one");
      for (const auto& p : spec.params)
        check(p.trainable, "parameter '", p.name, "' of FSDP unit '", spec.name,
              "' is frozen; keep frozen parameters outside the units (whole on every rank)");
      auto unit = std::make_unique<Unit>();
      unit->name = spec.name;
      unit->first_param = index_.size();
      unit->group = std::make_unique<FlatParamGroup>(ctx, comm, spec.params, policy_.partition,
                                                     policy_.residency, policy_.param_dtype,
                                                     replicas, shard_home);
      unit->bucketer =
          std::make_unique<GradBucketer>(ctx, comm, unit->group->plan(), policy_.grad_sync,
                                         policy_.buckets, coalescer_.get(), replicas);
      unit->pieces = unit->group->updated_pieces(false);
      unit->first_piece = piece_grads_.size();
      table_.append_plan(unit->group->plan(), false);
      for (auto& view : unit->group->piece_params(unit->pieces)) piece_params.push_back(view);
      for (const auto& piece : unit->pieces)
        piece_grads_.push_back(unit->bucketer->piece_grad(piece));
      for (std::size_t i = 0; i < spec.params.size(); ++i) index_.push_back({units_.size(), i});
      unit->ready.assign(spec.params.size(), false);
      unit->group->release(not_gathered_reason(*unit));
      units_.push_back(std::move(unit));
    }
    check(!units_.empty(), "FSDP: no unit to shard; give at least one unit with parameters");
    optimizer_ = std::make_unique<optim::ShardedOptimizer>(
        ctx, table_, comm.rank(), std::move(piece_params), optimizer, &comm,
        optim::OptimizerOffload{host_.get(), shard_home != nullptr});
    check_same_everywhere();
  }

 public:
  FsdpEngine(const FsdpEngine&) = delete;
  FsdpEngine& operator=(const FsdpEngine&) = delete;

  const ResolvedPolicy& policy() const { return policy_; }

  // --- units and parameters ---------------------------------------------------------------
  std::size_t unit_count() const { return units_.size(); }
  const std::string& unit_name(std::size_t u) const { return unit_at(u).name; }
  const FlatParamGroup& group(std::size_t u) const { return *unit_at(u).group; }
  // Parameters are numbered across units in order: unit 0's, then unit 1's, ...
  std::size_t param_count() const { return index_.size(); }
  std::size_t unit_of(std::size_t i) const { return index_of(i, "unit_of").unit; }
  // Parameter i's full values: a view of its unit's gathered buffer (using it while the unit
  // is released throws, naming the unit).
  const Tensor& param(std::size_t i) const {
    const auto at = index_of(i, "param");
    return units_[at.unit]->group->param(at.local);
  }

  // Sets every unit's full parameters from exact f32 values: fill(i, view) writes parameter i
  // (an f32 view) on every rank, then rank `root`'s values are broadcast and each rank keeps
  // its shard -- and under mixed precision the exact f32 master of it, the shard rounded. One
  // unit is whole at a time. Collective.
  template <class Fill>
  void set_full_params(Fill&& fill, int root = 0) {
    for (auto& unit : units_) {
      unit->group->materialize();
      unit->group->set_from_f32(
          [&](std::size_t i, const Tensor& view) { fill(unit->first_param + i, view); },
          [&](std::size_t k, const Tensor& values) {
            if (optimizer_->separate_master())
              optimizer_->set_master(unit->first_piece + k, values);
          },
          unit->pieces, root);
      release_unit(*unit);
    }
  }

  // --- gather / release -------------------------------------------------------------------
  // Starts unit u's all-gather without waiting (prefetch); no-op when gathered or gathering.
  void start_gather(std::size_t u) {
    Unit& unit = unit_at(u);
    if (unit.group->gathered() || unit.gathering) return;
    comm::assign(unit.pending, unit.group->gather());
    unit.gathering = true;
  }
  // Unit u's full parameters, gathered (waits for a prefetch in flight).
  void gather(std::size_t u) {
    start_gather(u);
    Unit& unit = unit_at(u);
    if (unit.gathering) {
      unit.pending.wait();
      unit.gathering = false;
    }
  }
  // Frees unit u's full parameters (a prefetch nobody used is completed first).
  void release(std::size_t u) { release_unit(unit_at(u)); }
  // Gathered, or its gather in flight.
  bool holds_full(std::size_t u) const {
    const Unit& unit = unit_at(u);
    return unit.group->gathered() || unit.gathering;
  }

  // Every unit gathered while the scope lives (FSDP's summon_full_params), to read or write
  // parameters between steps; written values go back to the shards when it ends.
  class FullParams {
   public:
    explicit FullParams(FsdpEngine& engine) : engine_(&engine) {
      for (std::size_t u = 0; u < engine_->unit_count(); ++u) engine_->gather(u);
    }
    ~FullParams() {
      const bool writeback = !engine_->optimizer_->mixed_precision();  // (see the top)
      for (auto& unit : engine_->units_) {
        if (writeback) unit->group->copy_range_to_shard();
        engine_->release_unit(*unit);
      }
      if (writeback) engine_->optimizer_->copy_params_to_masters();  // (offload's f32 master)
    }
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    FsdpEngine* engine_;
  };
  [[nodiscard]] FullParams full_params() { return FullParams(*this); }

  // --- gradients --------------------------------------------------------------------------
  // Where the backward adds (+=) parameter i's gradient (valid until ready(i)).
  Tensor grad(std::size_t i) {
    const auto at = index_of(i, "grad");
    return units_[at.unit]->bucketer->grad(at.local);
  }
  // Parameter i's gradient is final for this backward; complete buckets are reduce-scattered.
  void ready(std::size_t i) {
    const auto at = index_of(i, "ready");
    Unit& unit = *units_[at.unit];
    unit.bucketer->ready(at.local);
    unit.ready[at.local] = true;
    if (++unit.ready_count == unit.ready.size()) poll_reductions();
  }
  bool is_ready(std::size_t i) const {
    const auto at = index_of(i, "is_ready");
    return units_[at.unit]->ready[at.local];
  }
  // Every gradient of unit u is final in this backward.
  bool unit_ready(std::size_t u) const {
    const Unit& unit = unit_at(u);
    return unit.ready_count == unit.ready.size();
  }
  // Frees the full-gradient buckets whose reduce-scatter completed, in every unit (never
  // blocks): called as the backward moves on, so finished units do not hold buffers.
  void poll_reductions() {
    for (auto& unit : units_) unit->bucketer->poll();
  }
  // Waits for every unit's reductions; afterwards each rank's shards hold the averaged
  // gradients. Throws if a parameter was never marked ready.
  void finish() {
    for (auto& unit : units_) {
      unit->bucketer->finish();
      std::fill(unit->ready.begin(), unit->ready.end(), false);
      unit->ready_count = 0;
    }
  }
  bool finished() const {
    return std::all_of(units_.begin(), units_.end(),
                       [](const auto& unit) { return unit->bucketer->finished(); });
  }
  void zero_grad() {
    for (auto& unit : units_) unit->bucketer->zero_grad();
  }
  void set_sync(bool enabled) {
    for (auto& unit : units_) unit->bucketer->set_sync(enabled);
  }
  // Gradient accumulation: while the scope lives, backwards keep full local gradients.
  class NoSync {
   public:
    explicit NoSync(FsdpEngine& engine) : engine_(&engine) { engine_->set_sync(false); }
    ~NoSync() { engine_->set_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    FsdpEngine* engine_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // --- the step ---------------------------------------------------------------------------
  // Updates every unit's shard with the averaged gradients of the synchronised backwards since
  // zero_grad(). Nothing is gathered: the next use gathers the new values.
  void step(float lr, float inv_grad_scale = 1.0f) {
    for (const auto& unit : units_)
      check<StateError>(unit->bucketer->finished(),
                        "FSDP step before a synchronised backward finished the gradients of "
                        "unit '",
                        unit->name, "'; run the backward (outside no_sync) and finish() first");
    optimizer_->step(piece_grads_, lr, inv_grad_scale);
    normalize_rows_of_step();
  }

  // As DataParallel::normalize_rows_after_step: every applied step re-normalises the rows of
  // `name` on this rank's shards (the next forward gathers them).
  void normalize_rows_after_step(const std::string& name, double eps = 1e-12) {
    (void)detail::row_param(optimizer_->table(), name);
    row_normalized_.push_back({name, eps});
  }

  // torch.nn.utils.clip_grad_norm_ after the backward (see DataParallel::clip_grad_norm).
  double clip_grad_norm(double max_norm, float inv_grad_scale = 1.0f) {
    check<StateError>(finished(),
                      "clip_grad_norm before a synchronised backward finished the gradients; "
                      "run the backward and finish() first");
    return optimizer_->clip_grad_norm(piece_grads_, max_norm, inv_grad_scale);
  }

  // The loss-scaled step (see DataParallel::step(lr, scaler)): skipped on every rank when some
  // rank's gradient shard is not finite. Returns whether it stepped. Collective.
  bool step(float lr, optim::DynamicLossScaler& scaler) {
    for (const auto& unit : units_)
      check<StateError>(unit->bucketer->finished(),
                        "FSDP step before a synchronised backward finished the gradients of "
                        "unit '",
                        unit->name, "'; run the backward (outside no_sync) and finish() first");
    const bool finite = scaler.grads_finite(*ctx_, comm_, piece_grads_);
    const float inv_scale = scaler.inv_scale();
    scaler.update(!finite);
    if (!finite) {
      optimizer_->discard_clip();
      return false;
    }
    optimizer_->step(piece_grads_, lr, inv_scale);
    normalize_rows_of_step();
    return true;
  }

  const optim::ShardedOptimizer& optimizer() const { return *optimizer_; }
  // After finish(): the averaged gradient of each piece this rank updates (its shards).
  const std::vector<Tensor>& piece_grads() const { return piece_grads_; }
  optim::ShardedOptimizer& optimizer() { return *optimizer_; }
  // Offload: the host context of the optimizer (and of the parameter shards with
  // offload.params); its memory statistics are the host's share. Without offload, the engine's
  // own context.
  Context& host_context() const { return optimizer_->host_context(); }

  // What checkpoints save and load (io/checkpoint.hpp): the shards and their optimizer state.
  // A load writes the shards; units gathered at that moment (inside full_params()) are
  // gathered again so their full values are the loaded ones.
  TrainingState training_state() {
    TrainingState state;
    state.optimizer = optimizer_.get();
    state.comm = comm_;
    state.replicas = replicas_;
    state.after_load = [this] {
      for (auto& unit : units_)
        if (unit->group->gathered()) unit->group->gather().wait();
    };
    state.stage = "fsdp";
    return state;
  }
  const shard::PieceTable& table() const { return table_; }
  // The ranks this engine shards over (the shard group under hybrid sharding).
  comm::Communicator& communicator() const { return *comm_; }
  // Hybrid sharding's other groups (nullptr without hybrid sharding).
  comm::Communicator* replicas() const { return replicas_; }

 private:
  struct Unit {
    std::string name;
    std::size_t first_param = 0;
    std::size_t first_piece = 0;  // its pieces' first index in the optimizer's piece list
    std::unique_ptr<FlatParamGroup> group;
    std::unique_ptr<parallel::GradBucketer> bucketer;
    std::vector<shard::ParamPiece> pieces;
    std::vector<bool> ready;
    std::size_t ready_count = 0;
    comm::Work pending;  // an all-gather started ahead of use (prefetch)
    bool gathering = false;
  };
  struct ParamIndex {
    std::size_t unit;
    std::size_t local;
  };

  static ResolvedPolicy checked(const ParallelOptions& options) {
    check(options.stage == Stage::fsdp, "FsdpEngine runs fsdp (ZeRO-3), but options.stage is ",
          stage_name(options.stage),
          "; set options.stage = Stage::fsdp, or use DataParallel for ddp, oss and sdp");
    return resolve(options);
  }

  Unit& unit_at(std::size_t u) {
    check(u < units_.size(), "FSDP unit ", u, " does not exist; there are ", units_.size());
    return *units_[u];
  }
  const Unit& unit_at(std::size_t u) const { return const_cast<FsdpEngine*>(this)->unit_at(u); }
  ParamIndex index_of(std::size_t i, const char* call) const {
    check(i < index_.size(), "FSDP ", call, "(", i, "): no such parameter; there are ",
          index_.size());
    return index_[i];
  }

  static std::string not_gathered_reason(const Unit& unit) {
    return "the parameters of FSDP unit '" + unit.name +
           "' are not gathered: they exist only during the unit's forward and backward; run "
           "the module (its hooks gather them), or call gather() in a custom loop";
  }
  void release_unit(Unit& unit) {
    if (unit.gathering) {  // a prefetch nobody used: complete it before freeing its buffer
      unit.pending.wait();
      unit.gathering = false;
    }
    unit.group->release(not_gathered_reason(unit));
  }

  // Every rank must have the same units with the same parameters, or collectives would pair
  // up wrongly: one fingerprint of every unit name and parameter, before any unit's traffic.
  void check_same_everywhere() {
    std::vector<shard::ParamSpec> all;
    for (const auto& unit : units_) {
      all.push_back(shard::ParamSpec{"unit:" + unit->name, {1}, false});
      for (const auto& slot : unit->group->plan().layout().slots())
        all.push_back(shard::ParamSpec{slot.name, slot.shape, slot.trainable});
    }
    const std::string_view what =
        "the FSDP units differ between ranks (unit names, parameter names, shapes or frozen "
        "flags); build the same model and wrap policy on every rank";
    const std::uint64_t print = shard::ParamLayout(all).fingerprint();
    check_same_fingerprint(*ctx_, *comm_, print, what);
    if (replicas_ != nullptr && replicas_->size() > 1)
      check_same_fingerprint(*ctx_, *replicas_, print, what);
  }

  Context* ctx_;
  comm::Communicator* comm_;
  comm::Communicator* replicas_;  // hybrid sharding's other groups (nullptr: none)
  ResolvedPolicy policy_;
  std::unique_ptr<Context> host_;  // offload: the host side (else null); before the units
  shard::PieceTable table_;
  std::unique_ptr<parallel::ReduceScatterCoalescer> coalescer_;  // before the units' bucketers
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<ParamIndex> index_;
  std::vector<Tensor> piece_grads_;
  std::unique_ptr<optim::ShardedOptimizer> optimizer_;
  std::vector<RowNormalization> row_normalized_;  // normalize_rows_after_step

  void normalize_rows_of_step() {
    for (const auto& rows : row_normalized_)
      normalize_owned_rows(*ctx_, *optimizer_, comm_, rows.name, rows.eps);
  }
};

}  // namespace shardkit::parallel
