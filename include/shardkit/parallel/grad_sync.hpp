// How a bucket of gradients is stored and reduced -- the two strategies of the GradBucketer
// (grad_bucketer.hpp), over what they share (GradSyncStrategy: the kept gradients, transient
// bucket buffers, the merge of a reduced part, the hybrid exchange):
//
//   AllReduceGrads (ddp, oss): a persistent full gradient buffer laid out bucket after bucket;
//     each bucket is averaged in place (no copies).
//   ReduceScatterGrads (sdp, fsdp): a rank keeps only the gradients it owns, laid out bucket
//     after bucket. A bucket's gradients live in a transient buffer (MemoryCategory::
//     communication) allocated when the backward first asks for one of its gradients;
//     reduce_scatter_v averages each rank's part straight into that rank's owned gradients, and
//     the buffer is freed once done. With a coalescer (fsdp), small buckets of many groups
//     travel together (reduce_scatter_coalescer.hpp). With qgZ (BucketPolicy::quantized_block)
//     each bucket goes out alone as int8 blocks instead (quantized_reduce_scatter.hpp).
//
// Under CPU offload (sdp, fsdp) the kept gradients live in host memory (PyTorch FSDP's
// CPUOffload, DeepSpeed's ZeRO-Offload): each bucket's reduction lands in a transient device
// buffer and its part comes down as the bucket completes, during the backward, so the device
// keeps no reduced gradient between backwards and the offloaded step finds its gradients on
// the host. The copies are queued on the stream; ParamGroups::finish() waits for them once, and
// only then are the parts of a second synchronised backward added to the averages held.
//
// Accumulation over synchronised backwards (no zero_grad between them) adds the average of the
// new local gradients to the averages already held: A + avg(g), exactly as a sharded
// accumulation computes it, never avg(A + g) (which rounds differently). Once the buffers hold
// averages, a backward's gradients therefore go to transient bucket buffers whose reduction is
// added in. Gradients are kept in grad_dtype and may travel in another wire_dtype: the bucket is
// cast for the wire and back.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/quantized_reduce_scatter.hpp"
#include "shardkit/parallel/reduce_scatter_coalescer.hpp"
#include "shardkit/parallel/replica_sync.hpp"
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

class GradSyncStrategy {
 public:
  // `kept` elements of gradients stay allocated (MemoryCategory::gradients): every one, or this
  // rank's parts; in `home`'s memory (a host context under offload; nullptr: ctx's).
  GradSyncStrategy(Context& ctx, comm::Communicator& comm, const shard::BucketPlan& plan,
                   DType grad_dtype, DType wire_dtype, comm::Communicator* replicas,
                   std::int64_t kept, Context* home = nullptr)
      : ctx_(&ctx),
        home_(home != nullptr ? home : &ctx),
        comm_(&comm),
        plan_(&plan),
        grad_dtype_(grad_dtype),
        wire_dtype_(wire_dtype),
        kept_(zeros(*home_, {kept}, grad_dtype, MemoryCategory::gradients)),
        replicas_(comm, replicas, plan.buckets().size()) {}
  virtual ~GradSyncStrategy() {
    try {  // (copies still on their way into host memory that is freed with this object)
      if (copies_pending_) ctx_->synchronize();
    } catch (...) {  // (a destructor cannot throw: an error found by this wait is dropped)
    }
  }
  GradSyncStrategy(const GradSyncStrategy&) = delete;
  GradSyncStrategy& operator=(const GradSyncStrategy&) = delete;

