// ParamGroups: an engine's param groups (param_group.hpp) -- one for ddp, oss and sdp, one per
// unit for fsdp -- with the parameters numbered across them in order (group 0's, then group
// 1's, ...), and what a backward does to them: gather and release (no-ops on replicated
// groups), add gradients and mark them ready, wait for the reductions. The Engine (engine.hpp)
// adds the optimizer and the step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/parallel/collectives.hpp"
#include "shardkit/parallel/offload.hpp"
#include "shardkit/parallel/param_group.hpp"
#include "shardkit/parallel/tensor_scales.hpp"

namespace shardkit::parallel {

class ParamGroups {
 public:
  ParamGroups(Context& ctx, comm::Communicator& comm, comm::Communicator* replicas,
              std::vector<ParamGroupSpec> groups, ResolvedPolicy policy)
      : policy_(std::move(policy)),
        ctx_(&ctx),
        host_(offload_context(ctx, policy_.offload)),
        disk_(disk_context(ctx, policy_.offload)) {
    check<StateError>(!ctx.defers_parameters(),
                      "an engine (ShardedModule, DataParallel, FsdpEngine) built inside a "
                      "DeferredParameters scope: its flat buffers need memory; end the scope "
                      "after building the model, before wrapping it");
    check(!groups.empty(), "no parameter group to train; give at least one");
    // (offload.params: the shards in host memory, or in files beside the optimizer's state
    // under offload to NVMe -- ZeRO-Infinity's offload_param device "nvme")
    Context* shard_home = !policy_.offload.params ? nullptr : disk_ ? disk_.get() : host_.get();
    // Offload with reduce-scattered gradients (sdp, fsdp): the rank's reduced gradients are
    // kept on the host, where the offloaded step reads them (ddp and oss all-reduce whole
    // buffers on the device, which the step's staging then brings down).
    if (host_ && policy_.grad_sync == GradSync::reduce_scatter) grads_home_ = host_.get();
    if (policy_.coalesce_bytes > 0)
      coalescer_ = std::make_unique<ReduceScatterCoalescer>(ctx, comm, policy_.coalesce_bytes);
    if (policy_.reshard_group > 0) node_ = split_nodes(comm, replicas, policy_.reshard_group);
    for (auto& spec : groups) {
      if (policy_.residency == Residency::sharded) check_unit(spec);
      first_param_.push_back(index_.size());
      for (std::size_t i = 0; i < spec.params.size(); ++i) index_.push_back({groups_.size(), i});
      groups_.push_back(std::make_unique<ParamGroup>(ctx, comm, std::move(spec), policy_, replicas,
                                                     shard_home, coalescer_.get(), node_.get(),
                                                     grads_home_));
    }
    if (policy_.residency == Residency::sharded && policy_.quantized_gather_block > 0 &&
        policy_.quantized_gather_scale == ops::QuantScale::tensor) {
      std::vector<FlatParam*> flats;
      for (auto& group : groups_) flats.push_back(&group->flat());
      scales_ = std::make_unique<TensorScales>(comm, std::move(flats));
      for (std::size_t u = 0; u < groups_.size(); ++u)
        groups_[u]->use_tensor_scales(scales_.get(), u);
    }
  }

  ParamGroups(const ParamGroups&) = delete;
  ParamGroups& operator=(const ParamGroups&) = delete;

  const ResolvedPolicy& policy() const { return policy_; }
  Stage stage() const { return policy_.stage; }
  std::size_t unit_count() const { return groups_.size(); }
  const ParamGroup& group(std::size_t u) const { return *groups_[checked_unit(u)]; }
  const std::string& unit_name(std::size_t u) const { return group(u).name(); }
  std::size_t param_count() const { return index_.size(); }
  std::size_t unit_of(std::size_t i) const { return index_of(i, "unit_of").group; }
  // Parameter i's full values (a view of its group's buffer; under fsdp only while gathered).
  const Tensor& param(std::size_t i) const {
    const auto at = index_of(i, "param");
    return groups_[at.group]->param(at.local);
  }

