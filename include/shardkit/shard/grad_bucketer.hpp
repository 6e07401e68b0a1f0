// GradBucketer: the user's backward adds each gradient into grad(i) and calls ready(i), in any
// order; buckets go out asynchronously the moment all their gradients are ready.
//
// Buckets are contiguous ranges of the flat gradient buffer formed in reverse layout order (the
// order a backward usually produces them), identical on every rank, and are launched strictly
// in bucket order, so every rank issues the same collectives in the same order (NCCL's rule).
//
//   all_reduce (DDP, OSS): a persistent full gradient buffer; each bucket is averaged in place.
//   reduce_scatter (SDP): a rank keeps only the gradients of the range it owns. A bucket's
//     gradients live in a transient buffer (MemoryCategory::communication) allocated when the
//     backward first asks for one of its gradients; reduce_scatter_v averages each rank's part
//     straight into that rank's owned gradients, and the buffer is freed once the call is done.
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
};

class GradBucketer {
 public:
  struct Bucket {
    std::int64_t begin = 0;  // flat-buffer elements [begin, end)
    std::int64_t end = 0;
    std::vector<std::size_t> params;  // layout indices
    int pending = 0;                  // gradients not yet marked ready in this backward
    bool launched = false;
    comm::Work work;
    Tensor buffer;  // the bucket's gradients (a view of the full buffer, or transient)
    Tensor wire;    // low-precision copy on the wire, when wire_dtype is not f32
    Tensor wire_out;
    std::int64_t numel() const { return end - begin; }
  };

  GradBucketer(Context& ctx, comm::Communicator& comm, const ShardPlan& plan, GradSync sync,
               BucketerOptions options = {})
      : ctx_(&ctx), comm_(&comm), plan_(&plan), sync_(sync), options_(options) {
    check(options.bucket_bytes > 0, "bucket size is 0 bytes; pass a positive size (PyTorch DDP ",
          "uses 25 MiB, FairScale SDP 2^23 elements)");
    check(options.wire_dtype == DType::f32 || options.wire_dtype == DType::f16 ||
              options.wire_dtype == DType::bf16,
          "gradients can travel as f32, f16 or bf16, not ", dtype_name(options.wire_dtype));
    check(comm.size() == plan.world_size(), "the shard plan is for ", plan.world_size(),
          " ranks but the communicator has ", comm.size());
    const auto& layout = plan.layout();
    if (sync_ == GradSync::all_reduce) {
      full_ = zeros(ctx, {layout.padded_numel()}, DType::f32, MemoryCategory::gradients);
    } else {
      owned_ = zeros(ctx, {plan.numel(comm.rank())}, DType::f32, MemoryCategory::gradients);
    }
    make_buckets();
    ready_.assign(layout.size(), false);
  }

  GradBucketer(const GradBucketer&) = delete;
  GradBucketer& operator=(const GradBucketer&) = delete;

  // Where backward adds (+=) parameter i's gradient for this backward.
  Tensor grad(std::size_t i) {
    const auto& slot = slot_of(i, "grad");
    if (sync_ == GradSync::all_reduce) return full_.flat_view(slot.offset, slot.shape);
    Bucket& bucket = buckets_[bucket_of_[i]];
    if (!bucket.buffer.defined()) {
      bucket.buffer = zeros(*ctx_, {bucket.numel()}, DType::f32, MemoryCategory::communication);
    }
    return bucket.buffer.flat_view(slot.offset - bucket.begin, slot.shape);
  }

  // Marks parameter i's gradient final for this backward; launches every bucket that is now
  // complete and next in order.
  void ready(std::size_t i) {
    const auto& slot = slot_of(i, "ready");
    check(!ready_[i], "the gradient of '", slot.name,
          "' was marked ready twice in one backward; mark each parameter once, then finish()");
    ready_[i] = true;
    Bucket& bucket = buckets_[bucket_of_[i]];
    --bucket.pending;
    if (sync_enabled_) launch_ready_buckets();
  }

