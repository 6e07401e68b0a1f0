// How an nn::Module's parameters become an engine's param groups: under ddp, oss and sdp one
// group of every parameter in registration order (frozen ones too, as slots nobody updates);
// under fsdp one group per unit of the wrap policy (fsdp_units.hpp), each holding its trainable
// parameters, the frozen ones staying outside the units, whole on every rank.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "shardkit/autograd/variable.hpp"
#include "shardkit/nn/module.hpp"
#include "shardkit/parallel/collectives.hpp"
#include "shardkit/parallel/fsdp_units.hpp"
#include "shardkit/parallel/param_group.hpp"
#include "shardkit/parallel/policy.hpp"

namespace shardkit::parallel {

// The parameter specs of a module: state-dict names, shapes, trainable = requires_grad.
inline std::vector<shard::ParamSpec> module_param_specs(const nn::Module& module) {
  std::vector<shard::ParamSpec> specs;
  for (const auto& [name, p] : module.named_parameters()) {
    check(p.dtype() == DType::f32, "parameter '", name, "' is ", dtype_name(p.dtype()),
          "; sharded modules keep f32 parameters (build the model in f32)");
    specs.push_back(shard::ParamSpec{name, p.shape(), p.requires_grad()});
  }
  return specs;
}

struct ModuleGroups {
  std::vector<ParamGroupSpec> groups;
  std::vector<autograd::Variable> params;                // engine parameter i is params[i]
  std::vector<nn::Module*> unit_modules;                 // fsdp: per group, whose hooks gather it
  std::size_t root_unit = static_cast<std::size_t>(-1);  // fsdp: the root module's group, if any
  std::vector<autograd::Variable> outside;  // fsdp: frozen parameters, whole on every rank
};

// The groups of `module` under `policy`. Under fsdp every rank must build the same units: the
// tree's fingerprint is compared over `world` first (a collective).
inline ModuleGroups module_groups(Context& ctx, comm::Communicator& world, nn::Module& module,
                                  const ResolvedPolicy& policy) {
  ModuleGroups out;
  if (policy.residency == Residency::replicated) {
    out.groups.push_back(ParamGroupSpec{"model", module_param_specs(module)});
    for (const auto& [name, p] : module.named_parameters()) out.params.push_back(p);
    return out;
  }
  std::map<std::string, autograd::Variable> by_name;
  for (const auto& [name, p] : module.named_parameters()) {
    check(p.dtype() == DType::f32, "parameter '", name, "' is ", dtype_name(p.dtype()),
          "; FSDP keeps f32 parameters (build the model in f32)");
    by_name.emplace(name, p);
    if (!p.requires_grad() && p.numel() > 0) out.outside.push_back(p);
  }
  const auto units = plan_fsdp_units(module, policy.wrap);
  // Every rank must have the same units with the same parameters, frozen ones included, or
  // collectives would pair up wrongly: one fingerprint before any of them.
  std::vector<shard::ParamSpec> all;
  for (const auto& unit : units) {
    all.push_back(shard::ParamSpec{"unit:" + unit.path, {1}, false});
    for (const auto& name : unit.params) {
      const auto& p = by_name.at(name);
      all.push_back(shard::ParamSpec{name, p.shape(), p.requires_grad()});
    }
  }
  check_same_fingerprint(ctx, world, shard::ParamLayout(all).fingerprint(),
                         "the module tree or its FSDP units differ between ranks (paths, "
                         "parameter names, shapes or frozen flags); build the same model and "
                         "wrap policy on every rank");
  for (const auto& unit : units) {
    ParamGroupSpec group{unit.path.empty() ? std::string("<root>") : unit.path, {}};
    std::vector<autograd::Variable> params;
    for (const auto& name : unit.params) {
      const auto& p = by_name.at(name);
      if (!p.requires_grad()) continue;  // frozen: stays whole on every rank
      group.params.push_back(shard::ParamSpec{name, p.shape(), true});
      params.push_back(p);
    }
    if (params.empty()) continue;
    if (unit.path.empty()) out.root_unit = out.groups.size();
    out.groups.push_back(std::move(group));
    out.unit_modules.push_back(unit.module);
    out.params.insert(out.params.end(), params.begin(), params.end());
  }
  check(!out.groups.empty(), "FSDP: the model has no trainable parameter to shard");
  return out;
}

}  // namespace shardkit::parallel