  // --- gather / release (no-ops on replicated groups) ------------------------------------------
  // Under offload to NVMe with the shards on disk, starts reading unit u's shard for its next
  // gather, beside the work before it; a no-op otherwise (param_group.hpp). One read ahead at a
  // time: another unit's that no gather has used yet is dropped first, so RAM holds at most
  // one shard read ahead beside the one in a gather (the planner's disk_streaming), whatever
  // order the calls come in.
  void read_shard_ahead(std::size_t u) {
    checked_unit(u);
    if (read_ahead_unit_ < groups_.size() && read_ahead_unit_ != u)
      groups_[read_ahead_unit_]->flat().drop_read_ahead();  // (a no-op once gathered)
    groups_[u]->read_shard_ahead();
    read_ahead_unit_ = u;
  }
  // Starts unit u's all-gather without waiting (prefetch); no-op when gathered or gathering.
  void start_gather(std::size_t u) { groups_[checked_unit(u)]->start_gather(); }
  // Unit u's full parameters, gathered (waits for a prefetch in flight).
  void gather(std::size_t u) { groups_[checked_unit(u)]->gather(); }
  // Unit u's full parameters with the shards' exact values, also under qwZ.
  void gather_exact(std::size_t u) { groups_[checked_unit(u)]->gather_exact(); }
  // Frees unit u's full parameters (a prefetch nobody used is completed first).
  void release(std::size_t u) { groups_[checked_unit(u)]->release(); }
  // The same after u's training forward: with hpZ (fsdp.reshard_group_size) this rank keeps its
  // slice over the node, and u's next gather (its backward's) stays inside the node.
  void release_after_forward(std::size_t u) { groups_[checked_unit(u)]->release_after_forward(); }
  // The shards' reads from disk, summed over the units (offload.params with nvme_path; zeros
  // otherwise): how much the reads ahead took off the gathers (FlatParam::ShardReads).
  FlatParam::ShardReads shard_reads() const {
    FlatParam::ShardReads sum;
    for (const auto& group : groups_) {
      const auto& reads = group->flat().shard_reads();
      sum.ahead += reads.ahead;
      sum.at_gather += reads.at_gather;
      sum.wait_seconds += reads.wait_seconds;
    }
    return sum;
  }
  // hpZ's node communicator (nullptr: none).
  comm::Communicator* node() const { return node_.get(); }
  bool holds_full(std::size_t u) const { return group(u).holds_full(); }

