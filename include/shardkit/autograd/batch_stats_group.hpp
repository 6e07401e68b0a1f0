// The ranks whose batch statistics a synchronised batch-norm (SyncBatchNorm) combines. autograd
// sits below the communicators, so it sees them only through this interface;
// parallel/sync_batch_norm.hpp implements it over a communicator (a group split from the world,
// VISSL's SYNC_BN_CONFIG.GROUP_SIZE).
#pragma once

#include "shardkit/core/tensor.hpp"

namespace shardkit::autograd {

class BatchStatsGroup {
 public:
  virtual ~BatchStatsGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Every member's `local` (f64 [n], on the context's device), rank-major: [size * n]. Members
  // combine the gathered values in rank order, so each computes the same bits.
  virtual Tensor all_gather(Context& ctx, const Tensor& local) = 0;
  // Elementwise sum over the members, in place (f64, on the context's device).
  virtual void all_reduce_sum(Context& ctx, const Tensor& values) = 0;
};

}  // namespace shardkit::autograd
