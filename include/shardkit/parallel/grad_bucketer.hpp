// GradBucketer: the user's backward adds each gradient into grad(i) and calls ready(i), in any
// order; buckets (bucket_plan.hpp) go out asynchronously the moment all their gradients are
// ready, in bucket order, with at most max_in_flight in flight. How a bucket is reduced is one
// of two strategies:
//
//   AllReduceGrads (DDP, OSS): a persistent full gradient buffer laid out bucket after bucket;
//     each bucket is averaged in place (no copies).
//   ReduceScatterGrads (SDP, FSDP): a rank keeps only the gradients it owns, laid out bucket
//     after bucket. A bucket's gradients live in a transient buffer (MemoryCategory::
//     communication) allocated when the backward first asks for one of its gradients;
//     reduce_scatter_v averages each rank's part straight into that rank's owned gradients, and
//     the buffer is freed once done. With a coalescer (FSDP), small buckets of many bucketers
//     travel together (reduce_scatter_coalescer.hpp).
//
// Accumulation over synchronised backwards (no zero_grad between them) adds the average of the
// new local gradients to the averages already held: A + avg(g), exactly as a sharded
// accumulation computes it, never avg(A + g) (which rounds differently). Once the buffers hold
// averages, a backward's gradients therefore go to transient bucket buffers whose reduction is
// added in. Local accumulation (no_sync) sums before the one reduction: avg(g1 + g2).
//
// Gradients are kept in grad_dtype (f32, or the compute dtype under mixed precision) and may
// travel in another wire_dtype: the bucket is cast for the wire and back.
//
// Hybrid sharding (comm/hybrid_mesh.hpp): `comm` is the shard group and `replicas` the ranks
// holding the same shard in the other groups. A bucket is then summed inside the group (the
// reduce-scatter or all-reduce above); at finish() its reduced part is summed across the groups
// (an all-reduce on replicas, the only inter-group traffic) and divided by the world size once:
// the same arithmetic as one average over the world, so gradients whose sums are exact give
// DDP's bits. A 16-bit wire averages at each level instead, so the sums cannot overflow.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/reduce_scatter_coalescer.hpp"
#include "shardkit/shard/bucket_plan.hpp"

namespace shardkit::parallel {

// The runtime state of one bucket during a backward.
struct BucketState {
  comm::Work work;
  bool launched = false;
  Tensor buffer;  // the bucket's gradients (a view of the full buffer, or transient)
  Tensor wire;    // low-precision copy on the wire, when wire_dtype is not f32
  Tensor out;     // where the reduction lands when that is not its final place
};

// How a bucket's gradients are stored and reduced.
class GradSyncStrategy {
 public:
  virtual ~GradSyncStrategy() = default;
  // Where the backward adds gradient `param` (a view inside bucket `b`'s storage).
  virtual Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) = 0;
  virtual void launch(std::size_t b, BucketState& state) = 0;
  virtual void complete(std::size_t b, BucketState& state) = 0;
  // The averaged gradient of a piece this rank updates (after the backward is finished).
  virtual Tensor piece_grad(const shard::ParamPiece& piece) const = 0;
  // Clears the gradients; afterwards a reduction lands in place again.
  virtual void zero(std::vector<BucketState>& states) = 0;
  // Hybrid sharding: after every bucket completed, the exchange across groups (ReplicaSync).
  virtual void exchange_replicas() = 0;
  // The buffers hold averaged gradients of an earlier synchronised backward: the next
  // reductions are added to them.
  void set_holds_averages(bool value) { holds_averages_ = value; }
  bool holds_averages() const { return holds_averages_; }

 private:
  bool holds_averages_ = false;
};

namespace detail {

inline Tensor cast_for_wire(Context& ctx, const Tensor& values, DType wire_dtype) {
  Tensor wire = empty(ctx, values.shape(), wire_dtype, MemoryCategory::communication);
  copy(ctx, wire, values);
  return wire;
}

}  // namespace detail

