// DataParallel: DDP, OSS (ZeRO-1) and SDP (ZeRO-2) for training loops whose forward and
// backward the user writes. The user reads parameters from params(), adds each gradient into
// grad(i) and calls ready(i) from the backward; finish() waits for the communication; step()
// updates the parameters. Results equal DDP's; memory per rank follows the ZeRO stage:
//
//   ddp: full gradients, averaged in buckets (all-reduce); every rank steps every parameter.
//   oss: as ddp, but optimizer state only for the rank's range; owners update it and the
//        parameters are re-assembled with one all_gather_v (optionally f16 on the wire, while
//        the owner's f32 master stays exact -- FairScale rounds it; we do not).
//   sdp: gradients reduced to their owners (reduce_scatter_v per bucket); a rank keeps only its
//        range's gradients plus transient bucket buffers; then as oss.
//
// consolidate_optimizer_state() gathers the whole optimizer state on one rank, by parameter
// name; load_optimizer_state() re-shards it for any stage, partition or world size.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/shard/flat_buffer.hpp"
#include "shardkit/shard/grad_bucketer.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

enum class Stage { ddp, oss, sdp };

inline std::string_view stage_name(Stage stage) {
  switch (stage) {
    case Stage::ddp:
      return "ddp";
    case Stage::oss:
      return "oss";
    case Stage::sdp:
      return "sdp";
  }
  return "?";
}

inline Stage parse_stage(std::string_view name) {
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp})
    if (stage_name(stage) == name) return stage;
  fail<InvalidArgument>("unknown ZeRO stage '", name, "'; use ddp, oss (ZeRO-1) or sdp (ZeRO-2)");
}

struct DataParallelOptions {
  Stage stage = Stage::ddp;
  shard::PartitionKind partition = shard::PartitionKind::greedy;
  shard::BucketerOptions buckets;
  bool broadcast_fp16 = false;  // oss/sdp: parameters travel as f16 after the step
};

template <class Backend>
class DataParallel {
 public:
  DataParallel(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
               optim::OptimizerConfig optimizer, DataParallelOptions options = {})
      : ctx_(&ctx),
        comm_(&comm),
        options_(options),
        plan_(specs, comm.size(), options.partition),
        params_(ctx, plan_.layout(), DType::f32, MemoryCategory::parameters),
        bucketer_(ctx, comm, plan_,
                  options.stage == Stage::sdp ? shard::GradSync::reduce_scatter
                                              : shard::GradSync::all_reduce,
                  options.buckets),
        table_(shard::PieceTable::of_plan(plan_, options.stage == Stage::ddp)),
        pieces_(my_pieces()),
        optimizer_(make_optimizer(optimizer)) {
    for (const auto& piece : pieces_) piece_grads_.push_back(bucketer_.piece_grad(piece));
    check_same_parameters_everywhere();
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Stage stage() const { return options_.stage; }
  const shard::ShardPlan& plan() const { return plan_; }
  const shard::FlatBuffer& params() const { return params_; }
  const Tensor& param(std::size_t i) const { return params_[i]; }
  comm::Communicator& communicator() const { return *comm_; }

  // Makes every rank's parameters equal to `root`'s (after each rank initialised its own).
  void broadcast_parameters(int root = 0) { comm_->broadcast(params_.flat(), root).wait(); }

  // Backward side: add the gradient of parameter i into grad(i), then ready(i).
  Tensor grad(std::size_t i) { return bucketer_.grad(i); }
  void ready(std::size_t i) { bucketer_.ready(i); }
  void finish() { bucketer_.finish(); }
  void zero_grad() { bucketer_.zero_grad(); }
  shard::GradBucketer& bucketer() { return bucketer_; }

  // Gradient accumulation: while the returned scope lives, backwards accumulate locally.
  class NoSync {
   public:
    explicit NoSync(shard::GradBucketer& b) : bucketer_(&b) { bucketer_->set_sync(false); }
    ~NoSync() { bucketer_->set_sync(true); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    shard::GradBucketer* bucketer_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(bucketer_); }

  // Updates the parameters with the averaged gradients of the last synchronised backward.
  void step(float lr, float inv_grad_scale = 1.0f) {
    check<StateError>(bucketer_.finished(),
                      "optimizer step before the gradients are finished: call finish() after "
                      "the (synchronised) backward, then step()");
    optimizer_.step(piece_grads_, lr, inv_grad_scale);
    if (options_.stage != Stage::ddp) sync_parameters(comm_->rank());
  }

  const optim::ShardedOptimizer<Backend>& optimizer() const { return optimizer_; }

  // The whole optimizer state on `recipient`, an empty OptimizerState on the other ranks
  // (FairScale's consolidate_state_dict; optim/consolidation.hpp). Collective.
  optim::OptimizerState consolidate_optimizer_state(int recipient = 0) {
    return optim::consolidate_optimizer_state(optimizer_, *comm_, recipient);
  }

  // Takes this rank's share of a whole optimizer state (from consolidate_optimizer_state, on any
  // stage, partition or world size); parameters are matched by name.
  void load_optimizer_state(const optim::OptimizerState& state) {
    optim::load_optimizer_state(optimizer_, state);
  }

 private:
  // The pieces this rank updates: every trainable parameter under DDP, the rank's range of the
  // plan otherwise; in the order of the PieceTable's row for this rank.
  std::vector<shard::ParamPiece> my_pieces() const {
    if (options_.stage != Stage::ddp) return plan_.pieces(comm_->rank());
    std::vector<shard::ParamPiece> all;
    for (auto i : plan_.trainable_in_layout_order()) {
      const auto& slot = plan_.layout()[i];
      all.push_back(shard::ParamPiece{i, 0, slot.numel, slot.offset});
    }
    return all;
  }

  optim::ShardedOptimizer<Backend> make_optimizer(const optim::OptimizerConfig& config) {
    std::vector<Tensor> views;
    for (const auto& piece : pieces_)
      views.push_back(params_.flat().slice(0, piece.flat_begin, piece.flat_begin + piece.numel()));
    comm::Communicator* norms = table_.any_parameter_spans_ranks() ? comm_ : nullptr;
    return optim::ShardedOptimizer<Backend>(*ctx_, table_, comm_->rank(), std::move(views), config,
                                            norms);
  }

  // Owners send their updated ranges to everyone: one all_gather_v over the rank-ordered ranges.
  void sync_parameters(int rank) {
    const auto counts = plan_.counts();
    const Tensor trainable = params_.flat().slice(0, 0, plan_.trainable_end());
    if (!options_.broadcast_fp16) {
      comm_->all_gather_v(trainable, counts).wait();
      return;
    }
    // f16 on the wire only: every rank's f32 master of its own range stays exact.
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
  // layout fingerprints (as two exact 32-bit halves in f64) with a max and a min all-reduce.
  void check_same_parameters_everywhere() {
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

  Context* ctx_;
  comm::Communicator* comm_;
  DataParallelOptions options_;
  shard::ShardPlan plan_;
  shard::FlatBuffer params_;
  shard::GradBucketer bucketer_;
  shard::PieceTable table_;
  std::vector<shard::ParamPiece> pieces_;  // what this rank updates, in table order
  optim::ShardedOptimizer<Backend> optimizer_;
  std::vector<Tensor> piece_grads_;  // the averaged gradient of each piece the optimizer updates
};

}  // namespace shardkit::parallel
