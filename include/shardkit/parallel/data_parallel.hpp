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
#include <unordered_map>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/shard/flat_buffer.hpp"
#include "shardkit/shard/grad_bucketer.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

enum class Stage { ddp, oss, sdp };

inline std::string_view stage_name(Stage stage) {
  switch (stage) {
    case Stage::ddp: return "ddp";
    case Stage::oss: return "oss";
    case Stage::sdp: return "sdp";
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
      : ctx_(&ctx), comm_(&comm), options_(options),
        plan_(specs, comm.size(), options.partition),
        params_(ctx, plan_.layout(), DType::f32, MemoryCategory::parameters),
        bucketer_(ctx, comm, plan_,
                  options.stage == Stage::sdp ? shard::GradSync::reduce_scatter
                                              : shard::GradSync::all_reduce,
                  options.buckets),
        optimizer_(make_optimizer(optimizer)) {
    for (const auto& piece : optimizer_.pieces()) piece_grads_.push_back(bucketer_.piece_grad(piece));
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
  void broadcast_parameters(int root = 0) {
    comm_->broadcast(params_.flat(), root).wait();
  }

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
    optimizer_.step(params_.flat(), piece_grads_, lr, inv_grad_scale);
    if (options_.stage != Stage::ddp) sync_parameters(comm_->rank());
  }

  const optim::ShardedOptimizer<Backend>& optimizer() const { return optimizer_; }

  // The whole optimizer state on `recipient`, an empty OptimizerState on the other ranks
  // (FairScale's consolidate_state_dict). Collective: every rank calls it. Under oss/sdp each
  // owner broadcasts its range in turn, so a rank holds at most one other range at a time,
  // never the whole state; only the recipient keeps what it receives (on the host).
  optim::OptimizerState consolidate_optimizer_state(int recipient = 0) {
    check(recipient >= 0 && recipient < comm_->size(), "consolidate_optimizer_state: recipient ",
          recipient, " is not a rank of this ", comm_->size(), "-rank job; pass 0..",
          comm_->size() - 1);
    const bool here = comm_->rank() == recipient;
    const auto& layout = plan_.layout();
    optim::OptimizerState out;
    std::vector<std::size_t> entry_of(layout.size(), 0);  // layout index -> out.params index
    const Tensor* buffers[2] = {&optimizer_.state_a(), &optimizer_.state_b()};
    if (here) {
      out.kind = optimizer_.config().kind;
      out.steps = optimizer_.steps();
      for (std::size_t i = 0; i < layout.size(); ++i) {
        if (!layout[i].trainable) continue;
        entry_of[i] = out.params.size();
        optim::ParamOptimizerState entry{layout[i].name, layout[i].shape, {}, {}};
        const auto n = static_cast<std::size_t>(layout[i].numel);
        if (buffers[0]->defined()) entry.buffer_a.resize(n);
        if (buffers[1]->defined()) entry.buffer_b.resize(n);
        out.params.push_back(std::move(entry));
      }
    }
    // A range [region_begin, ...) of the flat buffer's state, cut back into its parameters.
    auto scatter = [&](const std::vector<shard::ParamPiece>& pieces, std::int64_t region_begin,
                       int which, const std::vector<float>& region) {
      for (const auto& piece : pieces) {
        auto& entry = out.params[entry_of[piece.param]];
        auto& dst = which == 0 ? entry.buffer_a : entry.buffer_b;
        std::copy_n(region.begin() + (piece.flat_begin - region_begin), piece.numel(),
                    dst.begin() + piece.param_begin);
      }
    };
    for (int which = 0; which < 2; ++which) {
      if (!buffers[which]->defined()) continue;
      if (options_.stage == Stage::ddp) {  // every rank holds everything: nothing to send
        if (here) scatter(optimizer_.pieces(), 0, which, to_vector<float>(*ctx_, *buffers[which]));
        continue;
      }
      for (int owner = 0; owner < comm_->size(); ++owner) {
        const std::int64_t count = plan_.numel(owner);
        if (count == 0) continue;
        const Tensor range = comm_->rank() == owner
                                 ? *buffers[which]
                                 : empty(*ctx_, {count}, DType::f32, MemoryCategory::communication);
        comm_->broadcast(range, owner).wait();
        if (here) scatter(plan_.pieces(owner), plan_.begin(owner), which, to_vector<float>(*ctx_, range));
      }
    }
    return out;
  }

  // Takes this rank's share of a whole optimizer state (from consolidate_optimizer_state, on any
  // stage, partition or world size). Every rank passes the whole state, as with PyTorch's
  // load_state_dict under FairScale's OSS; parameters are matched by name.
  void load_optimizer_state(const optim::OptimizerState& state) {
    const auto& config = optimizer_.config();
    check(state.kind == config.kind, "load_optimizer_state: the state is for ",
          optim::optimizer_kind_name(state.kind), " but this optimizer is ",
          optim::optimizer_kind_name(config.kind),
          "; build the optimizer the checkpoint was written with");
    check(state.steps >= 0, "load_optimizer_state: steps is ", state.steps, "; it must be >= 0");
    const auto& layout = plan_.layout();
    std::unordered_map<std::string_view, const optim::ParamOptimizerState*> by_name;
    for (const auto& entry : state.params) by_name.emplace(entry.name, &entry);
    std::vector<const optim::ParamOptimizerState*> entry_of(layout.size(), nullptr);
    std::size_t trainable = 0;
    const Tensor* buffers[2] = {&optimizer_.state_a(), &optimizer_.state_b()};
    // Checked on every rank for every parameter, so all ranks fail alike, before any write.
    for (std::size_t i = 0; i < layout.size(); ++i) {
      if (!layout[i].trainable) continue;
      ++trainable;
      const auto found = by_name.find(layout[i].name);
      check(found != by_name.end(), "load_optimizer_state: the state has no entry for parameter '",
            layout[i].name, "'; it was written for a different model");
      const auto& entry = *found->second;
      check(entry.shape == layout[i].shape, "load_optimizer_state: parameter '", layout[i].name,
            "' has shape ", shape_str(layout[i].shape), " here but ", shape_str(entry.shape),
            " in the state; it was written for a different model");
      for (int which = 0; which < 2; ++which) {
        const auto& src = which == 0 ? entry.buffer_a : entry.buffer_b;
        const auto name = optim::state_buffer_name(config.kind, which);
        if (!buffers[which]->defined()) {
          check(src.empty(), "load_optimizer_state: the state has a ", name, " for '", entry.name,
                "' but this optimizer keeps none (momentum 0?); configure it as when it was saved");
        } else {
          check(src.empty() ? state.steps == 0 : src.size() == static_cast<std::size_t>(layout[i].numel),
                "load_optimizer_state: '", entry.name, "' has ", src.size(), " ", name,
                " values; expected ", layout[i].numel, " (or none before the first step)");
        }
      }
      entry_of[i] = &entry;
    }
    check(state.params.size() == trainable, "load_optimizer_state: the state has ",
          state.params.size(), " parameters, this model ", trainable,
          " trainable ones; it was written for a different model");
    for (int which = 0; which < 2; ++which) {
      if (!buffers[which]->defined()) continue;
      fill(*ctx_, *buffers[which], 0.0);  // what a state saved before the first step means
      for (const auto& piece : optimizer_.pieces()) {
        const auto& src = which == 0 ? entry_of[piece.param]->buffer_a : entry_of[piece.param]->buffer_b;
        if (src.empty()) continue;
        const std::int64_t at = piece.flat_begin - optimizer_.region_begin();
        auto host = Storage::borrow(const_cast<float*>(src.data() + piece.param_begin),
                                    static_cast<std::size_t>(piece.numel()) * sizeof(float), Device::cpu());
        copy(*ctx_, buffers[which]->slice(0, at, at + piece.numel()),
             Tensor(host, {piece.numel()}, DType::f32));
      }
    }
    optimizer_.set_steps(state.steps);
  }

 private:
  optim::ShardedOptimizer<Backend> make_optimizer(const optim::OptimizerConfig& config) {
    const int rank = comm_->rank();
    if (options_.stage == Stage::ddp) {
      std::vector<shard::ParamPiece> all;
      for (auto i : plan_.trainable_in_layout_order()) {
        const auto& slot = plan_.layout()[i];
        all.push_back(shard::ParamPiece{i, 0, slot.numel, slot.offset});
      }
      return optim::ShardedOptimizer<Backend>(*ctx_, plan_, std::move(all), 0, plan_.trainable_end(),
                                          config, nullptr);
    }
    comm::Communicator* norms = plan_.any_parameter_spans_ranks() ? comm_ : nullptr;
    return optim::ShardedOptimizer<Backend>(*ctx_, plan_, plan_.pieces(rank), plan_.begin(rank),
                                        plan_.numel(rank), config, norms);
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
    std::vector<double> values = {static_cast<double>(print >> 32), static_cast<double>(print & 0xffffffffu),
                                  -static_cast<double>(print >> 32),
                                  -static_cast<double>(print & 0xffffffffu)};
    Tensor t = from_vector(*ctx_, values, {4});
    comm_->all_reduce(t, comm::ReduceOp::max).wait();
    const auto reduced = to_vector<double>(*ctx_, t);
    check(reduced[0] == -reduced[2] && reduced[1] == -reduced[3],
          "the parameter list differs between ranks (names, shapes, order or trainable flags): "
          "rank ", comm_->rank(), " has ", plan_.layout().size(), " parameters with fingerprint ",
          print, "; build the same model on every rank");
  }

  Context* ctx_;
  comm::Communicator* comm_;
  DataParallelOptions options_;
  shard::ShardPlan plan_;
  shard::FlatBuffer params_;
  shard::GradBucketer bucketer_;
  optim::ShardedOptimizer<Backend> optimizer_;
  std::vector<Tensor> piece_grads_;  // the averaged gradient of each piece the optimizer updates
};

}  // namespace shardkit::parallel