  // --- gradients -------------------------------------------------------------------------------
  // Where the backward adds (+=) parameter i's gradient (valid until ready(i)).
  Tensor grad(std::size_t i) {
    const auto at = index_of(i, "grad");
    return groups_[at.group]->grad(at.local);
  }
  // Parameter i's gradient is final for this backward; complete buckets are reduced. When a
  // sharded group's last gradient arrives, the finished reductions of every group free their
  // buffers, so finished units do not hold them to the end of the backward.
  void ready(std::size_t i) {
    const auto at = index_of(i, "ready");
    ParamGroup& group = *groups_[at.group];
    group.ready(at.local);
    if (group.flat().sharded() && group.all_ready()) poll_reductions();
  }
  bool is_ready(std::size_t i) const {
    const auto at = index_of(i, "is_ready");
    return groups_[at.group]->is_ready(at.local);
  }
  // Every gradient of unit u is final in this backward.
  bool unit_ready(std::size_t u) const { return group(u).all_ready(); }
  // Frees the buffers of the reductions that completed, in every group (never blocks).
  void poll_reductions() {
    for (auto& group : groups_) group->poll();
  }
  // Waits for every reduction: the pieces' averaged gradients are in place (kept on the host:
  // their copies down waited for, one wait for every group, none after a no_sync backward).
  // Throws if a trainable parameter was never marked ready.
  void finish() {
    ++finished_backwards_;
    if (grads_home_ != nullptr)
      ctx_->refuse_in_capture(
          "a backward of an offloaded optimizer (its gradients go to the "
          "host, which waits for them)",
          "capture steps without CPU offload, or run them eagerly");
    for (auto& group : groups_) group->finish();
    if (grads_home_ == nullptr) return;
    if (std::none_of(groups_.begin(), groups_.end(),
                     [](const auto& group) { return group->copies_pending(); }))
      return;
    // (a deferred check may throw from the wait, after the stream drained: the copies are
    // there, and the gradients are landed before the error goes on)
    try {
      ctx_->synchronize();
    } catch (...) {
      for (auto& group : groups_) group->land_copies();
      throw;
    }
    for (auto& group : groups_) group->land_copies();
  }
  // Where the pieces' averaged gradients live: the engine's context, or under offload with
  // reduce-scattered gradients (sdp, fsdp) the host context. Ops on them run there.
  Context& grads_context() const { return grads_home_ != nullptr ? *grads_home_ : *ctx_; }
  bool finished() const {
    for (const auto& group : groups_)
      if (!group->finished()) return false;
    return true;
  }
  // A backward is under way in some group -- or was cut short by an exception, until
  // zero_grad() closes it.
  bool backward_open() const {
    return std::any_of(groups_.begin(), groups_.end(),
                       [](const auto& group) { return group->backward_open(); });
  }
  // qgZ's error feedback carried in loss-scaled units: follows the loss scale's update
  // (`state` on the device, ops/step_gate.hpp), or is dropped after a skipped step.
  void follow_loss_scale(const Tensor& state) {
    for (auto& group : groups_) group->follow_loss_scale(state);
  }
  // qgZ's error feedback from zero again, as in a new run (a checkpoint's load).
  void reset_error_feedback() {
    for (auto& group : groups_) group->reset_error_feedback();
  }
  // Every group or none: refused before any switches while a backward is open (a group left
  // switched alone would never reduce again, and every later step be refused).
  void set_sync(bool enabled) {
    check<StateError>(!backward_open(),
                      "no_sync: gradient sync switches only between backwards, and one is open "
                      "(unfinished, or cut short by an exception); call zero_grad() first");
    for (auto& group : groups_) group->set_sync(enabled);
  }
  bool sync_enabled() const { return groups_.front()->sync_enabled(); }  // (every group's)
  // Gradient accumulation: while the scope lives, backwards accumulate locally (no traffic);
  // the next synchronised backward reduces the sums. Scopes nest: the setting before the scope
  // comes back when it ends (PyTorch's no_sync), and an exception leaving the scope mid-backward
  // leaves its error, not one of the switch's.
  class NoSync {
   public:
    explicit NoSync(ParamGroups& groups)
        : groups_(&groups),
          previous_(groups.sync_enabled()),
          uncaught_at_start_(std::uncaught_exceptions()) {
      groups_->set_sync(false);
    }
    ~NoSync() noexcept(false) {
      if (std::uncaught_exceptions() > uncaught_at_start_) {
        // (a backward cut short in the scope stays open until zero_grad() abandons it: the
        // setting comes back without the check between backwards, and without throwing)
        for (auto& group : groups_->groups_) group->restore_sync(previous_);
        return;
      }
      groups_->set_sync(previous_);
    }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ParamGroups* groups_;
    bool previous_;
    int uncaught_at_start_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

 protected:
  // How many backwards finish() has closed (clip_grad_norm notes which one it measured).
  std::uint64_t finished_backwards() const { return finished_backwards_; }

