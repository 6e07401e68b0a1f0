// PieceTable: which rank updates which elements of which trainable parameter, and where each
// such piece keeps its optimizer state in that rank's state buffers. It is what the optimizer,
// optimizer-state consolidation and sharded checkpoints need to know about a sharding, whatever
// produced it: one ShardPlan (DDP, OSS, SDP) or one plan per FSDP unit.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::shard {

struct TableParam {
  std::string name;
  Shape shape;
  std::int64_t numel = 0;
};

// What one rank updates of table parameter `param`: elements [param_begin, param_end), whose
// optimizer state sits at [state_offset, state_offset + numel()) of that rank's state buffers.
struct StatePiece : ParamRange {
  std::int64_t state_offset = 0;
};

class PieceTable {
 public:
  PieceTable() = default;
  explicit PieceTable(int world_size, bool replicated = false)
      : replicated_(replicated),
        by_rank_(static_cast<std::size_t>(world_size)),
        state_numel_(static_cast<std::size_t>(world_size), 0) {
    check(world_size >= 1, "PieceTable: world size must be >= 1, got ", world_size);
  }

  // The table of one plan: under DDP (`replicated`) every rank updates every trainable
  // parameter with its state laid out like the flat buffer's trainable range; otherwise each
  // rank updates its plan pieces, with state over its own range.
  static PieceTable of_plan(const ShardPlan& plan, bool replicated) {
    PieceTable table(plan.world_size(), replicated);
    table.append_plan(plan, replicated);
    return table;
  }

  // Adds a plan's trainable parameters and pieces after those already in the table (FSDP
  // builds one table over all its units). Returns the table index of the plan's first
  // trainable parameter; the others follow in layout order.
  std::size_t append_plan(const ShardPlan& plan, bool replicated) {
    check(plan.world_size() == world_size(), "PieceTable: a plan for ", plan.world_size(),
          " ranks in a table for ", world_size());
    check(replicated == replicated_, "PieceTable: replicated and sharded plans do not mix");
    const std::size_t first = params_.size();
    const auto& layout = plan.layout();
    std::vector<std::size_t> table_index(layout.size(), 0);
    for (std::size_t i = 0; i < layout.size(); ++i) {
      if (!layout[i].trainable) continue;
      table_index[i] = params_.size();
      const auto [it, inserted] = index_.emplace(layout[i].name, params_.size());
      check(inserted, "PieceTable: parameter '", layout[i].name, "' appears twice (#", it->second,
            " and #", params_.size(), "); names must be unique");
      params_.push_back(TableParam{layout[i].name, layout[i].shape, layout[i].numel});
    }
    for (int r = 0; r < world_size(); ++r) {
      auto& list = by_rank_[static_cast<std::size_t>(r)];
      auto& state = state_numel_[static_cast<std::size_t>(r)];
      if (replicated) {
        for (auto i : plan.trainable_in_layout_order())
          list.push_back(
              StatePiece{{table_index[i], 0, layout[i].numel}, state + layout[i].offset});
        state += plan.trainable_end();
      } else {
        for (const auto& piece : plan.pieces(r))
          list.push_back(StatePiece{{table_index[piece.param], piece.param_begin, piece.param_end},
                                    state + piece.flat_begin - plan.begin(r)});
        state += plan.numel(r);
      }
    }
    return first;
  }

  int world_size() const { return static_cast<int>(by_rank_.size()); }
  // Every rank updates everything (DDP): the state is not sharded, nothing needs gathering.
  bool replicated() const { return replicated_; }
  const std::vector<TableParam>& params() const { return params_; }
  const std::vector<StatePiece>& pieces(int rank) const {
    return by_rank_[static_cast<std::size_t>(rank)];
  }
  std::int64_t state_numel(int rank) const { return state_numel_[static_cast<std::size_t>(rank)]; }
  // True when some parameter has pieces on more than one rank: per-parameter quantities (LARC
  // norms, the gradient norm) then need an all-reduce.
  bool any_parameter_spans_ranks() const {
    if (replicated_) return false;
    std::vector<int> holder(params_.size(), -1);
    for (int r = 0; r < world_size(); ++r)
      for (const auto& piece : pieces(r)) {
        int& h = holder[piece.param];
        if (h >= 0 && h != r) return true;
        h = r;
      }
    return false;
  }
  // Table index of a parameter by name, or -1.
  std::int64_t find(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? -1 : static_cast<std::int64_t>(it->second);
  }

 private:
  bool replicated_ = false;
  std::vector<TableParam> params_;
  std::unordered_map<std::string, std::size_t> index_;
  std::vector<std::vector<StatePiece>> by_rank_;
  std::vector<std::int64_t> state_numel_;
};

}  // namespace shardkit::shard
