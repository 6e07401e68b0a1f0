// Assigning whole parameters to ranks: greedy size-balanced (largest first, ours), and
// FairScale's unsorted greedy for comparison. Deterministic: every rank computes the same.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <queue>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::shard {

struct Partition {
  int world_size = 1;
  std::vector<int> owner;                           // owner[i]: the rank that owns parameter i
  std::vector<std::int64_t> load;                   // elements owned per rank
  std::vector<std::vector<std::size_t>> params_of;  // parameter indices per rank, ascending

  // max load / mean load - 1: 0 is perfect balance. 0 when there is nothing to place.
  double imbalance() const {
    const std::int64_t total = std::accumulate(load.begin(), load.end(), std::int64_t{0});
    if (total == 0) return 0.0;
    const double mean = static_cast<double>(total) / world_size;
    return static_cast<double>(*std::max_element(load.begin(), load.end())) / mean - 1.0;
  }
};

namespace detail {

inline void check_partition_input(const std::vector<std::int64_t>& sizes, int world_size) {
  check(world_size >= 1, "partition: world size must be >= 1, got ", world_size);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    check(sizes[i] >= 0, "partition: parameter #", i, " has negative size ", sizes[i]);
}

// Places parameters in `order`, each on the least-loaded rank (ties: lowest rank).
inline Partition place_greedily(const std::vector<std::int64_t>& sizes, int world_size,
                                const std::vector<std::size_t>& order) {
  Partition p;
  p.world_size = world_size;
  p.owner.assign(sizes.size(), 0);
  p.load.assign(static_cast<std::size_t>(world_size), 0);
  p.params_of.assign(static_cast<std::size_t>(world_size), {});
  using Entry = std::pair<std::int64_t, int>;  // (load, rank): the smallest on top
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> ranks;
  for (int r = 0; r < world_size; ++r) ranks.emplace(0, r);
  for (std::size_t i : order) {
    auto [load, rank] = ranks.top();
    ranks.pop();
    p.owner[i] = rank;
    load += sizes[i];
    p.load[static_cast<std::size_t>(rank)] = load;
    ranks.emplace(load, rank);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i)
    p.params_of[static_cast<std::size_t>(p.owner[i])].push_back(i);
  return p;
}

}  // namespace detail

// Ours (LPT): largest parameter first, ties by index; each to the least-loaded rank.
// O(P log P + P log N): a million parameters take milliseconds.
inline Partition greedy_partition(const std::vector<std::int64_t>& sizes, int world_size) {
  detail::check_partition_input(sizes, world_size);
  std::vector<std::size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return sizes[a] > sizes[b]; });
  return detail::place_greedily(sizes, world_size, order);
}

// FairScale OSS's rule: registration order, each to the least-loaded rank. For comparison.
inline Partition fairscale_partition(const std::vector<std::int64_t>& sizes, int world_size) {
  detail::check_partition_input(sizes, world_size);
  std::vector<std::size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  return detail::place_greedily(sizes, world_size, order);
}

}  // namespace shardkit::shard
