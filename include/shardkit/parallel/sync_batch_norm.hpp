// SyncBatchNorm: batch-norm whose training statistics are those of a group of ranks' whole
// batch (PyTorch's SyncBatchNorm, apex's with a process group; VISSL's SYNC_BN_CONFIG). Small
// per-rank batches then normalise like one large batch, which SwAV's recipe relies on.
//
//   auto group = parallel::sync_batch_norm_group(world, 8);   // collective: ranks 0-7, 8-15, ...
//   parallel::convert_sync_batch_norm(*model, group);         // every BatchNorm of the model
//
// Groups are consecutive ranks, as VISSL splits the world: group_size 3 of 8 ranks gives
// {0,1,2}, {3,4,5}, {6,7}. Each group gets its own communicator, so the statistics exchanges
// never interleave with the data-parallel engines' traffic on the world communicator.
// Parameter gradients stay per rank (the engines average them); the state dict is unchanged.
#pragma once

#include <memory>

#include "shardkit/autograd/batch_stats_group.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/nn/layers.hpp"

namespace shardkit::parallel {

// A communicator seen as a batch-statistics group.
class CommunicatorStatsGroup final : public autograd::BatchStatsGroup {
 public:
  explicit CommunicatorStatsGroup(std::shared_ptr<comm::Communicator> comm)
      : comm_(std::move(comm)) {
    check(comm_ != nullptr, "CommunicatorStatsGroup: the communicator is null");
  }
  int size() const override { return comm_->size(); }
  int rank() const override { return comm_->rank(); }
  Tensor all_gather(Context& ctx, const Tensor& local) override {
    Tensor all = empty(ctx, {comm_->size() * local.numel()}, local.dtype());
    comm_->all_gather(local, all).wait_on_stream();
    return all;
  }
  void all_reduce_sum(Context&, const Tensor& values) override {
    comm_->all_reduce(values, comm::ReduceOp::sum).wait_on_stream();
  }
  comm::Communicator& communicator() { return *comm_; }

 private:
  std::shared_ptr<comm::Communicator> comm_;
};

// Splits `world` into groups of `group_size` consecutive ranks (the last may be smaller) and
// returns this rank's. Collective: every rank of `world` calls it.
inline std::shared_ptr<CommunicatorStatsGroup> sync_batch_norm_group(comm::Communicator& world,
                                                                     int group_size) {
  check(group_size >= 1, "sync_batch_norm_group: group_size ", group_size, " must be at least 1 (",
        world.size(), " for the whole world)");
  const int color = world.rank() / group_size;
  return std::make_shared<CommunicatorStatsGroup>(
      std::shared_ptr<comm::Communicator>(world.split(color, world.rank())));
}

// Makes every BatchNorm in `module` synchronise over `group`; returns how many. A group of one
// rank keeps the per-rank statistics bit for bit.
inline int convert_sync_batch_norm(nn::Module& module,
                                   std::shared_ptr<autograd::BatchStatsGroup> group) {
  check(group != nullptr, "convert_sync_batch_norm: the group is null");
  int converted = 0;
  for (auto& [name, m] : module.named_modules())
    if (auto* bn = dynamic_cast<nn::BatchNorm*>(m)) {
      bn->options.sync = group;
      ++converted;
    }
  return converted;
}

}  // namespace shardkit::parallel