// The second level of a hybrid reduction (inactive when `replicas` is null). The group's
// collective sums (or, on a 16-bit wire, averages) a bucket; its reduced part is held, not yet
// merged into the gradients, until finish(): then every held part is all-reduced across the
// groups in bucket order, divided by the world size, and merged. The exchange waits for
// finish() because buckets complete in an order that depends on timing (FSDP polls many
// units' buckets) while the ranks of a replica group must issue their all-reduces in the same
// order; and the merge waits for the exchange so that no group sum is rounded to a 16-bit
// gradient, or added to held averages, before it is the world's. (A part that did not land in
// place -- 16-bit gradients, accumulation -- stays allocated until then: up to 1/G of the
// gradients in transient memory.)
class ReplicaSync {
 public:
  ReplicaSync(comm::Communicator& group, comm::Communicator* replicas, std::size_t buckets)
      : replicas_(replicas != nullptr && replicas->size() > 1 ? replicas : nullptr),
        world_size_(group.size() * (replicas_ != nullptr ? replicas_->size() : 1)),
        held_(replicas_ != nullptr ? buckets : 0) {}

  bool active() const { return replicas_ != nullptr; }
  comm::ReduceOp group_op(DType wire) const {
    return active() && wire == DType::f32 ? comm::ReduceOp::sum : comm::ReduceOp::avg;
  }
  // Keeps bucket b's group-reduced part (in the wire dtype) for exchange().
  void hold(std::size_t b, const Tensor& reduced) { held_[b] = reduced; }
  // All-reduces every held part across the groups (issued together, in bucket order), then
  // hands each, as the world's average, to merge(b, part) in bucket order.
  template <class Merge>
  void exchange(Context& ctx, Merge&& merge) {
    if (!active()) return;
    std::vector<comm::Work> works(held_.size());
    for (std::size_t b = 0; b < held_.size(); ++b)
      if (held_[b].defined() && held_[b].numel() > 0)
        comm::assign(works[b],
                     replicas_->all_reduce(
                         held_[b], summed(held_[b]) ? comm::ReduceOp::sum : comm::ReduceOp::avg));
    for (std::size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].defined()) continue;
      works[b].wait();
      if (summed(held_[b])) divide_(ctx, held_[b], static_cast<double>(world_size_));
      merge(b, held_[b]);
      held_[b] = Tensor();
    }
  }
  void clear() {
    for (auto& part : held_) part = Tensor();
  }

 private:
  static bool summed(const Tensor& part) { return part.dtype() == DType::f32; }

  comm::Communicator* replicas_;
  int world_size_;
  std::vector<Tensor> held_;  // per bucket: its group-reduced part until the exchange
};

class AllReduceGrads final : public GradSyncStrategy {
 public:
  AllReduceGrads(Context& ctx, comm::Communicator& comm, const shard::BucketPlan& plan,
                 DType grad_dtype, DType wire_dtype, comm::Communicator* replicas)
      : ctx_(&ctx),
        comm_(&comm),
        replicas_(comm, replicas, plan.buckets().size()),
        plan_(&plan),
        grad_dtype_(grad_dtype),
        wire_dtype_(wire_dtype),
        full_(zeros(ctx, {plan.total_numel()}, grad_dtype, MemoryCategory::gradients)) {}

  Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) override {
    if (!holds_averages()) return full_.flat_view(plan_->buckets()[b].base + at, shape);
    if (!state.buffer.defined()) state.buffer = transient(b);
    return state.buffer.flat_view(at, shape);
  }
  void launch(std::size_t b, BucketState& state) override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    if (!holds_averages())
      state.buffer = full_.slice(0, bucket.base, bucket.base + bucket.numel);
    else if (!state.buffer.defined())
      state.buffer = transient(b);  // nothing was asked: all zero
    const comm::ReduceOp op = replicas_.group_op(wire_dtype_);
    if (wire_dtype_ != grad_dtype_) {
      state.wire = detail::cast_for_wire(*ctx_, state.buffer, wire_dtype_);
      comm::assign(state.work, comm_->all_reduce(state.wire, op));
    } else {
      comm::assign(state.work, comm_->all_reduce(state.buffer, op));
    }
  }
  void complete(std::size_t b, BucketState& state) override {
    const Tensor& reduced = state.wire.defined() ? state.wire : state.buffer;
    if (replicas_.active())
      replicas_.hold(b, reduced);
    else
      merge(b, reduced);
  }
  void exchange_replicas() override {
    replicas_.exchange(*ctx_, [&](std::size_t b, const Tensor& part) { merge(b, part); });
  }
  Tensor piece_grad(const shard::ParamPiece& piece) const override {
    const shard::GradBucket& bucket = plan_->buckets()[plan_->bucket_of(piece.param)];
    const std::int64_t at = bucket.base + plan_->position_of(piece.param) + piece.param_begin;
    return full_.slice(0, at, at + piece.numel());
  }
  void zero(std::vector<BucketState>& states) override {
    fill(*ctx_, full_, 0.0);
    for (auto& state : states) state.buffer = Tensor();
    replicas_.clear();
  }

 private:
  // Bucket b's averaged gradients, `reduced`, into their place.
  void merge(std::size_t b, const Tensor& reduced) {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    const Tensor target = full_.slice(0, bucket.base, bucket.base + bucket.numel);
    if (holds_averages())
      add_(*ctx_, target, reduced);
    else if (reduced.data_ptr() != target.data_ptr())
      copy(*ctx_, target, reduced);
  }

  Tensor transient(std::size_t b) const {
    return zeros(*ctx_, {plan_->buckets()[b].numel}, grad_dtype_, MemoryCategory::communication);
  }

  Context* ctx_;
  comm::Communicator* comm_;
  ReplicaSync replicas_;
  const shard::BucketPlan* plan_;
  DType grad_dtype_;
  DType wire_dtype_;
  Tensor full_;  // every gradient, bucket after bucket
};

