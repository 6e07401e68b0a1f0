// ReplicaSync: the second level of a hybrid reduction (comm/hybrid_mesh.hpp), which the
// gradient strategies (grad_sync.hpp) run when a bucket's group is one of several replicas.
#pragma once

#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::parallel {

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

  comm::Communicator* replicas_;
  int world_size_;
  std::vector<Tensor> held_;  // per bucket: its group-reduced part until the exchange
};

}  // namespace shardkit::parallel
