// What optimizer runs: its kind and options (PyTorch's names), the parameters without weight
// decay, and the state buffers it keeps per parameter.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/ops/adam.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::optim {

enum class OptimizerKind { sgd, larc_sgd, adam, adamw };

inline constexpr EnumName<OptimizerKind> kOptimizerKindNames[] = {
    {OptimizerKind::sgd, "sgd"},
    {OptimizerKind::larc_sgd, "larc_sgd"},
    {OptimizerKind::adam, "adam"},
    {OptimizerKind::adamw, "adamw"}};

inline std::string_view optimizer_kind_name(OptimizerKind kind) {
  return name_of(kind, kOptimizerKindNames);
}

inline OptimizerKind parse_optimizer_kind(std::string_view name) {
  return parse_name(name, kOptimizerKindNames, "optimizer");
}

inline bool is_adam(OptimizerKind kind) {
  return kind == OptimizerKind::adam || kind == OptimizerKind::adamw;
}

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  ops::SgdOptions sgd;    // sgd, larc_sgd (lr is set per step)
  ops::LarcOptions larc;  // larc_sgd: takes sgd.weight_decay over
  ops::AdamOptions adam;  // adam, adamw
  // Trainable parameters (state-dict names) that get no weight decay: PyTorch's parameter group
  // with weight_decay 0, which VISSL builds for batch-norm parameters and biases when
  // regularize_bn / regularize_bias are False. Under LARC the decay is also left out of the
  // trust ratio, as apex's LARC reads it from the group. sgd and larc_sgd.
  std::vector<std::string> no_weight_decay;
};

// PyTorch's names of the state buffers an optimizer keeps per parameter, in order.
inline std::vector<std::string_view> state_buffer_names(const OptimizerConfig& config) {
  if (is_adam(config.kind)) return {"exp_avg", "exp_avg_sq"};
  if (config.sgd.momentum != 0) return {"momentum_buffer"};
  return {};
}

// One state buffer of a rank: its PyTorch name and its values over the rank's state range.
struct StateBuffer {
  std::string_view name;
  Tensor values;
};

}  // namespace shardkit::optim