  // Every group's gradients from zero (Engine::zero_grad also starts the optimizer's read
  // ahead: callers go through it). A backward cut short by an exception is closed first
  // (abandon_backward).
  void zero_grad() {
    if (backward_open()) abandon_backward();
    for (auto& group : groups_) group->zero_grad();
  }
  // Closes a backward cut short by an exception (in a node, a hook, a gather, a reduction):
  // the calls a coalescer held back are dropped unlaunched, the reductions launched are waited
  // for and their results dropped, the ready marks cleared, and the units gathered for it
  // freed. qgZ's error feedback starts from zero again (its residuals took in gradients that
  // are now dropped). Ranks cut short at the same point -- every rank's same failure, or one
  // rank training alone -- then train on as if the backward had never run; a rank cut short
  // alone leaves the others waiting in collectives it never issues, which their timeout names.
  void abandon_backward() {
    if (coalescer_) coalescer_->drop_held();
    std::exception_ptr first_error;
    for (auto& group : groups_) {
      try {
        group->abandon_backward();
        group->release();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    reset_error_feedback();
    if (first_error) std::rethrow_exception(first_error);
  }
  // The offload host context (nullptr without offload): where the optimizer's state lives and,
  // under offload.params, the shards.
  Context* host() const { return host_.get(); }
  // Offload to NVMe's disk context (nullptr otherwise): where the master and state live then,
  // and under offload.params the shards.
  Context* disk() const { return disk_.get(); }
  // The units' shards when they live on disk (offload.params with nvme_path), else none.
  std::vector<Tensor> shards_on_disk() const {
    std::vector<Tensor> shards;
    if (disk_ && policy_.offload.params)
      for (const auto& group : groups_) shards.push_back(group->shard());
    return shards;
  }
  ParamGroup& mutable_group(std::size_t u) { return *groups_[u]; }
  std::size_t first_param(std::size_t u) const { return first_param_[u]; }
  // The shards are about to change (a step, a load, values written): hpZ's slices kept over
  // the node since a forward, and per-tensor qwZ's maxima, would be stale; a shard read ahead
  // from disk and not gathered is dropped (the step streams the shards itself).
  void shards_will_change() {
    for (auto& group : groups_) {
      group->forget_node_slice();
      group->flat().drop_read_ahead();  // (the step streams the shards: none read beside it)
    }
    if (scales_) scales_->forget();
  }

  // Every rank must hold the same groups with the same parameters, or collectives would pair
  // up wrongly: one fingerprint of every group name and parameter, before any traffic.
  void check_same_everywhere() {
    if (groups_.size() == 1 && !groups_[0]->flat().sharded())
      return check_same_layout(groups_[0]->flat(), groups_[0]->plan().layout().fingerprint(),
                               "the parameter list differs between ranks (names, shapes, order "
                               "or trainable flags); build the same model on every rank");
    std::vector<shard::ParamSpec> all;
    for (const auto& group : groups_) {
      all.push_back(shard::ParamSpec{"unit:" + group->name(), {1}, false});
      for (const auto& slot : group->plan().layout().slots())
        all.push_back(shard::ParamSpec{slot.name, slot.shape, slot.trainable});
    }
    check_same_layout(groups_[0]->flat(), shard::ParamLayout(all).fingerprint(),
                      "the FSDP units differ between ranks (unit names, parameter names, shapes "
                      "or frozen flags); build the same model and wrap policy on every rank");
  }

 private:
  struct ParamIndex {
    std::size_t group;
    std::size_t local;
  };

  std::size_t checked_unit(std::size_t u) const {
    check(u < groups_.size(), "unit ", u, " does not exist; there are ", groups_.size());
    return u;
  }
  ParamIndex index_of(std::size_t i, const char* call) const {
    check(i < index_.size(), call, "(", i, "): no such parameter; there are ", index_.size());
    return index_[i];
  }
  // hpZ's groups of `size` consecutive ranks (a node): a split of `comm`, collective.
  static std::unique_ptr<comm::Communicator> split_nodes(comm::Communicator& comm,
                                                         comm::Communicator* replicas, int size) {
    check(replicas == nullptr || replicas->size() <= 1,
          "fsdp.reshard_group_size with hybrid sharding: the shard group already keeps the "
          "gathers inside it; leave reshard_group_size 0 (or shard over the whole world)");
    check(size <= comm.size() && comm.size() % size == 0, "fsdp.reshard_group_size is ", size,
          " but the world has ", comm.size(),
          " ranks; pass a divisor of the world size (the ranks of one node)");
    return comm.split(comm.rank() / size, comm.rank());
  }

  // A unit of sharded groups: at least one parameter, every one trainable (frozen parameters
  // stay outside the units, whole on every rank).
  static void check_unit(const ParamGroupSpec& spec) {
    check(!spec.params.empty(), "FSDP unit '", spec.name,
          "' has no parameter; give every unit at least one");
    for (const auto& p : spec.params)
      check(p.trainable, "parameter '", p.name, "' of FSDP unit '", spec.name,
            "' is frozen; keep frozen parameters outside the units (whole on every rank)");
  }

  ResolvedPolicy policy_;
  Context* ctx_;
  std::unique_ptr<Context> host_;                      // offload (else null); before the groups
  Context* grads_home_ = nullptr;                      // host_ where it keeps the gradients
  std::unique_ptr<Context> disk_;                      // offload to NVMe (else null)
  std::unique_ptr<ReduceScatterCoalescer> coalescer_;  // before the groups' bucketers
  std::unique_ptr<comm::Communicator> node_;           // hpZ (else null); before the groups
  std::vector<std::unique_ptr<ParamGroup>> groups_;
  std::unique_ptr<TensorScales> scales_;  // per-tensor qwZ (else null); after the groups it reads
  std::vector<std::size_t> first_param_;  // per group
  std::vector<ParamIndex> index_;
  std::size_t read_ahead_unit_ = SIZE_MAX;  // the unit read ahead last (SIZE_MAX: none)
  std::uint64_t finished_backwards_ = 0;
};

}  // namespace shardkit::parallel
