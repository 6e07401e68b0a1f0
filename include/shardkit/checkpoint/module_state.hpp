// A module's state dict (parameters and buffers under PyTorch's names, e.g.
// "layer1.0.conv1.weight", "bn1.num_batches_tracked") as a safetensors file: what torchvision's
// model.load_state_dict(safetensors.torch.load_file(path)) reads, and the reverse. Written
// atomically (io/safetensors.hpp).
#pragma once

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/nn/module.hpp"

namespace shardkit::checkpoint {

inline void save_module(const std::string& path, Context& ctx, const nn::Module& module,
                        const std::map<std::string, std::string>& metadata = {{"format", "pt"}}) {
  std::vector<NamedBytes> tensors;
  for (const auto& [name, t] : module.state_dict()) tensors.push_back(host_bytes(ctx, name, t));
  save_safetensors(path, tensors, metadata);
}

struct LoadReport {
  std::vector<std::string> missing;     // in the module, not in the file
  std::vector<std::string> unexpected;  // in the file, not in the module
};

// Copies the file's tensors into the module's parameters and buffers (on its device). With
// `strict` (PyTorch's default) missing or unexpected names are an error; otherwise they are
// reported. A shape or dtype that differs is always an error: nothing is converted silently.
inline LoadReport load_module(const std::string& path, Context& ctx, nn::Module& module,
                              bool strict = true) {
  const auto file = load_safetensors(path);
  std::unordered_map<std::string, const NamedBytes*> by_name;
  for (const auto& t : file.tensors) by_name.emplace(t.name, &t);
  LoadReport report;
  const auto state = module.state_dict();
  std::unordered_map<std::string, bool> known;
  for (const auto& [name, target] : state) {
    known.emplace(name, true);
    if (!by_name.count(name)) report.missing.push_back(name);
  }
  for (const auto& t : file.tensors)
    if (!known.count(t.name)) report.unexpected.push_back(t.name);
  auto joined = [](const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
    if (names.size() > 8) out += ", ... (" + std::to_string(names.size()) + " in all)";
    return out;
  };
  check<IoError>(!strict || (report.missing.empty() && report.unexpected.empty()), "'", path,
                 "' does not match the module: missing [", joined(report.missing),
                 "], unexpected [", joined(report.unexpected),
                 "]; load with strict = false to take what matches");
  // Check everything before the first write, so a bad file leaves the module as it was.
  for (const auto& [name, target] : state) {
    const auto found = by_name.find(name);
    if (found == by_name.end()) continue;
    const NamedBytes& t = *found->second;
    check<IoError>(t.shape == target.shape() && t.dtype == target.dtype(), "'", path, "': '", name,
                   "' is ", dtype_name(t.dtype), shape_text(t.shape), " in the file but ",
                   dtype_name(target.dtype()), shape_text(target.shape()),
                   " in the module; build the module the checkpoint was written from");
  }
  for (const auto& [name, target] : state) {
    const auto found = by_name.find(name);
    if (found == by_name.end()) continue;
    copy_to_tensor(ctx, *found->second, target);
  }
  return report;
}

}  // namespace shardkit::checkpoint
