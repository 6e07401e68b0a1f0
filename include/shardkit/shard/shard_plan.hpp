// ShardPlan: which rank owns which part of the flat parameter buffer. The buffer is laid out so
// that every rank's part is one contiguous range, in rank order: then parameter sync is one
// all_gather_v and gradient reduction per bucket is one reduce_scatter_v.
//
//   greedy: whole parameters, largest first onto the least-loaded rank (partition.hpp); the
//           layout groups parameters by owner, each group in registration order.
//   flat:   the even split (FSDP-style): registration order, cut into N equal ranges of
//           ceil(T / N) elements (rounded up to the alignment); parameters may straddle ranks.
// Frozen parameters sit after every rank's range: nobody owns, reduces or updates them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardkit/shard/param_layout.hpp"
#include "shardkit/shard/partition.hpp"

namespace shardkit::shard {

enum class PartitionKind { greedy, flat };

inline std::string_view partition_kind_name(PartitionKind kind) {
  return kind == PartitionKind::greedy ? "greedy" : "flat";
}

// Elements [param_begin, param_end) of parameter `param` (what the index means is the holder's).
struct ParamRange {
  std::size_t param = 0;
  std::int64_t param_begin = 0;
  std::int64_t param_end = 0;
  std::int64_t numel() const { return param_end - param_begin; }
};

// A piece of parameter `param` (a layout index) held by one rank: its elements
// [param_begin, param_end), at flat-buffer elements [flat_begin, flat_begin + numel()).
struct ParamPiece : ParamRange {
  std::int64_t flat_begin = 0;
  bool whole(std::int64_t param_numel) const {
    return param_begin == 0 && param_end == param_numel;
  }
};

class ShardPlan {
 public:
  ShardPlan(const std::vector<ParamSpec>& specs, int world_size, PartitionKind kind,
            std::int64_t alignment = 16)
      : world_size_(world_size), kind_(kind) {
    check(world_size >= 1, "ShardPlan: world size must be >= 1, got ", world_size);
    check(alignment > 0, "ShardPlan: alignment must be > 0, got ", alignment);
    auto round_up = [&](std::int64_t n) { return (n + alignment - 1) / alignment * alignment; };

    // Registration order of the trainable parameters, then of the frozen ones.
    std::vector<std::size_t> trainable, frozen;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      ParamLayout::check_spec(specs[i], i);  // (before its size is partitioned)
      (specs[i].trainable ? trainable : frozen).push_back(i);
    }
    std::vector<std::int64_t> sizes;
    for (auto i : trainable) sizes.push_back(shape_numel(specs[i].shape));

    std::vector<std::size_t> order;  // trainable spec indices in layout order
    bounds_.assign(static_cast<std::size_t>(world_size) + 1, 0);
    std::vector<std::int64_t> offsets(specs.size(), 0);
    std::int64_t at = 0;
    if (kind == PartitionKind::greedy) {
      const Partition partition = greedy_partition(sizes, world_size);
      for (int r = 0; r < world_size; ++r) {
        bounds_[static_cast<std::size_t>(r)] = at;
        for (auto k : partition.params_of[static_cast<std::size_t>(r)]) {
          offsets[trainable[k]] = at;
          at += round_up(sizes[k]);
          order.push_back(trainable[k]);
        }
      }
      bounds_[static_cast<std::size_t>(world_size)] = at;
    } else {
      for (std::size_t k = 0; k < trainable.size(); ++k) {
        offsets[trainable[k]] = at;
        at += round_up(sizes[k]);
        order.push_back(trainable[k]);
      }
      const std::int64_t shard = round_up((at + world_size - 1) / world_size);
      for (int r = 0; r <= world_size; ++r) bounds_[static_cast<std::size_t>(r)] = r * shard;
      at = shard * world_size;  // the last ranges are right-padded
    }
    trainable_end_ = at;
    for (auto i : frozen) {
      offsets[i] = at;
      at += round_up(shape_numel(specs[i].shape));
    }
    layout_ = ParamLayout(specs, offsets, at, alignment);
    spec_order_ = order;

