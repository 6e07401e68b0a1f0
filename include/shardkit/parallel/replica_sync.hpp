// ReplicaSync: the second level of a hybrid reduction (comm/hybrid_mesh.hpp), which the
// gradient strategies (grad_sync.hpp) run when a bucket's group is one of several replicas.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/parallel/collectives.hpp"
#include "shardkit/parallel/quantized_reduce_scatter.hpp"

namespace shardkit::parallel {

// The quantised exchange's segments of an n-element part over `replicas` replicas: a whole
// number of `block`s each (the last shorter, trailing ones empty when n is small), so that no
// block spans two owners. The memory planner sizes the exchange's wires from them.
inline std::vector<std::size_t> replica_segments(std::int64_t n, int replicas, std::int64_t block) {
  const std::int64_t blocks = (n + block - 1) / block;
  const std::int64_t per = (blocks + replicas - 1) / replicas * block;
  std::vector<std::size_t> counts;
  for (std::int64_t r = 0; r < replicas; ++r)
    counts.push_back(static_cast<std::size_t>(std::clamp<std::int64_t>(n - r * per, 0, per)));
  return counts;
}

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
  // qgZ: the exchange across groups as a quantised reduce-scatter and all-gather of `block`
  // values per scale in `format`'s codes (0: the exact all-reduce). With `error_feedback` the
  // quantisation error of both halves is carried to the next exchange, as 1-bit Adam carries
  // its workers' and its servers': each rank keeps what the reduce-scatter dropped from its
  // group sums, and what the all-gather dropped from the average of the segment it owns.
  void quantize(std::int64_t block, ops::QuantFormat format, bool error_feedback) {
    block_ = block;
    format_ = format;
    const std::size_t n = block > 0 && error_feedback && active() ? held_.size() : 0;
    sent_residuals_.assign(n, Tensor());
    gathered_residuals_.assign(n, Tensor());
  }
  // The error feedback's residuals allocated so far (in the gradients' loss-scaled units), for
  // the loss scale's update to follow.
  std::vector<Tensor> residuals() const {
    std::vector<Tensor> kept;
    for (const auto* residuals : {&sent_residuals_, &gathered_residuals_})
      for (const Tensor& residual : *residuals)
        if (residual.defined()) kept.push_back(residual);
    return kept;
  }
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
    if (block_ > 0) {
      exchange_quantized(ctx, merge);
      return;
    }
    std::vector<comm::Work> works(held_.size());
    for (std::size_t b = 0; b < held_.size(); ++b)
      if (held_[b].defined() && held_[b].numel() > 0)
        comm::assign(works[b],
                     replicas_->all_reduce(
                         held_[b], summed(held_[b]) ? comm::ReduceOp::sum : comm::ReduceOp::avg));
    for (std::size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].defined()) continue;
      works[b].wait_on_stream();
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

  // The quantised exchange (see the top): the reduce-scatters issued together in bucket order,
  // then, bucket by bucket, the replica's segment averaged and the all-gathers issued, then
  // each part merged in bucket order once its gather is done.
  template <class Merge>
  void exchange_quantized(Context& ctx, Merge& merge) {
    const auto mine = static_cast<std::size_t>(replicas_->rank());
    std::vector<std::vector<std::size_t>> counts(held_.size());
    std::vector<Tensor> owned(held_.size());
    std::vector<comm::Work> works(held_.size());
    for (std::size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].defined() || held_[b].numel() == 0) continue;
      check(held_[b].dtype() == DType::f32, "hybrid qgZ: bucket ", b, "'s group sum is held as ",
            dtype_name(held_[b].dtype()),
            "; the quantised exchange across groups takes the f32 sums of a quantised "
            "reduce-scatter");
      counts[b] = replica_segments(held_[b].numel(), replicas_->size(), block_);
      owned[b] = empty(ctx, {static_cast<std::int64_t>(counts[b][mine])}, DType::f32,
                       MemoryCategory::communication);
      comm::assign(works[b],
                   start_quantized_reduce_scatter(
                       ctx, *replicas_, held_[b], counts[b], block_, comm::ReduceOp::sum, owned[b],
                       carried_residual(ctx, sent_residuals_, b, held_[b].numel()), format_));
    }
    for (std::size_t b = 0; b < held_.size(); ++b) {
      if (counts[b].empty()) continue;
      works[b].wait_on_stream();
      divide_(ctx, owned[b], static_cast<double>(world_size_));
      const Tensor carried = carried_residual(ctx, gathered_residuals_, b, owned[b].numel());
      if (carried.defined()) add_(ctx, owned[b], carried);
      comm::assign(works[b], start_quantized_all_gather_v(ctx, *replicas_, owned[b], held_[b],
                                                          counts[b], block_, format_));
    }
    for (std::size_t b = 0; b < held_.size(); ++b) {
      if (!held_[b].defined()) continue;
      works[b].wait_on_stream();
      if (!gathered_residuals_.empty() && !counts[b].empty()) {
        // What the gather dropped: the segment's average less its dequantised codes (this
        // rank's own run, which the gather dequantised into its place like every other).
        std::size_t at = 0;
        for (std::size_t r = 0; r < mine; ++r) at += counts[b][r];
        const Tensor carried = gathered_residuals_[b];
        copy(ctx, carried,
             held_[b].slice(0, static_cast<std::int64_t>(at),
                            static_cast<std::int64_t>(at + counts[b][mine])));
        divide_(ctx, carried, -1.0);  // exact
        add_(ctx, carried, owned[b]);
      }
      owned[b] = Tensor();
      merge(b, held_[b]);
      held_[b] = Tensor();
    }
  }

  comm::Communicator* replicas_;
  int world_size_;
  std::vector<Tensor> held_;  // per bucket: its group-reduced part until the exchange
  std::int64_t block_ = 0;    // qgZ across groups: values per scale (0: exact)
  ops::QuantFormat format_ = ops::QuantFormat::int8;
  // qgZ's error feedback across groups, per bucket (kept across steps; allocated at the
  // bucket's first exchange): what the reduce-scatter's quantisation dropped from this rank's
  // group sums, and what the all-gather's dropped from the average of the segment it owns.
  std::vector<Tensor> sent_residuals_, gathered_residuals_;
};

}  // namespace shardkit::parallel