class ReduceScatterGrads final : public GradSyncStrategy {
 public:
  ReduceScatterGrads(Context& ctx, comm::Communicator& comm, const shard::BucketPlan& plan,
                     DType grad_dtype, DType wire_dtype, ReduceScatterCoalescer* coalescer,
                     comm::Communicator* replicas)
      : ctx_(&ctx),
        comm_(&comm),
        replicas_(comm, replicas, plan.buckets().size()),
        plan_(&plan),
        grad_dtype_(grad_dtype),
        wire_dtype_(wire_dtype),
        coalescer_(coalescer),
        owned_(zeros(ctx, {plan.owned_numel()}, grad_dtype, MemoryCategory::gradients)) {}

  Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) override {
    if (!state.buffer.defined()) state.buffer = transient(b);
    return state.buffer.flat_view(at, shape);
  }
  void launch(std::size_t b, BucketState& state) override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    if (!state.buffer.defined()) state.buffer = transient(b);  // nothing was asked: all zero
    const Tensor target = owned_.slice(0, bucket.own_offset, bucket.own_offset + bucket.own_numel);
    const Tensor& send =
        wire_dtype_ != grad_dtype_
            ? (state.wire = detail::cast_for_wire(*ctx_, state.buffer, wire_dtype_))
            : state.buffer;
    if (wire_dtype_ != grad_dtype_ || holds_averages())
      state.out = empty(*ctx_, {bucket.own_numel}, send.dtype(), MemoryCategory::communication);
    const Tensor& recv = state.out.defined() ? state.out : target;
    const comm::ReduceOp op = replicas_.group_op(wire_dtype_);
    if (coalescer_ != nullptr && send.nbytes() < coalescer_->capacity_bytes())
      comm::assign(state.work, coalescer_->submit(send, recv, bucket.counts, op));
    else
      comm::assign(state.work, comm_->reduce_scatter_v(send, recv, bucket.counts, op));
  }
  void complete(std::size_t b, BucketState& state) override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    const Tensor reduced = state.out.defined() ? state.out
                                               : owned_.slice(0, bucket.own_offset,
                                                              bucket.own_offset + bucket.own_numel);
    if (replicas_.active())
      replicas_.hold(b, reduced);
    else
      merge(b, reduced);
  }
  void exchange_replicas() override {
    replicas_.exchange(*ctx_, [&](std::size_t b, const Tensor& part) { merge(b, part); });
  }
  Tensor piece_grad(const shard::ParamPiece& piece) const override {
    const std::int64_t offset = plan_->owned_offset_of(piece);
    return owned_.slice(0, offset, offset + piece.numel());
  }
  void zero(std::vector<BucketState>& states) override {
    fill(*ctx_, owned_, 0.0);
    for (auto& state : states) state.buffer = Tensor();
    replicas_.clear();
  }

 private:
  // Bucket b's averaged part, `reduced`, into this rank's gradients (a reduction that landed
  // in place is already there).
  void merge(std::size_t b, const Tensor& reduced) {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    if (reduced.numel() == 0) return;
    const Tensor target = owned_.slice(0, bucket.own_offset, bucket.own_offset + bucket.own_numel);
    if (reduced.data_ptr() == target.data_ptr()) return;
    if (holds_averages())
      add_(*ctx_, target, reduced);
    else
      copy(*ctx_, target, reduced);
  }

  Tensor transient(std::size_t b) const {
    return zeros(*ctx_, {plan_->buckets()[b].numel}, grad_dtype_, MemoryCategory::communication);
  }

  Context* ctx_;
  comm::Communicator* comm_;
  ReplicaSync replicas_;
  const shard::BucketPlan* plan_;
  DType grad_dtype_;
  DType wire_dtype_;
  ReduceScatterCoalescer* coalescer_;  // small buckets go out with others (nullptr: alone)
  Tensor owned_;                       // this rank's parts, bucket after bucket
};