    // Pieces per rank: cut each trainable parameter at the rank boundaries.
    pieces_.assign(static_cast<std::size_t>(world_size), {});
    for (auto i : order) {
      const auto& slot = layout_[i];
      std::int64_t begin = slot.offset;
      const std::int64_t end = slot.offset + slot.numel;
      while (begin < end) {
        const int r = rank_of_element(begin);
        const std::int64_t stop = std::min(end, bounds_[static_cast<std::size_t>(r) + 1]);
        pieces_[static_cast<std::size_t>(r)].push_back(
            ParamPiece{{i, begin - slot.offset, stop - slot.offset}, begin});
        begin = stop;
      }
    }
  }

  int world_size() const { return world_size_; }
  PartitionKind kind() const { return kind_; }
  // Layout indices equal registration (spec) indices; offsets follow the plan.
  const ParamLayout& layout() const { return layout_; }
  // Trainable parameters in flat-buffer order.
  const std::vector<std::size_t>& trainable_in_layout_order() const { return spec_order_; }
  // Elements [0, trainable_end) are split among the ranks; frozen parameters come after.
  std::int64_t trainable_end() const { return trainable_end_; }

  std::int64_t begin(int rank) const { return bounds_[static_cast<std::size_t>(rank)]; }
  std::int64_t end(int rank) const { return bounds_[static_cast<std::size_t>(rank) + 1]; }
  std::int64_t numel(int rank) const { return end(rank) - begin(rank); }
  // Range sizes in rank order, as the v-collectives take them.
  std::vector<std::size_t> counts() const {
    std::vector<std::size_t> out;
    for (int r = 0; r < world_size_; ++r) out.push_back(static_cast<std::size_t>(numel(r)));
    return out;
  }
  const std::vector<ParamPiece>& pieces(int rank) const {
    return pieces_[static_cast<std::size_t>(rank)];
  }

  int rank_of_element(std::int64_t element) const {
    check(element >= 0 && element < trainable_end_, "element ", element,
          " is outside the sharded range [0, ", trainable_end_, ")");
    const auto it = std::upper_bound(bounds_.begin(), bounds_.end(), element);
    return static_cast<int>(it - bounds_.begin()) - 1;
  }

  // True when some parameter has pieces on more than one rank (flat plans): per-parameter
  // quantities (LARC norms) then need an all-reduce of partial sums.
  // (By holder, not by counting pieces: an empty parameter has none.)
  bool any_parameter_spans_ranks() const {
    std::vector<int> holder(layout_.size(), -1);
    for (int r = 0; r < world_size_; ++r)
      for (const auto& piece : pieces(r)) {
        int& h = holder[piece.param];
        if (h >= 0 && h != r) return true;
        h = r;
      }
    return false;
  }

  // Parameter elements (not padding) owned per rank, and max / mean - 1 over them.
  std::vector<std::int64_t> loads() const {
    std::vector<std::int64_t> out;
    for (const auto& list : pieces_) {
      std::int64_t load = 0;
      for (const auto& piece : list) load += piece.numel();
      out.push_back(load);
    }
    return out;
  }
  double imbalance() const {
    const auto l = loads();
    std::int64_t total = 0, max = 0;
    for (auto v : l) {
      total += v;
      max = std::max(max, v);
    }
    return total == 0 ? 0.0
                      : static_cast<double>(max) * world_size_ / static_cast<double>(total) - 1.0;
  }

 private:
  int world_size_;
  PartitionKind kind_;
  ParamLayout layout_{std::vector<ParamSpec>{}};
  std::vector<std::size_t> spec_order_;
  std::vector<std::int64_t> bounds_;
  std::int64_t trainable_end_ = 0;
  std::vector<std::vector<ParamPiece>> pieces_;
};

}  // namespace shardkit::shard
