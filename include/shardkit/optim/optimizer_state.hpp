// OptimizerState: the whole optimizer state of a model, independent of how it was sharded -- one
// entry per trainable parameter, by name, each state buffer on the host in the parameter's own
// element order, under PyTorch's buffer names. It is what PyTorch's optimizer.state_dict() holds
// after FairScale's OSS.consolidate_state_dict(): consolidate_optimizer_state() builds it on one
// rank, and load_optimizer_state() re-shards it for any stage, partition and world size
// (optim/consolidation.hpp).
#pragma once

#include <cstdint>
#include <map>
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
  // By PyTorch's names: momentum_buffer (SGD), exp_avg and exp_avg_sq (Adam). None when the
  // optimizer keeps no state (SGD without momentum); zeros before its first step, where the
  // state's `steps` of 0 says that the first-step rule is still ahead (PyTorch keeps no buffer
  // until then). The hyperparameters are not here: a resume takes them from its own config.
  std::map<std::string, std::vector<float>, std::less<>> buffers;

  // The buffer `name`, or an empty vector when there is none.
  const std::vector<float>& buffer(std::string_view name) const {
    static const std::vector<float> kNone;
    const auto found = buffers.find(name);
    return found == buffers.end() ? kNone : found->second;
  }
};

struct OptimizerState {
  OptimizerKind kind = OptimizerKind::sgd;
  std::int64_t steps = 0;  // steps taken (SGD's first-step rule, Adam's bias correction)
  std::vector<ParamOptimizerState> params;  // trainable parameters, in registration order

  bool empty() const { return params.empty(); }
};

// The buffer names an optimizer of `kind` may keep (what a file of that kind can hold).
inline std::vector<std::string_view> possible_state_buffers(OptimizerKind kind) {
  if (is_adam(kind)) return {"exp_avg", "exp_avg_sq"};
  return {"momentum_buffer"};
}

}  // namespace shardkit::optim
