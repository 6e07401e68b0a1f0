// OptimizerState: the whole optimizer state of a model, independent of how it was sharded -- one
// entry per trainable parameter, by name, each state buffer on the host in the parameter's own
// element order. It is what PyTorch's optimizer.state_dict() holds after FairScale's
// OSS.consolidate_state_dict(): DataParallel::consolidate_optimizer_state() builds it on one
// rank, and DataParallel::load_optimizer_state() re-shards it, for any stage, partition and
// world size (a checkpoint taken with 8 ranks resumes on 4).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"

namespace shardkit::optim {

struct ParamOptimizerState {
  std::string name;
  Shape shape;
  std::vector<float> buffer_a;  // SGD: momentum_buffer; Adam: exp_avg; empty when stateless
  std::vector<float> buffer_b;  // Adam: exp_avg_sq; empty otherwise
};

struct OptimizerState {
  OptimizerKind kind = OptimizerKind::sgd;
  std::int64_t steps = 0;                   // steps taken (SGD's first-step rule, Adam's bias correction)
  std::vector<ParamOptimizerState> params;  // trainable parameters, in registration order

  bool empty() const { return params.empty(); }
};

// PyTorch's names of the two buffers, for printing and for mapping onto torch checkpoints.
inline std::string_view state_buffer_name(OptimizerKind kind, int which) {
  const bool adam = kind == OptimizerKind::adam || kind == OptimizerKind::adamw;
  if (which == 0) return adam ? "exp_avg" : "momentum_buffer";
  return adam ? "exp_avg_sq" : "";
}

}  // namespace shardkit::optim