  // Where the backward adds gradient `param` (a view inside bucket `b`'s storage).
  virtual Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) = 0;
  virtual void launch(std::size_t b, BucketState& state) = 0;
  // The averaged gradient of a piece this rank updates (after the backward is finished).
  virtual Tensor piece_grad(const shard::ParamPiece& piece) const = 0;

  // The bucket's reduction is done: its part is merged into the kept gradients, or, under
  // hybrid sharding, held for the exchange across groups.
  void complete(std::size_t b, BucketState& state) {
    const Tensor reduced = landed(b, state);
    if (replicas_.active())
      replicas_.hold(b, reduced);
    else
      merge(b, reduced);
  }
  // Hybrid sharding: after every bucket completed, the exchange across groups (ReplicaSync).
  void exchange_replicas() {
    replicas_.exchange(*ctx_, [&](std::size_t b, const Tensor& part) { merge(b, part); });
  }
  // Clears the gradients; afterwards a reduction lands in place again. (Copies down of a
  // backward whose finish() never waited for them -- it threw -- are waited for and dropped.)
  void zero(std::vector<BucketState>& states) {
    if (copies_pending_) {
      ctx_->synchronize();
      pending_adds_.clear();
      copies_pending_ = false;
    }
    fill(*home_, kept_, 0.0);
    for (auto& state : states) state.buffer = Tensor();
    replicas_.clear();
  }
  // qgZ's error feedback (no-op elsewhere): the carried residuals, in the gradients' scaled
  // units, follow the loss scale's update just made (`state`, ops/step_gate.hpp, on the
  // device), or are dropped after a skipped step, whose residuals may hold an inf or a NaN.
  void follow_loss_scale(const Tensor& state) {
    const std::vector<Tensor> residuals = error_feedback_residuals();
    if (!residuals.empty()) ops::follow_loss_scale(*ctx_, residuals, state);
  }
  // qgZ's error feedback starts again from zero, as in a new run: after a checkpoint's load the
  // residuals belong to the trajectory the load replaced. Zeroed in place, so that a captured
  // step keeps its addresses.
  void reset_error_feedback() {
    for (const Tensor& residual : error_feedback_residuals()) fill(*ctx_, residual, 0.0);
  }
  // The buffers hold averaged gradients of an earlier synchronised backward: the next
  // reductions are added to them.
  void set_holds_averages(bool value) { holds_averages_ = value; }
  bool holds_averages() const { return holds_averages_; }
  // Where the kept gradients live: the device's context, or the host's under offload (their
  // last parts may still be on their way down until the device's stream is waited for).
  Context& home() const { return *home_; }
  bool kept_on_host() const { return home_ != ctx_; }
  // Kept on the host: copies down queued since the host last waited for the device's stream.
  bool copies_pending() const { return copies_pending_; }
  // After the host waited for the device's stream: the copies are there, and the parts of a
  // second synchronised backward are added to the averages held, bucket by bucket.
  void land_copies() {
    for (const auto& [place, down] : pending_adds_) add_(*home_, place, down);
    pending_adds_.clear();
    copies_pending_ = false;
  }

 protected:
  // Where bucket b's reduced part landed, and where in the kept gradients it belongs.
  virtual Tensor landed(std::size_t b, const BucketState& state) const = 0;
  virtual Tensor target(std::size_t b) const = 0;

  // A zeroed buffer for bucket b's gradients, freed once the bucket is reduced.
  Tensor transient(std::size_t b) const {
    return zeros(*ctx_, {plan_->buckets()[b].numel}, grad_dtype_, MemoryCategory::communication);
  }
  // The bucket's gradients as they travel: cast to the wire dtype when it differs.
  const Tensor& wire_of(BucketState& state) const {
    if (wire_dtype_ == grad_dtype_) return state.buffer;
    state.wire = empty(*ctx_, state.buffer.shape(), wire_dtype_, MemoryCategory::communication);
    copy(*ctx_, state.wire, state.buffer);
    return state.wire;
  }
  // qgZ under hybrid sharding: the exchange across groups in `format`'s codes too, with or
  // without error feedback.
  void quantize_exchange(std::int64_t block, ops::QuantFormat format, bool error_feedback) {
    replicas_.quantize(block, format, error_feedback);
  }
  // The error feedback's residuals allocated so far (none without it): the exchange's across
  // groups, and the strategy's own.
  virtual std::vector<Tensor> error_feedback_residuals() const { return replicas_.residuals(); }
  comm::ReduceOp group_op() const { return replicas_.group_op(wire_dtype_); }
  comm::ReduceOp group_op(DType wire) const { return replicas_.group_op(wire); }

  Context* ctx_;
  Context* home_;  // the kept gradients' context: ctx_, or the offload's host context
  comm::Communicator* comm_;
  const shard::BucketPlan* plan_;
  DType grad_dtype_;
  DType wire_dtype_;
  Tensor kept_;  // the gradients this rank keeps, bucket after bucket

 private:
  // Bucket b's averaged part, `reduced`, into its place (a reduction that landed in place is
  // there already; after an earlier synchronised backward it is added to the averages held).
  void merge(std::size_t b, const Tensor& reduced) {
    if (reduced.numel() == 0) return;
    const Tensor place = target(b);
    if (reduced.data_ptr() == place.data_ptr()) return;
    if (kept_on_host()) return merge_down(place, reduced);
    if (holds_averages())
      add_(*ctx_, place, reduced);
    else
      copy(*ctx_, place, reduced);
  }
  // The kept gradients in host memory: the part comes down -- queued on the stream straight
  // into its place (cast to the kept dtype on the device first: a transfer moves bytes), or,
  // to be added to the averages held, as it is into a host buffer, held until the host has
  // waited for the stream and adds it in (land_copies: the same add as the device's, on the
  // host's threads). Nothing waits here, in the middle of the backward.
  void merge_down(const Tensor& place, const Tensor& reduced) {
    copies_pending_ = true;
    if (holds_averages()) {
      const Tensor down =
          empty(*home_, reduced.shape(), reduced.dtype(), MemoryCategory::communication);
      copy_async(*ctx_, down, reduced);
      pending_adds_.emplace_back(place, down);
      return;
    }
    if (reduced.dtype() == place.dtype()) return copy_async(*ctx_, place, reduced);
    const Tensor part = empty(*ctx_, place.shape(), place.dtype(), MemoryCategory::communication);
    copy(*ctx_, part, reduced);
    copy_async(*ctx_, place, part);
  }

  ReplicaSync replicas_;
  bool holds_averages_ = false;
  // Kept on the host: copies down queued and not yet waited for, and the parts on their way to
  // be added to the averages held (place, host buffer), kept alive until then.
  bool copies_pending_ = false;
  std::vector<std::pair<Tensor, Tensor>> pending_adds_;
};