class GradBucketer {
 public:
  // `coalescer` (reduce_scatter only, optional): buckets smaller than its capacity are reduced
  // together with other bucketers' (FSDP's many units). `replicas` (optional): hybrid
  // sharding's other groups, `comm` being this rank's shard group.
  // `policy` (policy.hpp: resolve() checked it) sets the bucket capacity, the buckets in
  // flight and the gradients' dtypes: kept in grad_dtype, travelling in wire_dtype.
  GradBucketer(Context& ctx, comm::Communicator& comm, const shard::ShardPlan& plan, GradSync sync,
               const BucketPolicy& policy, ReduceScatterCoalescer* coalescer = nullptr,
               comm::Communicator* replicas = nullptr)
      : plan_(&plan),
        sync_(sync),
        buckets_(checked_plan(plan, comm), comm.rank(), policy.capacity),
        schedule_(buckets_.items_per_bucket(), policy.max_in_flight),
        states_(buckets_.buckets().size()) {
    if (sync == GradSync::all_reduce)
      strategy_ = std::make_unique<AllReduceGrads>(ctx, comm, buckets_, policy.grad_dtype,
                                                   policy.wire_dtype, replicas);
    else
      strategy_ = std::make_unique<ReduceScatterGrads>(ctx, comm, buckets_, policy.grad_dtype,
                                                       policy.wire_dtype, coalescer, replicas);
    ready_.assign(plan.layout().size(), false);
    for (const auto& slot : plan.layout().slots()) trainable_ += slot.trainable ? 1 : 0;
  }

  GradBucketer(const GradBucketer&) = delete;
  GradBucketer& operator=(const GradBucketer&) = delete;

  // Where backward adds (+=) parameter i's gradient for this backward.
  Tensor grad(std::size_t i) {
    const auto& slot = slot_of(i, "grad");
    const std::size_t b = buckets_.bucket_of(i);
    return strategy_->grad(b, states_[b], buckets_.position_of(i), slot.shape);
  }

  // Marks parameter i's gradient final for this backward; launches every bucket that is now
  // complete and next in order.
  void ready(std::size_t i) {
    const auto& slot = slot_of(i, "ready");
    check(!ready_[i], "the gradient of '", slot.name,
          "' was marked ready twice in one backward; mark each parameter once, then finish()");
    ready_[i] = true;
    ++ready_count_;
    schedule_.ready(buckets_.bucket_of(i));
    if (sync_enabled_) advance();
  }

  // Whether parameter i's gradient is final in this backward; whether every one is.
  bool is_ready(std::size_t i) const { return i < ready_.size() && ready_[i]; }
  bool all_ready() const { return ready_count_ == trainable_; }

  // Completes the launched buckets whose reductions are done, in order, freeing their
  // transient buffers (never blocks). FSDP calls it as the backward moves through other units,
  // so a unit's last buckets do not stay allocated until the end of the backward.
  void poll() {
    schedule_.collect([&](std::size_t b) { complete(b); },
                      [&](std::size_t b) { return states_[b].work.test(); });
  }

