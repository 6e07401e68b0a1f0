// TensorScales: the per-tensor scales of qwZ's per-tensor-scaled gathers (FSDP2's float8
// all-gather; ops/quantize.hpp, QuantScale::tensor), for every unit of an engine at once.
//
// A tensor's scale is the largest |x| of its values over the ranks' shards, so every rank
// quantises and dequantises it alike. The shards change only at a step (or a load, or values
// written), so the maxima of every unit are computed together at the first such gather after a
// change -- each unit's shard's slot maxima side by side in one buffer, one all-reduce (max) of
// it over the group -- and serve each unit's gathers (forward and backward) until the next
// change: one small collective per step instead of one per gather, as torchao's
// precompute_float8_dynamic_scale_for_fsdp does after the optimizer step. The maxima are the
// same as a per-gather all-reduce's (max is exact), so are the codes.
#pragma once

#include <cstdint>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/parallel/flat_param.hpp"

namespace shardkit::parallel {

class TensorScales {
 public:
  // The sharded units' flat parameters, in unit order (each must outlive this), over `comm`,
  // their shard group.
  TensorScales(comm::Communicator& comm, std::vector<FlatParam*> flats)
      : comm_(&comm), flats_(std::move(flats)) {}

  // The shards are about to change: the next scales() computes the maxima again.
  void forget() { fresh_ = false; }

  // Unit u's slot maxima over the group (f32, its layout's size + 1: the last slot the
  // padding's), computed with every unit's when they are stale -- and at a captured step's
  // first such gather whatever they are: a CUDA graph replays only the device work it
  // captured, so maxima computed before the capture began would serve every replay.
  // Collective when computed: every rank reaches it at the same gather, since the changes, the
  // captures and the gathers are collective.
  Tensor scales(std::size_t u) {
    Context& ctx = flats_.front()->context();
    if (!fresh_ || (ctx.capturing() && refreshed_in_capture_ != ctx.capture_serial())) refresh();
    return maxima_.slice(0, at_[u], at_[u + 1]);
  }

 private:
  void refresh() {
    if (!maxima_.defined()) {  // (the first gather, a warm-up step's: outside any capture)
      at_.assign(1, 0);
      for (FlatParam* flat : flats_) at_.push_back(at_.back() + flat->slot_chunks().slots);
      maxima_ =
          empty(flats_.front()->context(), {at_.back()}, DType::f32, MemoryCategory::communication);
    }
    Context& ctx = flats_.front()->context();
    fill(ctx, maxima_, 0.0);  // (slot_abs_max raises each slot to its values' largest |x|)
    const int rank = comm_->rank();
    for (std::size_t u = 0; u < flats_.size(); ++u)
      ops::slot_abs_max(ctx, flats_[u]->shard(), flats_[u]->slot_chunks().of(rank),
                        maxima_.slice(0, at_[u], at_[u + 1]));
    auto label = comm_->label("per-tensor qwZ scales: every unit's maxima");
    comm_->all_reduce(maxima_, comm::ReduceOp::max).wait_on_stream();
    fresh_ = true;
    if (ctx.capturing()) refreshed_in_capture_ = ctx.capture_serial();
  }

  comm::Communicator* comm_;
  std::vector<FlatParam*> flats_;
  std::vector<std::int64_t> at_;            // unit u's slots are [at_[u], at_[u + 1]) of maxima_
  Tensor maxima_;                           // every unit's slot maxima, side by side
  bool fresh_ = false;                      // maxima_ holds the current shards' maxima
  std::uint64_t refreshed_in_capture_ = 0;  // the capture that computed them last (0: none)
};

}  // namespace shardkit::parallel