class AllReduceGrads final : public GradSyncStrategy {
 public:
  AllReduceGrads(Context& ctx, comm::Communicator& comm, const shard::BucketPlan& plan,
                 DType grad_dtype, DType wire_dtype, comm::Communicator* replicas)
      : GradSyncStrategy(ctx, comm, plan, grad_dtype, wire_dtype, replicas, plan.total_numel()) {}

  Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) override {
    if (!holds_averages()) return kept_.flat_view(plan_->buckets()[b].base + at, shape);
    if (!state.buffer.defined()) state.buffer = transient(b);
    return state.buffer.flat_view(at, shape);
  }
  void launch(std::size_t b, BucketState& state) override {
    if (!holds_averages())
      state.buffer = target(b);
    else if (!state.buffer.defined())
      state.buffer = transient(b);  // nothing was asked: all zero
    comm::assign(state.work, comm_->all_reduce(wire_of(state), group_op()));
  }
  Tensor piece_grad(const shard::ParamPiece& piece) const override {
    const shard::GradBucket& bucket = plan_->buckets()[plan_->bucket_of(piece.param)];
    const std::int64_t at = bucket.base + plan_->position_of(piece.param) + piece.param_begin;
    return kept_.slice(0, at, at + piece.numel());
  }

 protected:
  Tensor landed(std::size_t, const BucketState& state) const override {
    return state.wire.defined() ? state.wire : state.buffer;
  }
  Tensor target(std::size_t b) const override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    return kept_.slice(0, bucket.base, bucket.base + bucket.numel);
  }
};

