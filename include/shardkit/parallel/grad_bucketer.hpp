// GradBucketer: the user's backward adds each gradient into grad(i) and calls ready(i), in any
// order; buckets (bucket_plan.hpp) go out asynchronously the moment all their gradients are
// ready, in bucket order, with at most max_in_flight in flight; how a bucket is stored and
// reduced is one of two strategies (grad_sync.hpp: all-reduce, or reduce-scatter to the
// owners). The readiness of every parameter is tracked here, and only here.
//
// Local accumulation (no_sync) sums before the one reduction: avg(g1 + g2); synchronised
// backwards add each one's average to the averages held (grad_sync.hpp).
//
// Hybrid sharding (comm/hybrid_mesh.hpp): `comm` is the shard group and `replicas` the ranks
// holding the same shard in the other groups. A bucket is then summed inside the group (the
// reduce-scatter or all-reduce); at finish() its reduced part is summed across the groups (an
// all-reduce on replicas, the only inter-group traffic) and divided by the world size once:
// the same arithmetic as one average over the world, so gradients whose sums are exact give
// DDP's bits. A 16-bit wire averages at each level instead, so the sums cannot overflow.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/parallel/grad_sync.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/reduce_scatter_coalescer.hpp"
#include "shardkit/shard/bucket_plan.hpp"

namespace shardkit::parallel {

class GradBucketer {
 public:
  // `coalescer` (reduce_scatter only, optional): buckets smaller than its capacity are reduced
  // together with other bucketers' (FSDP's many units). `replicas` (optional): hybrid
  // sharding's other groups, `comm` being this rank's shard group.
  // `policy` (policy.hpp: resolve() checked it) sets the bucket capacity, the buckets in
  // flight and the gradients' dtypes: kept in grad_dtype, travelling in wire_dtype.
  // `grads_home` (reduce_scatter only, optional): a host context that keeps the reduced
  // gradients (CPU offload), each bucket's part brought down as it completes.
  GradBucketer(Context& ctx, comm::Communicator& comm, const shard::ShardPlan& plan, GradSync sync,
               const BucketPolicy& policy, ReduceScatterCoalescer* coalescer = nullptr,
               comm::Communicator* replicas = nullptr, Context* grads_home = nullptr)
      : plan_(&plan),
        sync_(sync),
        buckets_(checked_plan(plan, comm), comm.rank(), policy.capacity),
        schedule_(buckets_.items_per_bucket(), policy.max_in_flight),
        states_(buckets_.buckets().size()) {
    check(sync == GradSync::reduce_scatter || grads_home == nullptr,
          "GradBucketer: all-reduced gradients are kept whole on the device (the all-reduce "
          "works in place); only reduce-scattered ones can be kept in host memory");
    if (sync == GradSync::all_reduce)
      strategy_ = std::make_unique<AllReduceGrads>(ctx, comm, buckets_, policy.grad_dtype,
                                                   policy.wire_dtype, replicas);
    else
      strategy_ = std::make_unique<ReduceScatterGrads>(ctx, comm, buckets_, policy, coalescer,
                                                       replicas, grads_home);
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
          "' was marked ready twice in one backward; mark each parameter once, then finish() "
          "(a backward cut short by an exception leaves its marks: zero_grad() clears them)");
    ready_[i] = true;
    ++ready_count_;
    schedule_.ready(buckets_.bucket_of(i));
    if (sync_enabled_) advance();
  }

  // Whether parameter i's gradient is final in this backward; whether every one is.
  bool is_ready(std::size_t i) const { return i < ready_.size() && ready_[i]; }
  bool all_ready() const { return ready_count_ == trainable_; }
  // A backward is under way: a gradient was marked ready and finish() has not completed (a
  // backward cut short by an exception stays open until zero_grad()).
  bool backward_open() const { return ready_count_ > 0; }

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

  // The setting before a no_sync scope, back at its end while an exception unwinds a backward
  // in it: that backward is abandoned (zero_grad() clears it), so the check between backwards
  // does not apply.
  void restore_sync(bool enabled) { sync_enabled_ = enabled; }

  // qgZ's error feedback after a loss-scaled step (grad_sync.hpp): rescaled, or dropped.
  void follow_loss_scale(const Tensor& state) { strategy_->follow_loss_scale(state); }
  // qgZ's error feedback from zero again (a checkpoint's load).
  void reset_error_feedback() { strategy_->reset_error_feedback(); }

  // Closes a backward that was cut short (backward_open() without finish()): the reductions it
  // launched are waited for -- their buffers may not go while a collective uses them -- and
  // their results dropped with every gradient of it; marks and the launch schedule start again.
  // Calls held in a coalescer must be dropped before (ReduceScatterCoalescer::drop_held), or a
  // wait would launch them. The first error of a wait is thrown once everything is reset.
  void abandon_backward() {
    std::exception_ptr first_error;
    for (auto& state : states_) {
      if (state.launched) {
        state.launched = false;
        try {
          state.work.wait_on_stream();
        } catch (...) {
          if (!first_error) first_error = std::current_exception();
        }
      }
      state = BucketState{};
    }
    std::fill(ready_.begin(), ready_.end(), false);
    ready_count_ = 0;
    schedule_.reset();
    if (first_error) std::rethrow_exception(first_error);
  }

  // Clears the gradients for the next accumulation window.
  void zero_grad() {
    strategy_->zero(states_);
    strategy_->set_holds_averages(false);
    finished_ = false;
  }

  // The averaged gradient of a piece this rank updates (after finish()). all_reduce: any
  // piece; reduce_scatter: only pieces this rank owns.
  Tensor piece_grad(const shard::ParamPiece& piece) const { return strategy_->piece_grad(piece); }
  // The context whose memory keeps the reduced gradients (grads_home, or the device's).
  Context& grads_context() const { return strategy_->home(); }
  // Kept on the host: whether copies down await the host's wait for the stream; after it,
  // land_copies() completes them (grad_sync.hpp).
  bool copies_pending() const { return strategy_->copies_pending(); }
  void land_copies() { strategy_->land_copies(); }

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
    state.work.wait_on_stream();
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
