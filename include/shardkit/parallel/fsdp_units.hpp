// FSDP units: which modules of a tree get their own flat parameter, and which parameters each
// one owns. A unit owns the parameters below its module that no deeper unit claims; the root
// unit owns what no unit claims. Units come from an explicit list of module paths or from the
// auto-wrap policy by size (FairScale's / PyTorch's size_based_auto_wrap_policy): visiting the
// tree children first, a module whose still-unclaimed parameters number at least
// min_num_params becomes a unit and claims them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardkit/nn/module.hpp"
#include "shardkit/parallel/options.hpp"

namespace shardkit::parallel {

struct FsdpUnitSpec {
  std::string path;                 // module path; "" for the root unit
  nn::Module* module;               // whose forward gathers the unit
  std::vector<std::string> params;  // state-dict names of the parameters the unit owns
};

namespace detail {

inline bool is_below(const std::string& name, const std::string& path) {
  return path.empty() || (name.size() > path.size() && name.compare(0, path.size(), path) == 0 &&
                          name[path.size()] == '.');
}

}  // namespace detail

// The units of `root` in forward-registration order (each unit before the units nested in it
// are not guaranteed: order is the module tree's depth-first order), the root unit last.
// Throws for unknown paths, a policy that wraps nothing, and tied parameters.
inline std::vector<FsdpUnitSpec> plan_fsdp_units(nn::Module& root, const FsdpWrapPolicy& policy) {
  const auto params = root.named_parameters();
  // Tied weights: one memory under two names would be sharded twice and updated twice.
  std::unordered_map<const void*, std::string> seen;
  for (const auto& [name, p] : params) {
    const auto [it, inserted] = seen.emplace(p.data().storage().get(), name);
    check(inserted, "parameters '", it->second, "' and '", name,
          "' share memory (tied weights); FSDP shards every parameter once: untie them (give "
          "each its own tensor) or train this model with ddp, oss or sdp");
  }

  auto modules = root.named_modules();
  std::map<std::string, nn::Module*> by_path(modules.begin(), modules.end());
  std::vector<std::string> unit_paths;
  for (const auto& path : policy.unit_paths) {
    check(!path.empty(), "FSDP unit path is empty; the root is always a unit, list sub-modules");
    auto it = by_path.find(path);
    if (it == by_path.end()) {
      std::string known;
      int listed = 0;
      for (const auto& [p, m] : by_path)
        if (!p.empty() && listed++ < 12) known += (known.empty() ? "'" : ", '") + p + "'";
      fail<InvalidArgument>("FSDP unit '", path, "' names no module of the model; modules are ",
                            known, listed > 12 ? ", ..." : "");
    }
    unit_paths.push_back(path);
  }
  std::vector<bool> claimed(params.size(), false);
  auto owned_below = [&](const std::string& path) {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (!claimed[i] && detail::is_below(params[i].first, path)) out.push_back(i);
    return out;
  };

  std::vector<FsdpUnitSpec> units;
  auto add_unit = [&](const std::string& path, nn::Module* module) {
    FsdpUnitSpec unit{path, module, {}};
    for (auto i : owned_below(path)) {
      claimed[i] = true;
      unit.params.push_back(params[i].first);
    }
    if (!unit.params.empty()) units.push_back(std::move(unit));
  };
  if (!unit_paths.empty()) {
    // Deepest first, so a nested unit claims its parameters before the unit around it.
    std::vector<std::string> order = unit_paths;
    std::stable_sort(order.begin(), order.end(), [](const std::string& a, const std::string& b) {
      return std::count(a.begin(), a.end(), '.') > std::count(b.begin(), b.end(), '.');
    });
    for (const auto& path : order) add_unit(path, by_path[path]);
  } else if (policy.min_num_params > 0) {
    // Children first: named_modules() is pre-order, so walk it backwards per depth.
    std::vector<std::pair<std::string, nn::Module*>> post(modules.rbegin(), modules.rend());
    std::stable_sort(post.begin(), post.end(), [](const auto& a, const auto& b) {
      return std::count(a.first.begin(), a.first.end(), '.') >
             std::count(b.first.begin(), b.first.end(), '.');
    });
    std::int64_t largest = 0;
    for (const auto& [path, module] : post) {
      if (path.empty()) continue;
      std::int64_t count = 0;
      for (auto i : owned_below(path)) count += params[i].second.numel();
      largest = std::max(largest, count);
      if (count >= policy.min_num_params) add_unit(path, module);
    }
    check(!units.empty(), "the FSDP auto-wrap policy min_num_params = ", policy.min_num_params,
          " wraps no module: the largest sub-module has ", largest,
          " parameters; lower min_num_params or list units by path");
  }
  // Units in forward (tree) order, then the root.
  std::map<std::string, std::size_t> tree_order;
  for (std::size_t k = 0; k < modules.size(); ++k) tree_order[modules[k].first] = k;
  std::stable_sort(units.begin(), units.end(), [&](const auto& a, const auto& b) {
    return tree_order[a.path] < tree_order[b.path];
  });
  add_unit("", &root);
  return units;
}

}  // namespace shardkit::parallel