class ReduceScatterGrads final : public GradSyncStrategy {
 public:
  // `policy`: the gradients' dtypes and, with quantized_block, qgZ's wire of codes.
  // `home`: the kept gradients' context (offload's host context; nullptr: ctx).
  ReduceScatterGrads(Context& ctx, comm::Communicator& comm, const shard::BucketPlan& plan,
                     const BucketPolicy& policy, ReduceScatterCoalescer* coalescer,
                     comm::Communicator* replicas, Context* home = nullptr)
      : GradSyncStrategy(ctx, comm, plan, policy.grad_dtype, policy.wire_dtype, replicas,
                         plan.owned_numel(), home),
        coalescer_(coalescer),
        quantized_block_(policy.quantized_block),
        quantized_format_(policy.quantized_format),
        residuals_(policy.error_feedback ? plan.buckets().size() : 0) {
    if (quantized_block_ > 0 && policy.quantized_across_groups)
      quantize_exchange(quantized_block_, quantized_format_, policy.error_feedback);
  }

  Tensor grad(std::size_t b, BucketState& state, std::int64_t at, const Shape& shape) override {
    if (!state.buffer.defined()) state.buffer = transient(b);
    return state.buffer.flat_view(at, shape);
  }
  void launch(std::size_t b, BucketState& state) override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    if (!state.buffer.defined()) state.buffer = transient(b);  // nothing was asked: all zero
    if (quantized_block_ > 0) {
      launch_quantized(b, state);
      return;
    }
    const Tensor& send = wire_of(state);
    if (wire_dtype_ != grad_dtype_ || holds_averages() || kept_on_host())
      state.out = empty(*ctx_, {bucket.own_numel}, send.dtype(), MemoryCategory::communication);
    const Tensor recv = state.out.defined() ? state.out : target(b);
    if (coalescer_ != nullptr && send.nbytes() < coalescer_->capacity_bytes())
      comm::assign(state.work, coalescer_->submit(send, recv, bucket.counts, group_op()));
    else
      comm::assign(state.work, comm_->reduce_scatter_v(send, recv, bucket.counts, group_op()));
  }
  Tensor piece_grad(const shard::ParamPiece& piece) const override {
    const std::int64_t offset = plan_->owned_offset_of(piece);
    return kept_.slice(0, offset, offset + piece.numel());
  }

 protected:
  std::vector<Tensor> error_feedback_residuals() const override {
    std::vector<Tensor> kept = GradSyncStrategy::error_feedback_residuals();
    for (const Tensor& residual : residuals_)
      if (residual.defined()) kept.push_back(residual);
    return kept;
  }
  Tensor landed(std::size_t b, const BucketState& state) const override {
    return state.out.defined() ? state.out : target(b);
  }
  Tensor target(std::size_t b) const override {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    return kept_.slice(0, bucket.own_offset, bucket.own_offset + bucket.own_numel);
  }

 private:
  // qgZ: the bucket travels alone (its wire is bytes, not a dtype the coalescer stages) as
  // blocks of codes; its sum lands in f32 (summed under hybrid sharding, for ReplicaSync's
  // exchange) and is merged into the kept gradients like any other landed part.
  void launch_quantized(std::size_t b, BucketState& state) {
    const shard::GradBucket& bucket = plan_->buckets()[b];
    state.out = empty(*ctx_, {bucket.own_numel}, DType::f32, MemoryCategory::communication);
    comm::assign(
        state.work,
        start_quantized_reduce_scatter(
            *ctx_, *comm_, state.buffer, bucket.counts, quantized_block_, group_op(DType::f32),
            state.out, carried_residual(*ctx_, residuals_, b, bucket.numel), quantized_format_));
  }

  ReduceScatterCoalescer* coalescer_;  // small buckets go out with others (nullptr: alone)
  std::int64_t quantized_block_;       // qgZ's block (0: the wire dtype, exact)
  ops::QuantFormat quantized_format_;  // and its codes
  // qgZ's error feedback: per bucket, what quantisation dropped from this rank's gradients
  // (kept across steps and zero_grad; allocated at the bucket's first launch).
  std::vector<Tensor> residuals_;
};

}  // namespace shardkit::parallel
