// The even flat split (FSDP-style): the flat buffer is cut into N equal shards of
// ceil(total / N) elements (the last right-padded), so parameters may straddle ranks. Each
// shard knows which pieces of which parameters it holds: what per-parameter norms (LARC) need.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/shard/param_layout.hpp"

namespace shardkit::shard {

// Part of parameter `param` inside one shard: parameter elements [param_begin, param_end),
// which sit at shard elements [shard_offset, shard_offset + (param_end - param_begin)).
struct ShardSegment {
  std::size_t param = 0;
  std::int64_t param_begin = 0;
  std::int64_t param_end = 0;
  std::int64_t shard_offset = 0;
  std::int64_t numel() const { return param_end - param_begin; }
};

struct FlatShard {
  int rank = 0;
  std::int64_t begin = 0;  // flat-buffer elements [begin, end) belong to this rank
  std::int64_t end = 0;
  std::vector<ShardSegment> segments;
};

struct FlatSplit {
  int world_size = 1;
  std::int64_t shard_numel = 0;   // ceil(padded total / N): every shard's (padded) size
  std::int64_t padded_total = 0;  // shard_numel * N
  std::vector<FlatShard> shards;
};

// Splits `layout`'s flat buffer evenly across `world_size` ranks.
inline FlatSplit even_flat_split(const ParamLayout& layout, int world_size) {
  check(world_size >= 1, "even_flat_split: world size must be >= 1, got ", world_size);
  FlatSplit split;
  split.world_size = world_size;
  const std::int64_t total = layout.padded_numel();
  split.shard_numel = (total + world_size - 1) / world_size;
  split.padded_total = split.shard_numel * world_size;
  split.shards.resize(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    auto& shard = split.shards[static_cast<std::size_t>(r)];
    shard.rank = r;
    shard.begin = r * split.shard_numel;
    shard.end = shard.begin + split.shard_numel;
  }
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const auto& slot = layout[i];
    std::int64_t at = slot.offset;
    const std::int64_t stop = slot.offset + slot.numel;
    while (at < stop) {
      const auto r = static_cast<std::size_t>(at / split.shard_numel);
      auto& shard = split.shards[r];
      const std::int64_t piece_end = std::min(stop, shard.end);
      shard.segments.push_back(
          ShardSegment{i, at - slot.offset, piece_end - slot.offset, at - shard.begin});
      at = piece_end;
    }
  }
  return split;
}

}  // namespace shardkit::shard
