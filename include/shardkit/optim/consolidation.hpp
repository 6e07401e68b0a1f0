// Optimizer-state consolidation (FairScale's OSS.consolidate_state_dict) and its inverse, as
// functions over a sharded optimizer (which knows its PieceTable and rank) and a communicator:
//
//   consolidate_optimizer_state(optimizer, comm, recipient)  the whole state on `recipient`, by
//       parameter name; an empty OptimizerState on the other ranks. Collective. Owners
//       broadcast their state ranges in turn, so a rank holds at most one other range at a
//       time, never the whole state; only the recipient keeps what it receives (on the host).
//   load_optimizer_state(optimizer, state)  takes this rank's share of a whole state written
//       under any stage, partition or world size; every rank passes the whole state (as with
//       PyTorch's load_state_dict under FairScale's OSS). Everything is checked on every rank
//       before anything is written, so all ranks fail alike.
#pragma once

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"

namespace shardkit::optim {

template <class Backend>
OptimizerState consolidate_optimizer_state(const ShardedOptimizer<Backend>& optimizer,
                                           comm::Communicator& comm, int recipient = 0) {
  check(recipient >= 0 && recipient < comm.size(), "consolidate_optimizer_state: recipient ",
        recipient, " is not a rank of this ", comm.size(), "-rank job; pass 0..", comm.size() - 1);
  const auto& table = optimizer.table();
  check(table.world_size() == comm.size(), "consolidate_optimizer_state: the optimizer is sharded ",
        "over ", table.world_size(), " ranks but the communicator has ", comm.size());
  Context& ctx = optimizer.context();
  const bool here = comm.rank() == recipient;
  OptimizerState out;
  const auto& buffers = optimizer.state_buffers();
  if (here) {
    out.kind = optimizer.config().kind;
    out.steps = optimizer.steps();
    for (const auto& param : table.params()) {
      ParamOptimizerState entry{param.name, param.shape, {}};
      for (const auto& buffer : buffers)
        entry.buffers[std::string(buffer.name)].resize(static_cast<std::size_t>(param.numel));
      out.params.push_back(std::move(entry));
    }
  }
  // One owner's state range, cut back into its parameters.
  auto scatter = [&](int owner, std::string_view name, const std::vector<float>& range) {
    for (const auto& piece : table.pieces(owner)) {
      auto& dst = out.params[piece.param].buffers.find(name)->second;
      std::copy_n(range.begin() + piece.state_offset, piece.numel(),
                  dst.begin() + piece.param_begin);
    }
  };
  for (const auto& buffer : buffers) {
    if (table.replicated()) {  // every rank holds everything: nothing to send
      if (here) scatter(comm.rank(), buffer.name, to_vector<float>(ctx, buffer.values));
      continue;
    }
    for (int owner = 0; owner < comm.size(); ++owner) {
      const std::int64_t count = table.state_numel(owner);
      if (count == 0) continue;
      const Tensor range = comm.rank() == owner
                               ? buffer.values
                               : empty(ctx, {count}, DType::f32, MemoryCategory::communication);
      comm.broadcast(range, owner).wait();
      if (here) scatter(owner, buffer.name, to_vector<float>(ctx, range));
    }
  }
  return out;
}

template <class Backend>
void load_optimizer_state(ShardedOptimizer<Backend>& optimizer, const OptimizerState& state) {
  const auto& config = optimizer.config();
  check(state.kind == config.kind, "load_optimizer_state: the state is for ",
        optimizer_kind_name(state.kind), " but this optimizer is ",
        optimizer_kind_name(config.kind), "; build the optimizer the checkpoint was written with");
  check(state.steps >= 0, "load_optimizer_state: steps is ", state.steps, "; it must be >= 0");
  const auto& table = optimizer.table();
  std::unordered_map<std::string_view, const ParamOptimizerState*> by_name;
  for (const auto& entry : state.params) by_name.emplace(entry.name, &entry);
  std::vector<const ParamOptimizerState*> entry_of(table.params().size(), nullptr);
  const auto& buffers = optimizer.state_buffers();
  for (std::size_t i = 0; i < table.params().size(); ++i) {
    const auto& param = table.params()[i];
    const auto found = by_name.find(param.name);
    check(found != by_name.end(), "load_optimizer_state: the state has no entry for parameter '",
          param.name, "'; it was written for a different model");
    const auto& entry = *found->second;
    check(entry.shape == param.shape, "load_optimizer_state: parameter '", param.name,
          "' has shape ", shape_str(param.shape), " here but ", shape_str(entry.shape),
          " in the state; it was written for a different model");
    for (const auto& [name, values] : entry.buffers) {
      const bool kept = std::any_of(buffers.begin(), buffers.end(),
                                    [&](const StateBuffer& b) { return b.name == name; });
      check(kept, "load_optimizer_state: the state has a ", name, " for '", entry.name,
            "' but this optimizer keeps none (momentum 0?); configure it as when it was saved");
    }
    for (const auto& buffer : buffers) {
      const auto& src = entry.buffer(buffer.name);
      check(src.empty() ? state.steps == 0 : src.size() == static_cast<std::size_t>(param.numel),
            "load_optimizer_state: '", entry.name, "' has ", src.size(), " ", buffer.name,
            " values; expected ", param.numel, " (or none before the first step)");
    }
    entry_of[i] = &entry;
  }
  check(state.params.size() == table.params().size(), "load_optimizer_state: the state has ",
        state.params.size(), " parameters, this model ", table.params().size(),
        " trainable ones; it was written for a different model");
  Context& ctx = optimizer.context();
  for (const auto& buffer : buffers) {
    fill(ctx, buffer.values, 0.0);  // what a state saved before the first step means
    for (const auto& piece : optimizer.pieces()) {
      const auto& src = entry_of[piece.param]->buffer(buffer.name);
      if (src.empty()) continue;
      auto host =
          Storage::borrow(const_cast<float*>(src.data() + piece.param_begin),
                          static_cast<std::size_t>(piece.numel()) * sizeof(float), Device::cpu());
      copy(ctx, buffer.values.slice(0, piece.state_offset, piece.state_offset + piece.numel()),
           Tensor(host, {piece.numel()}, DType::f32));
    }
  }
  optimizer.set_steps(state.steps);
}

}  // namespace shardkit::optim
