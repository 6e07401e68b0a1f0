// GradBucketer: the user's backward adds each gradient into grad(i) and calls ready(i), in any
// order; buckets go out asynchronously the moment all their gradients are ready.
//
// Buckets take parameters in reverse registration order (the order a backward produces their
// gradients) up to bucket_bytes, identical on every rank, and are launched strictly in bucket
// order, so every rank issues the same collectives in the same order (NCCL's rule). Inside a
// bucket, parameters sit in flat-buffer order, so each rank's part of a bucket is contiguous and
// in rank order: one reduce_scatter_v per bucket reduces every part to its owner.
//
//   all_reduce (DDP, OSS): a persistent full gradient buffer laid out bucket after bucket; each
//     bucket is averaged in place (no copies).
//   reduce_scatter (SDP): a rank keeps only the gradients it owns, laid out bucket after bucket.
//     A bucket's gradients live in a transient buffer (MemoryCategory::communication) allocated
//     when the backward first asks for one of its gradients; reduce_scatter_v averages each
//     rank's part straight into that rank's owned gradients, and the buffer is freed once done.
//
// Gradients may travel in f16/bf16 (wire_dtype): the bucket is cast for the wire and back.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::shard {

enum class GradSync { all_reduce, reduce_scatter };

struct BucketerOptions {
  std::size_t bucket_bytes = std::size_t{25} << 20;  // PyTorch DDP's 25 MiB
  DType wire_dtype = DType::f32;                       // f16 / bf16 halve the traffic
  // Buckets in flight at once: launching one more first waits for the oldest. Bounds SDP's
  // transient memory to about (max_in_flight + the buckets being filled) x bucket_bytes.
  int max_in_flight = 2;
};

class GradBucketer {
 public:
  struct Bucket {
    std::vector<std::size_t> params;     // layout indices, in flat-buffer order
    std::vector<std::int64_t> position;  // where each parameter starts inside the bucket
    std::vector<std::size_t> counts;     // elements of the bucket owned by each rank
    std::int64_t numel = 0;
    std::int64_t base = 0;        // all_reduce: offset of the bucket in the full buffer
    std::int64_t own_offset = 0;  // reduce_scatter: offset of this rank's part in owned_grads()
    int pending = 0;              // gradients not yet marked ready in this backward
    bool launched = false;
    comm::Work work;
    Tensor buffer;  // the bucket's gradients (a view of the full buffer, or transient)
    Tensor wire;    // low-precision copy on the wire, when wire_dtype is not f32
    Tensor wire_out;
  };

  GradBucketer(Context& ctx, comm::Communicator& comm, const ShardPlan& plan, GradSync sync,
               BucketerOptions options = {})
      : ctx_(&ctx), comm_(&comm), plan_(&plan), sync_(sync), options_(options) {
    check(options.bucket_bytes > 0, "bucket size is 0 bytes; pass a positive size (PyTorch DDP ",
          "uses 25 MiB, FairScale SDP 2^23 elements)");
    check(options.max_in_flight >= 1, "max_in_flight must be >= 1 bucket, got ",
          options.max_in_flight);
    check(options.wire_dtype == DType::f32 || options.wire_dtype == DType::f16 ||
              options.wire_dtype == DType::bf16,
          "gradients can travel as f32, f16 or bf16, not ", dtype_name(options.wire_dtype));
    check(comm.size() == plan.world_size(), "the shard plan is for ", plan.world_size(),
          " ranks but the communicator has ", comm.size());
    make_buckets();
    if (sync_ == GradSync::all_reduce) {
      full_ = zeros(ctx, {total_numel_}, DType::f32, MemoryCategory::gradients);
    } else {
      owned_ = zeros(ctx, {owned_numel_}, DType::f32, MemoryCategory::gradients);
    }
    ready_.assign(plan.layout().size(), false);
  }

  GradBucketer(const GradBucketer&) = delete;
  GradBucketer& operator=(const GradBucketer&) = delete;

  // Where backward adds (+=) parameter i's gradient for this backward.
  Tensor grad(std::size_t i) {
    const auto& slot = slot_of(i, "grad");
    Bucket& bucket = buckets_[bucket_of_[i]];
    const std::int64_t at = position_of_[i];
    if (sync_ == GradSync::all_reduce) return full_.flat_view(bucket.base + at, slot.shape);
    if (!bucket.buffer.defined())
      bucket.buffer = zeros(*ctx_, {bucket.numel}, DType::f32, MemoryCategory::communication);
    return bucket.buffer.flat_view(at, slot.shape);
  }

