// FlatParamGroup: one flat parameter (what FSDP2 calls a parameter group) -- its ShardPlan, this
// rank's storage of it with one view per parameter, the pieces this rank's optimizer updates,
// and the collectives that keep the ranks' copies in step. DataParallel is one group under a
// stage policy; FSDP is one group per unit.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/shard/flat_buffer.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

class FlatParamGroup {
 public:
  // Every rank keeps the whole flat buffer (ddp, oss, sdp), counted as parameters.
  FlatParamGroup(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
                 shard::PartitionKind partition)
      : ctx_(&ctx),
        comm_(&comm),
        plan_(specs, comm.size(), partition),
        params_(ctx, plan_.layout(), DType::f32, MemoryCategory::parameters) {}

  FlatParamGroup(const FlatParamGroup&) = delete;
  FlatParamGroup& operator=(const FlatParamGroup&) = delete;

  const shard::ShardPlan& plan() const { return plan_; }
  const shard::FlatBuffer& params() const { return params_; }
  const Tensor& param(std::size_t i) const { return params_[i]; }

  // The pieces this rank updates: every trainable parameter when `replicated` (DDP), else the
  // rank's range of the plan. Views of their parameter elements: piece_params().
  std::vector<shard::ParamPiece> updated_pieces(bool replicated) const {
    if (!replicated) return plan_.pieces(comm_->rank());
    std::vector<shard::ParamPiece> all;
    for (auto i : plan_.trainable_in_layout_order()) {
      const auto& slot = plan_.layout()[i];
      all.push_back(shard::ParamPiece{i, 0, slot.numel, slot.offset});
    }
    return all;
  }
  std::vector<Tensor> piece_params(const std::vector<shard::ParamPiece>& pieces) const {
    std::vector<Tensor> views;
    for (const auto& piece : pieces)
      views.push_back(params_.flat().slice(0, piece.flat_begin, piece.flat_begin + piece.numel()));
    return views;
  }

  // Makes every rank's parameters equal to `root`'s.
  void broadcast(int root) { comm_->broadcast(params_.flat(), root).wait(); }

  // Owners send their updated ranges to everyone: one all_gather_v over the rank-ordered
  // ranges. With `f16_wire` only the wire is f16: every rank's f32 master of its own range
  // stays exact (FairScale's broadcast_fp16 rounds it).
  void all_gather_owned(bool f16_wire) {
    const int rank = comm_->rank();
    const auto counts = plan_.counts();
    const Tensor trainable = params_.flat().slice(0, 0, plan_.trainable_end());
    if (!f16_wire) {
      comm_->all_gather_v(trainable, counts).wait();
      return;
    }
    Tensor wire = empty(*ctx_, {plan_.trainable_end()}, DType::f16, MemoryCategory::communication);
    copy(*ctx_, wire.slice(0, plan_.begin(rank), plan_.end(rank)),
         trainable.slice(0, plan_.begin(rank), plan_.end(rank)));
    comm_->all_gather_v(wire, counts).wait();
    for (int r = 0; r < comm_->size(); ++r)
      if (r != rank && plan_.numel(r) > 0)
        copy(*ctx_, trainable.slice(0, plan_.begin(r), plan_.end(r)),
             wire.slice(0, plan_.begin(r), plan_.end(r)));
  }

  // A parameter list that differs between ranks would make every collective wrong: compare
  // layout fingerprints (as two exact 32-bit halves in f64) with a max all-reduce of the values
  // and their negatives.
  void check_same_everywhere() {
    const std::uint64_t print = plan_.layout().fingerprint();
    std::vector<double> values = {
        static_cast<double>(print >> 32), static_cast<double>(print & 0xffffffffu),
        -static_cast<double>(print >> 32), -static_cast<double>(print & 0xffffffffu)};
    Tensor t = from_vector(*ctx_, values, {4});
    comm_->all_reduce(t, comm::ReduceOp::max).wait();
    const auto reduced = to_vector<double>(*ctx_, t);
    check(reduced[0] == -reduced[2] && reduced[1] == -reduced[3],
          "the parameter list differs between ranks (names, shapes, order or trainable flags): "
          "rank ",
          comm_->rank(), " has ", plan_.layout().size(), " parameters with fingerprint ", print,
          "; build the same model on every rank");
  }

 private:
  Context* ctx_;
  comm::Communicator* comm_;
  shard::ShardPlan plan_;
  shard::FlatBuffer params_;
};

}  // namespace shardkit::parallel