  // Waits for every bucket. Afterwards the reduced gradients are in full_grads() (all_reduce)
  // or owned_grads() (reduce_scatter). Throws if a trainable parameter was never marked.
  void finish() {
    for (std::size_t i = 0; i < ready_.size(); ++i)
      if (plan_->layout()[i].trainable && !ready_[i])
        fail<StateError>("finish(): the gradient of '", plan_->layout()[i].name,
                         "' was never marked ready in this backward; call ready() for every "
                         "trainable parameter (a parameter the loss does not reach has a zero "
                         "gradient: mark it too, or freeze it)");
    if (sync_enabled_) {
      launch_ready_buckets();
      for (auto& bucket : buckets_) complete(bucket);
      finished_ = true;
    }
    // Next backward: everything pending again. (Without sync, buckets keep their buffers and
    // the next backward adds to them: gradient accumulation.)
    std::fill(ready_.begin(), ready_.end(), false);
    for (auto& bucket : buckets_) {
      bucket.pending = static_cast<int>(bucket.params.size());
      bucket.launched = false;
    }
    next_launch_ = 0;
  }

  // True once finish() has completed a synchronised backward since the last zero_grad().
  bool finished() const { return finished_; }

  // no_sync: gradients accumulate locally, nothing is communicated, until sync is re-enabled;
  // the next synchronised backward then reduces the accumulated sums.
  void set_sync(bool enabled) {
    check<StateError>(std::all_of(ready_.begin(), ready_.end(), [](bool r) { return !r; }),
                      "switch gradient sync only between backwards (after finish())");
    sync_enabled_ = enabled;
  }
  bool sync_enabled() const { return sync_enabled_; }

  // Clears the gradients for the next accumulation window.
  void zero_grad() {
    if (full_.defined()) fill(*ctx_, full_, 0.0);
    if (owned_.defined()) fill(*ctx_, owned_, 0.0);
    for (auto& bucket : buckets_)
      if (sync_ == GradSync::reduce_scatter) bucket.buffer = Tensor();
    finished_ = false;
  }

