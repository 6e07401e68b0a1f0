// An OptimizerState (optim/optimizer_state.hpp) as a safetensors file: one F32 tensor per
// parameter and buffer, named "<parameter>.<buffer>" with PyTorch's buffer names (e.g.
// "layer1.0.conv1.weight.momentum_buffer", "fc.bias.exp_avg_sq"), and the optimizer kind and
// step count in the metadata. Written atomically; what consolidate_optimizer_state() returns on
// the recipient is what save_optimizer_state() writes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/optim/optimizer_state.hpp"

namespace shardkit::checkpoint {

inline constexpr std::string_view kOptimizerStateFormat = "shardkit.optimizer_state.v1";

// The trainable parameters a state covers, by name and shape, in registration order.
using ParamShapes = std::vector<std::pair<std::string, Shape>>;

// The metadata of an optimizer-state file: format, optimizer kind, step count, and every
// trainable parameter by name and shape (JSON inside the string-only metadata) -- stateless
// ones too (before the first step, SGD without momentum), so a load can still check that the
// model matches.
inline std::map<std::string, std::string> optimizer_state_metadata(optim::OptimizerKind kind,
                                                                   std::int64_t steps,
                                                                   const ParamShapes& params) {
  nlohmann::json parameters = nlohmann::json::array();
  for (const auto& [name, shape] : params) parameters.push_back({{"name", name}, {"shape", shape}});
  return {{"format", std::string(kOptimizerStateFormat)},
          {"optimizer", std::string(optim::optimizer_kind_name(kind))},
          {"steps", std::to_string(steps)},
          {"parameters", parameters.dump()}};
}

// What optimizer_state_metadata() wrote (the format key aside), read back and checked.
struct OptimizerFileInfo {
  optim::OptimizerKind kind = optim::OptimizerKind::sgd;
  std::int64_t steps = 0;
  ParamShapes params;
};

inline std::int64_t parse_count(const SafetensorsReader& file, const std::string& key) {
  const std::string& text = file.meta(key, "it was not written by shardkit");
  std::size_t used = 0;
  std::int64_t value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check<IoError>(used == text.size() && !text.empty() && value >= 0, "'", file.path(),
                 "': metadata '", key, "' is '", text, "', not a count");
  return value;
}

inline OptimizerFileInfo parse_optimizer_metadata(const SafetensorsReader& file) {
  OptimizerFileInfo info;
  info.kind = optim::parse_optimizer_kind(file.meta("optimizer", "it was not written by shardkit"));
  info.steps = parse_count(file, "steps");
  try {
    for (const auto& entry :
         nlohmann::json::parse(file.meta("parameters", "it was not written by shardkit"))) {
      // (each dimension a non-negative integer and the product within 64 bits: a shape of
      // [-4] covered no elements and a rewrite dropped the parameter, silently)
      Shape shape;
      std::int64_t numel = 1;
      for (const auto& dim : entry.at("shape")) {
        check<IoError>(dim.is_number_unsigned() &&
                           dim.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX) &&
                           !__builtin_mul_overflow(numel, dim.get<std::int64_t>(), &numel),
                       "'", file.path(), "': metadata 'parameters' gives '",
                       entry.at("name").get<std::string>(), "' the shape ",
                       entry.at("shape").dump(),
                       "; dimensions are non-negative integers of at most 2^63 elements in all");
        shape.push_back(dim.get<std::int64_t>());
      }
      info.params.emplace_back(entry.at("name").get<std::string>(), std::move(shape));
    }
  } catch (const nlohmann::json::exception& e) {
    fail<IoError>("'", file.path(), "': metadata 'parameters' is malformed: ", e.what());
  }
  return info;
}

inline void save_optimizer_state(const std::string& path, const optim::OptimizerState& state) {
  std::vector<NamedBytes> tensors;
  ParamShapes params;
  for (const auto& p : state.params) {
    params.emplace_back(p.name, p.shape);
    for (const auto& [name, buffer] : p.buffers)
      if (!buffer.empty()) tensors.push_back(NamedBytes::of(p.name + "." + name, p.shape, buffer));
  }
  save_safetensors(path, tensors, optimizer_state_metadata(state.kind, state.steps, params));
}

inline optim::OptimizerState load_optimizer_state(const std::string& path) {
  const SafetensorsReader file(path);
  const std::string& format = file.meta("format", "it was not written by save_optimizer_state");
  check<IoError>(format == kOptimizerStateFormat, "'", path, "' holds '", format,
                 "', not an optimizer state (", kOptimizerStateFormat, ")");
  const auto info = parse_optimizer_metadata(file);
  optim::OptimizerState state;
  state.kind = info.kind;
  state.steps = info.steps;
  for (const auto& [name, shape] : info.params) {
    optim::ParamOptimizerState p;
    p.name = name;
    p.shape = shape;
    for (const auto buffer_name : optim::possible_state_buffers(state.kind)) {
      const TensorInfo* t = file.find(p.name + "." + std::string(buffer_name));
      if (t == nullptr) continue;
      check<IoError>(t->dtype == DType::f32 && t->shape == p.shape, "'", path, "': '", t->name,
                     "' is ", dtype_name(t->dtype), shape_text(t->shape), "; expected f32",
                     shape_text(p.shape));
      p.buffers[std::string(buffer_name)] = file.read(*t).values<float>();
    }
    state.params.push_back(std::move(p));
  }
  return state;
}

}  // namespace shardkit::checkpoint
