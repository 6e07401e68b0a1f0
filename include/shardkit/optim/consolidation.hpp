// Optimizer-state consolidation (FairScale's OSS.consolidate_state_dict) and its inverse, as
// functions over a sharded optimizer (which knows its PieceTable and rank) and a communicator:
//
//   consolidate_optimizer_state(optimizer, comm, recipient)  the whole state on `recipient`, by
//       parameter name; an empty OptimizerState on the other ranks. Collective, over
//       stream_pieces: owners send their pieces in turn, chunk by chunk, so a rank holds at
//       most one chunk of another rank's state at a time; only the recipient keeps what it
//       receives (on the host).
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

// Streams values the ranks hold per piece of `table` to `recipient`, in chunks of at most
// `chunk_numel` elements: `held` is this rank's one 1-D f32 view per piece of
// table.pieces(comm.rank()) (parameter values, or one optimizer state buffer). On the
// recipient, sink(piece, offset, values, count) receives elements [offset, offset + count) of
// the piece (offset from piece.param_begin), on the host. Collective: owners send their pieces
// in rank order, chunk by chunk (one broadcast each), so no rank ever holds more than one
// chunk beyond its own values. A replicated table (DDP) has everything on the recipient: no
// traffic. What full checkpoints and consolidation stand on.
template <class Sink>
void stream_pieces(Context& ctx, comm::Communicator& comm, const shard::PieceTable& table,
                   const std::vector<Tensor>& held, int recipient, Sink&& sink,
                   std::int64_t chunk_numel = std::int64_t{1} << 22) {
  check(recipient >= 0 && recipient < comm.size(), "stream_pieces: recipient ", recipient,
        " is not a rank of this ", comm.size(), "-rank job; pass 0..", comm.size() - 1);
  check(table.world_size() == comm.size(), "stream_pieces: the table is sharded over ",
        table.world_size(), " ranks but the communicator has ", comm.size());
  check(held.size() == table.pieces(comm.rank()).size(), "stream_pieces: ", held.size(),
        " views for ", table.pieces(comm.rank()).size(), " pieces; pass one per piece");
  check(chunk_numel > 0, "stream_pieces: chunk_numel must be > 0, got ", chunk_numel);
  const bool here = comm.rank() == recipient;
  auto own = [&] {
    const auto& pieces = table.pieces(comm.rank());
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const auto values = to_vector<float>(ctx, held[k]);
      sink(pieces[k], std::int64_t{0}, values.data(), pieces[k].numel());
    }
  };
  if (table.replicated()) {
    if (here) own();
    return;
  }
  struct Segment {
    std::size_t piece;
    std::int64_t offset, count;
  };
  for (int owner = 0; owner < comm.size(); ++owner) {
    if (owner == recipient) {  // the recipient holds its own pieces: nothing to send
      if (here) own();
      continue;
    }
    const auto& pieces = table.pieces(owner);
    std::size_t k = 0;
    std::int64_t within = 0;
    while (k < pieces.size()) {
      std::vector<Segment> segments;
      std::int64_t total = 0;
      while (k < pieces.size() && total < chunk_numel) {
        const std::int64_t take = std::min(pieces[k].numel() - within, chunk_numel - total);
        if (take > 0) segments.push_back({k, within, take});
        total += take;
        within += take;
        if (within == pieces[k].numel()) ++k, within = 0;
      }
      if (total == 0) continue;
      const Tensor chunk = empty(ctx, {total}, DType::f32, MemoryCategory::communication);
      if (comm.rank() == owner) {
        std::int64_t at = 0;
        for (const auto& s : segments) {
          copy(ctx, chunk.slice(0, at, at + s.count),
               held[s.piece].slice(0, s.offset, s.offset + s.count));
          at += s.count;
        }
      }
      comm.broadcast(chunk, owner).wait();
      if (!here) continue;
      const auto values = to_vector<float>(ctx, chunk);
      std::int64_t at = 0;
      for (const auto& s : segments) {
        sink(pieces[s.piece], s.offset, values.data() + at, s.count);
        at += s.count;
      }
    }
  }
}

// This rank's views of one state buffer, one per piece (the `held` of stream_pieces).
inline std::vector<Tensor> state_views(const std::vector<shard::StatePiece>& pieces,
                                       const Tensor& buffer) {
  std::vector<Tensor> out;
  for (const auto& piece : pieces)
    out.push_back(buffer.slice(0, piece.state_offset, piece.state_offset + piece.numel()));
  return out;
}

inline OptimizerState consolidate_optimizer_state(const ShardedOptimizer& optimizer,
                                                  comm::Communicator& comm, int recipient = 0) {
  check(recipient >= 0 && recipient < comm.size(), "consolidate_optimizer_state: recipient ",
        recipient, " is not a rank of this ", comm.size(), "-rank job; pass 0..", comm.size() - 1);
  const auto& table = optimizer.table();
  check(table.world_size() == comm.size(), "consolidate_optimizer_state: the optimizer is sharded ",
        "over ", table.world_size(), " ranks but the communicator has ", comm.size());
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
  for (const auto& buffer : buffers) {
    stream_pieces(optimizer.context(), comm, table, state_views(optimizer.pieces(), buffer.values),
                  recipient,
                  [&](const shard::StatePiece& piece, std::int64_t offset, const float* values,
                      std::int64_t count) {
                    auto& dst = out.params[piece.param].buffers.find(buffer.name)->second;
                    std::copy_n(values, count, dst.begin() + piece.param_begin + offset);
                  });
  }
  return out;
}

inline void load_optimizer_state(ShardedOptimizer& optimizer, const OptimizerState& state) {
  const auto& config = optimizer.config();
  check(state.kind == config.kind, "load_optimizer_state: the state is for ",
        optimizer_kind_name(state.kind), " but this optimizer is ",
        optimizer_kind_name(config.kind), "; build the optimizer the checkpoint was written with");
  check(state.steps >= 0, "load_optimizer_state: steps is ", state.steps, "; it must be >= 0");
  optimizer.check_steps(state.steps);  // (before anything is written: set_steps comes last)
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
          "' has shape ", shape_text(param.shape), " here but ", shape_text(entry.shape),
          " in the state; it was written for a different model");
    for (const auto& saved : entry.buffers) {
      const auto& name = saved.first;  // (not a structured binding: lambdas capture it)
      const bool kept = std::any_of(buffers.begin(), buffers.end(),
                                    [&](const StateBuffer& b) { return b.name == name; });
      check(kept, "load_optimizer_state: the state has a ", name, " for '", entry.name,
            "' but this optimizer keeps none (momentum 0?); configure it as when it was saved");
    }
    for (const auto& buffer : buffers) {
      const auto& src = entry.buffer(buffer.name);
      // (an empty parameter's buffers are empty at any step)
      check(
          src.size() == static_cast<std::size_t>(param.numel) || (src.empty() && state.steps == 0),
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
  optimizer.spill_state();
}

}  // namespace shardkit::optim