  // all_reduce mode: the whole averaged gradient buffer (layout offsets).
  const Tensor& full_grads() const {
    check<StateError>(full_.defined(), "full_grads(): this bucketer reduces to owners (SDP) and "
                                       "keeps only owned_grads()");
    return full_;
  }
  // The averaged gradients of this rank's range [plan.begin(rank), plan.end(rank)).
  Tensor owned_grads() const {
    if (owned_.defined()) return owned_;
    const int rank = comm_->rank();
    return full_.slice(0, plan_->begin(rank), plan_->end(rank));
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  GradSync sync() const { return sync_; }
  // Largest bucket in bytes of f32: the memory budget to declare for transient buffers.
  std::size_t largest_bucket_bytes() const {
    std::int64_t largest = 0;
    for (const auto& b : buckets_) largest = std::max(largest, b.numel());
    return static_cast<std::size_t>(largest) * 4;
  }

 private:
  const ParamSlot& slot_of(std::size_t i, const char* call) const {
    check(i < plan_->layout().size(), call, "(", i, "): no such parameter; there are ",
          plan_->layout().size());
    const auto& slot = plan_->layout()[i];
    check(slot.trainable, call, "('", slot.name, "'): the parameter is frozen and has no gradient");
    return slot;
  }

  void make_buckets() {
    const auto& layout = plan_->layout();
    const auto& order = plan_->trainable_in_layout_order();
    bucket_of_.assign(layout.size(), 0);
    const auto capacity = static_cast<std::int64_t>(options_.bucket_bytes / 4);
    // Walk backwards; a parameter's extent runs to the next parameter (or the sharded end),
    // so buckets tile [0, trainable_end) and padding is reduced along (it is zero).
    std::int64_t extent_end = plan_->trainable_end();
    for (std::size_t k = order.size(); k-- > 0;) {
      const std::size_t i = order[k];
      const std::int64_t begin = layout[i].offset;
      const bool fits = !buckets_.empty() && buckets_.back().end - begin <= capacity;
      if (!fits) buckets_.push_back(Bucket{begin, extent_end, {}, 0, false, {}, {}, {}, {}});
      Bucket& bucket = buckets_.back();
      bucket.begin = begin;
      bucket.params.push_back(i);
      ++bucket.pending;
      bucket_of_[i] = buckets_.size() - 1;
      extent_end = begin;
    }
    // Leading padding before the first parameter never exists (offsets start at 0).
  }

  std::vector<std::size_t> counts_for(const Bucket& bucket) const {
    std::vector<std::size_t> counts;
    for (int r = 0; r < plan_->world_size(); ++r) {
      const std::int64_t lo = std::max(bucket.begin, plan_->begin(r));
      const std::int64_t hi = std::min(bucket.end, plan_->end(r));
      counts.push_back(static_cast<std::size_t>(std::max<std::int64_t>(0, hi - lo)));
    }
    return counts;
  }

  // Where this rank's part of `bucket` (`own` elements) starts inside owned_grads().
  std::int64_t own_offset(const Bucket& bucket, std::int64_t own) const {
    if (own == 0) return 0;
    const int rank = comm_->rank();
    return std::max(bucket.begin, plan_->begin(rank)) - plan_->begin(rank);
  }

  void launch_ready_buckets() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0)
      launch(buckets_[next_launch_++]);
  }

  void launch(Bucket& bucket) {
    const bool low = options_.wire_dtype != DType::f32;
    if (sync_ == GradSync::all_reduce) {
      bucket.buffer = full_.slice(0, bucket.begin, bucket.end);
      if (low) {
        bucket.wire = cast_for_wire(bucket.buffer);
        bucket.work = comm_->all_reduce(bucket.wire, comm::ReduceOp::avg);
      } else {
        bucket.work = comm_->all_reduce(bucket.buffer, comm::ReduceOp::avg);
      }
    } else {
      if (!bucket.buffer.defined())  // no gradient asked for: all zero
        bucket.buffer = zeros(*ctx_, {bucket.numel()}, DType::f32, MemoryCategory::communication);
      const auto counts = counts_for(bucket);
      const int rank = comm_->rank();
      const auto own = static_cast<std::int64_t>(counts[static_cast<std::size_t>(rank)]);
      const std::int64_t own_begin = own_offset(bucket, own);
      const Tensor target = owned_.slice(0, own_begin, own_begin + own);
      if (low) {
        bucket.wire = cast_for_wire(bucket.buffer);
        bucket.wire_out = empty(*ctx_, {own}, options_.wire_dtype, MemoryCategory::communication);
        bucket.work = comm_->reduce_scatter_v(bucket.wire, bucket.wire_out, counts, comm::ReduceOp::avg);
      } else {
        bucket.work = comm_->reduce_scatter_v(bucket.buffer, target, counts, comm::ReduceOp::avg);
      }
    }
    bucket.launched = true;
  }

  Tensor cast_for_wire(const Tensor& values) {
    Tensor wire = empty(*ctx_, values.shape(), options_.wire_dtype, MemoryCategory::communication);
    copy(*ctx_, wire, values);
    return wire;
  }

  void complete(Bucket& bucket) {
    if (!bucket.launched) return;
    bucket.work.wait();
    if (sync_ == GradSync::all_reduce) {
      if (bucket.wire.defined()) copy(*ctx_, bucket.buffer, bucket.wire);
      bucket.buffer = Tensor();  // a view: nothing freed
    } else {
      if (bucket.wire_out.defined() && bucket.wire_out.numel() > 0) {
        const std::int64_t own_begin = own_offset(bucket, bucket.wire_out.numel());
        copy(*ctx_, owned_.slice(0, own_begin, own_begin + bucket.wire_out.numel()), bucket.wire_out);
      }
      bucket.buffer = Tensor();  // transient: freed now
    }
    bucket.wire = Tensor();
    bucket.wire_out = Tensor();
  }

  Context* ctx_;
  comm::Communicator* comm_;
  const ShardPlan* plan_;
  GradSync sync_;
  BucketerOptions options_;
  Tensor full_;   // all_reduce: every gradient
  Tensor owned_;  // reduce_scatter: this rank's range only
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<bool> ready_;
  std::size_t next_launch_ = 0;
  bool sync_enabled_ = true;
  bool finished_ = false;
};

}  // namespace shardkit::shard