  // Marks parameter i's gradient final for this backward; launches every bucket that is now
  // complete and next in order.
  void ready(std::size_t i) {
    const auto& slot = slot_of(i, "ready");
    check(!ready_[i], "the gradient of '", slot.name,
          "' was marked ready twice in one backward; mark each parameter once, then finish()");
    ready_[i] = true;
    --buckets_[bucket_of_[i]].pending;
    if (sync_enabled_) launch_ready_buckets();
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
      launch_ready_buckets();
      while (next_complete_ < buckets_.size()) complete(buckets_[next_complete_++]);
      finished_ = true;
    }
    // Next backward: everything pending again. (Without sync, buckets keep their buffers and
    // the next backward adds to them: gradient accumulation.)
    std::fill(ready_.begin(), ready_.end(), false);
    for (auto& bucket : buckets_) bucket.pending = static_cast<int>(bucket.params.size());
    next_launch_ = 0;
    next_complete_ = 0;
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
    if (full_.defined()) fill(*ctx_, full_, 0.0);
    if (owned_.defined()) fill(*ctx_, owned_, 0.0);
    if (sync_ == GradSync::reduce_scatter)
      for (auto& bucket : buckets_) bucket.buffer = Tensor();
    finished_ = false;
  }

  // The averaged gradient of a piece this rank updates (after finish()). all_reduce: any
  // piece; reduce_scatter: only pieces this rank owns.
  Tensor piece_grad(const ParamPiece& piece) const {
    const Bucket& bucket = buckets_[bucket_of_[piece.param]];
    const std::int64_t at = position_of_[piece.param] + piece.param_begin;
    if (sync_ == GradSync::all_reduce) return full_.slice(0, bucket.base + at, bucket.base + at + piece.numel());
    const int rank = comm_->rank();
    std::int64_t part_start = 0;
    for (int r = 0; r < rank; ++r) part_start += static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(r)]);
    const std::int64_t own = static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(rank)]);
    check(at >= part_start && at + piece.numel() <= part_start + own, "piece_grad: '",
          plan_->layout()[piece.param].name, "' elements [", piece.param_begin, ", ",
          piece.param_end, ") are not owned by rank ", rank, "; under SDP a rank keeps only its own");
    const std::int64_t offset = bucket.own_offset + (at - part_start);
    return owned_.slice(0, offset, offset + piece.numel());
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  GradSync sync() const { return sync_; }
 private:
  const ParamSlot& slot_of(std::size_t i, const char* call) const {
    check(i < plan_->layout().size(), call, "(", i, "): no such parameter; there are ",
          plan_->layout().size());
    const auto& slot = plan_->layout()[i];
    check(slot.trainable, call, "('", slot.name, "'): the parameter is frozen and has no gradient");
    return slot;
  }

  // A parameter's extent: its elements plus the alignment padding after it.
  std::int64_t extent_of(std::size_t i) const {
    const std::int64_t a = plan_->layout().alignment();
    return (plan_->layout()[i].numel + a - 1) / a * a;
  }

  void make_buckets() {
    const auto& layout = plan_->layout();
    bucket_of_.assign(layout.size(), 0);
    position_of_.assign(layout.size(), 0);
    const auto capacity = static_cast<std::int64_t>(options_.bucket_bytes / 4);
    // Reverse registration order: layout indices are registration indices.
    for (std::size_t i = layout.size(); i-- > 0;) {
      if (!layout[i].trainable) continue;
      const std::int64_t extent = extent_of(i);
      if (buckets_.empty() || (buckets_.back().numel > 0 && buckets_.back().numel + extent > capacity))
        buckets_.emplace_back();
      buckets_.back().params.push_back(i);
      buckets_.back().numel += extent;
    }
    const int rank = comm_->rank();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      std::sort(bucket.params.begin(), bucket.params.end(),
                [&](std::size_t x, std::size_t y) { return layout[x].offset < layout[y].offset; });
      bucket.counts.assign(static_cast<std::size_t>(plan_->world_size()), 0);
      std::int64_t at = 0;
      for (auto i : bucket.params) {
        bucket.position.push_back(at);
        bucket_of_[i] = b;
        position_of_[i] = at;
        // Split the extent over the ranks whose flat ranges it overlaps (a flat plan may cut it).
        const std::int64_t begin = layout[i].offset, end = begin + extent_of(i);
        for (std::int64_t e = begin; e < end;) {
          const int owner = plan_->rank_of_element(e);
          const std::int64_t stop = std::min(end, plan_->end(owner));
          bucket.counts[static_cast<std::size_t>(owner)] += static_cast<std::size_t>(stop - e);
          e = stop;
        }
        at += extent_of(i);
      }
      bucket.pending = static_cast<int>(bucket.params.size());
      bucket.base = total_numel_;
      total_numel_ += bucket.numel;
      bucket.own_offset = owned_numel_;
      owned_numel_ += static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(rank)]);
    }
  }

  void launch_ready_buckets() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      // Free what has finished (without blocking), and keep at most max_in_flight going.
      while (next_complete_ < next_launch_ &&
             (buckets_[next_complete_].work.test() ||
              static_cast<int>(next_launch_ - next_complete_) >= options_.max_in_flight))
        complete(buckets_[next_complete_++]);
      launch(buckets_[next_launch_++]);
    }
  }

  void launch(Bucket& bucket) {
    const bool low = options_.wire_dtype != DType::f32;
    if (sync_ == GradSync::all_reduce) {
      bucket.buffer = full_.slice(0, bucket.base, bucket.base + bucket.numel);
      if (low) {
        bucket.wire = cast_for_wire(bucket.buffer);
        assign(bucket.work, comm_->all_reduce(bucket.wire, comm::ReduceOp::avg));
      } else {
        assign(bucket.work, comm_->all_reduce(bucket.buffer, comm::ReduceOp::avg));
      }
    } else {
      if (!bucket.buffer.defined())  // no gradient was asked for: all zero
        bucket.buffer = zeros(*ctx_, {bucket.numel}, DType::f32, MemoryCategory::communication);
      const auto own = static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(comm_->rank())]);
      const Tensor target = owned_.slice(0, bucket.own_offset, bucket.own_offset + own);
      if (low) {
        bucket.wire = cast_for_wire(bucket.buffer);
        bucket.wire_out = empty(*ctx_, {own}, options_.wire_dtype, MemoryCategory::communication);
        assign(bucket.work, comm_->reduce_scatter_v(bucket.wire, bucket.wire_out, bucket.counts, comm::ReduceOp::avg));
      } else {
        assign(bucket.work, comm_->reduce_scatter_v(bucket.buffer, target, bucket.counts, comm::ReduceOp::avg));
      }
    }
    bucket.launched = true;
  }

  // (Work is [[nodiscard]], and nvcc flags the discarded result of its move-assignment.)
  static void assign(comm::Work& slot, comm::Work&& work) {
    comm::Work& assigned = (slot = std::move(work));
    (void)assigned;
  }

  Tensor cast_for_wire(const Tensor& values) {
    Tensor wire = empty(*ctx_, values.shape(), options_.wire_dtype, MemoryCategory::communication);
    copy(*ctx_, wire, values);
    return wire;
  }

  void complete(Bucket& bucket) {
    if (!bucket.launched) return;
    bucket.launched = false;
    bucket.work.wait();
    if (sync_ == GradSync::all_reduce) {
      if (bucket.wire.defined()) copy(*ctx_, bucket.buffer, bucket.wire);
    } else if (bucket.wire_out.defined() && bucket.wire_out.numel() > 0) {
      copy(*ctx_, owned_.slice(0, bucket.own_offset, bucket.own_offset + bucket.wire_out.numel()),
           bucket.wire_out);
    }
    bucket.buffer = Tensor();  // a view of the full buffer, or a transient buffer freed now
    bucket.wire = Tensor();
    bucket.wire_out = Tensor();
  }

  Context* ctx_;
  comm::Communicator* comm_;
  const ShardPlan* plan_;
  GradSync sync_;
  BucketerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;     // per parameter
  std::vector<std::int64_t> position_of_;  // per parameter, inside its bucket
  std::int64_t total_numel_ = 0;           // every bucket
  std::int64_t owned_numel_ = 0;           // this rank's parts of every bucket
  Tensor full_;   // all_reduce: every gradient, bucket after bucket
  Tensor owned_;  // reduce_scatter: this rank's parts, bucket after bucket
  std::vector<bool> ready_;
  std::size_t next_launch_ = 0;    // buckets [0, next_launch_) are launched
  std::size_t next_complete_ = 0;  // buckets [0, next_complete_) are complete
  bool sync_enabled_ = true;
  bool finished_ = false;
};

}  // namespace shardkit::shard
