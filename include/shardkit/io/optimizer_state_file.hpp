// An OptimizerState (optim/optimizer_state.hpp) as a safetensors file: one F32 tensor per
// parameter and buffer, named "<parameter>.<buffer>" with PyTorch's buffer names (e.g.
// "layer1.0.conv1.weight.momentum_buffer", "fc.bias.exp_avg_sq"), and the optimizer kind and
// step count in the metadata. Written atomically; what consolidate_optimizer_state() returns on
// the recipient is what save_optimizer_state() writes.
#pragma once

#include <string>

#include "shardkit/io/safetensors.hpp"
#include "shardkit/optim/optimizer_state.hpp"

namespace shardkit::io {

inline constexpr std::string_view kOptimizerStateFormat = "shardkit.optimizer_state.v1";

inline void save_optimizer_state(const std::string& path, const optim::OptimizerState& state) {
  std::vector<NamedBytes> tensors;
  for (const auto& p : state.params)
    for (const auto& [name, buffer] : p.buffers)
      if (!buffer.empty()) tensors.push_back(NamedBytes::of(p.name + "." + name, p.shape, buffer));
  // Every trainable parameter by name and shape, in registration order (JSON inside the
  // string-only metadata): stateless ones too (before the first step, SGD without momentum),
  // so a load can still check that the model matches.
  nlohmann::json parameters = nlohmann::json::array();
  for (const auto& p : state.params) parameters.push_back({{"name", p.name}, {"shape", p.shape}});
  save_safetensors(path, tensors,
                   {{"format", std::string(kOptimizerStateFormat)},
                    {"optimizer", std::string(optim::optimizer_kind_name(state.kind))},
                    {"steps", std::to_string(state.steps)},
                    {"parameters", parameters.dump()}});
}

inline optim::OptimizerState load_optimizer_state(const std::string& path) {
  const auto file = load_safetensors(path);
  auto meta = [&](const char* key) -> const std::string& {
    const auto found = file.metadata.find(key);
    check<IoError>(found != file.metadata.end(), "'", path, "' lacks the metadata '", key,
                   "': it was not written by save_optimizer_state");
    return found->second;
  };
  check<IoError>(meta("format") == kOptimizerStateFormat, "'", path, "' holds '", meta("format"),
                 "', not an optimizer state (", kOptimizerStateFormat, ")");
  optim::OptimizerState state;
  state.kind = optim::parse_optimizer_kind(meta("optimizer"));
  try {
    state.steps = std::stoll(meta("steps"));
  } catch (const std::exception&) {
    fail<IoError>("'", path, "': metadata 'steps' is '", meta("steps"), "', not a number");
  }
  nlohmann::json parameters;
  try {
    parameters = nlohmann::json::parse(meta("parameters"));
    for (const auto& entry : parameters) {
      optim::ParamOptimizerState p;
      p.name = entry.at("name").get<std::string>();
      p.shape = entry.at("shape").get<Shape>();
      for (const auto buffer_name : optim::possible_state_buffers(state.kind)) {
        const NamedBytes* t = file.find(p.name + "." + std::string(buffer_name));
        if (t == nullptr) continue;
        check<IoError>(t->dtype == DType::f32 && t->shape == p.shape, "'", path, "': '", t->name,
                       "' is ", dtype_name(t->dtype), shape_str(t->shape), "; expected f32",
                       shape_str(p.shape));
        p.buffers[std::string(buffer_name)] = t->values<float>();
      }
      state.params.push_back(std::move(p));
    }
  } catch (const nlohmann::json::exception& e) {
    fail<IoError>("'", path, "': metadata 'parameters' is malformed: ", e.what());
  }
  return state;
}

}  // namespace shardkit::io