  // Waits for every bucket. Afterwards the averaged gradients of this rank's pieces are in
  // piece_grad(). Throws if a trainable parameter was never marked.
  void finish() {
    for (std::size_t i = 0; i < ready_.size(); ++i)
      if (plan_->layout()[i].trainable && !ready_[i])
        fail<StateError>("finish(): the gradient of '", plan_->layout()[i].name,
                         "' was never marked ready in this backward; call ready() for every "
                         "trainable parameter (a parameter the loss does not reach has a zero "
                         "gradient: mark it too, or freeze it)");
    if (sync_enabled_) {
      schedule_.drain([&](std::size_t b) { launch(b); }, [&](std::size_t b) { complete(b); });
      strategy_->exchange_replicas();
      finished_ = true;
      strategy_->set_holds_averages(true);
    }
    // Next backward: everything pending again. (Without sync, buckets keep their buffers and
    // the next backward adds to them: gradient accumulation.)
    std::fill(ready_.begin(), ready_.end(), false);
    ready_count_ = 0;
    schedule_.reset();
  }

  // True once finish() has completed a synchronised backward since the last zero_grad().
  bool finished() const { return finished_; }

  // no_sync: gradients accumulate locally, nothing is communicated, until sync is re-enabled;
  // the next synchronised backward then reduces the accumulated sums.
  void set_sync(bool enabled) {
    check<StateError>(std::none_of(ready_.begin(), ready_.end(), [](bool r) { return r; }),
                      "switch gradient sync only between backwards (after finish())");
    sync_enabled_ = enabled;
  }
  bool sync_enabled() const { return sync_enabled_; }

  // Clears the gradients for the next accumulation window.
  void zero_grad() {
    strategy_->zero(states_);
    strategy_->set_holds_averages(false);
    finished_ = false;
  }

  // The averaged gradient of a piece this rank updates (after finish()). all_reduce: any
  // piece; reduce_scatter: only pieces this rank owns.
  Tensor piece_grad(const shard::ParamPiece& piece) const { return strategy_->piece_grad(piece); }

  const shard::BucketPlan& plan() const { return buckets_; }
  GradSync sync() const { return sync_; }

 private:
  static const shard::ShardPlan& checked_plan(const shard::ShardPlan& plan,
                                              const comm::Communicator& comm) {
    check(comm.size() == plan.world_size(), "the shard plan is for ", plan.world_size(),
          " ranks but the communicator has ", comm.size());
    return plan;
  }

  const shard::ParamSlot& slot_of(std::size_t i, const char* call) const {
    check(i < plan_->layout().size(), call, "(", i, "): no such parameter; there are ",
          plan_->layout().size());
    const auto& slot = plan_->layout()[i];
    check(slot.trainable, call, "('", slot.name, "'): the parameter is frozen and has no gradient");
    return slot;
  }

  void advance() {
    schedule_.advance([&](std::size_t b) { launch(b); }, [&](std::size_t b) { complete(b); },
                      [&](std::size_t b) { return states_[b].work.test(); });
  }
  void launch(std::size_t b) {
    strategy_->launch(b, states_[b]);
    states_[b].launched = true;
  }
  void complete(std::size_t b) {
    BucketState& state = states_[b];
    if (!state.launched) return;
    state.launched = false;
    state.work.wait();
    strategy_->complete(b, state);
    state.buffer = Tensor();  // a view of the full buffer, or a transient buffer freed now
    state.wire = Tensor();
    state.out = Tensor();
  }

  const shard::ShardPlan* plan_;
  GradSync sync_;
  shard::BucketPlan buckets_;
  shard::BucketSchedule schedule_;
  std::vector<BucketState> states_;
  std::unique_ptr<GradSyncStrategy> strategy_;
  std::vector<bool> ready_;  // readiness, tracked here only: the groups and engines ask
  std::size_t ready_count_ = 0, trainable_ = 0;
  bool sync_enabled_ = true;
  bool finished_ = false;
};

}  // namespace shardkit::parallel
