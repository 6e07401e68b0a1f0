// Partitions: ownership, balance against the optimum on small cases, determinism, FairScale's
// rule for comparison. (The flat split is ShardPlan's: test_shard_plan.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "shardkit/shard/partition.hpp"
#include "workloads/resnet50_params.hpp"

namespace sk = shardkit;
using namespace sk::shard;

namespace {

// The best possible max load, by trying every assignment (small cases only).
std::int64_t optimal_max_load(const std::vector<std::int64_t>& sizes, int world) {
  std::vector<int> owner(sizes.size(), 0);
  std::int64_t best = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
  while (true) {
    std::vector<std::int64_t> load(static_cast<std::size_t>(world), 0);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      load[static_cast<std::size_t>(owner[i])] += sizes[i];
    best = std::min(best, *std::max_element(load.begin(), load.end()));
    std::size_t i = 0;
    while (i < owner.size() && ++owner[i] == world) owner[i++] = 0;
    if (i == owner.size()) return best;
  }
}

void check_consistent(const Partition& p, const std::vector<std::int64_t>& sizes) {
  std::vector<std::int64_t> load(static_cast<std::size_t>(p.world_size), 0);
  std::size_t listed = 0;
  for (int r = 0; r < p.world_size; ++r)
    for (std::size_t i : p.params_of[static_cast<std::size_t>(r)]) {
      CHECK(p.owner[i] == r);
      load[static_cast<std::size_t>(r)] += sizes[i];
      ++listed;
    }
  CHECK(listed == sizes.size());
  CHECK(load == p.load);
}

}  // namespace

TEST_CASE("greedy (largest first) is within 4/3 of the optimum on random small cases") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 2 + trial % 3;
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(3 + trial % 6));
    for (auto& s : sizes) s = 1 + static_cast<std::int64_t>(rng() % 1000);
    const auto p = greedy_partition(sizes, world);
    check_consistent(p, sizes);
    const auto best = optimal_max_load(sizes, world);
    const auto ours = *std::max_element(p.load.begin(), p.load.end());
    CHECK(static_cast<double>(ours) <= (4.0 / 3.0) * static_cast<double>(best) + 1e-9);
    // Graham's bound for any greedy list order: the largest item plus the mean.
    const auto unsorted = fairscale_partition(sizes, world);
    check_consistent(unsorted, sizes);
    const double mean =
        static_cast<double>(std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0})) / world;
    CHECK(static_cast<double>(*std::max_element(unsorted.load.begin(), unsorted.load.end())) <=
          mean + static_cast<double>(*std::max_element(sizes.begin(), sizes.end())));
  }
}

TEST_CASE("ties go to the lowest index and rank: identical on every rank, every run") {
  const std::vector<std::int64_t> sizes(8, 100);
  const auto p = greedy_partition(sizes, 4);
  CHECK(p.owner == std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3});
  CHECK(p.imbalance() == 0.0);
  std::mt19937 rng(5);
  std::vector<std::int64_t> random_sizes(1000);
  for (auto& s : random_sizes) s = static_cast<std::int64_t>(rng() % 50);
  CHECK(greedy_partition(random_sizes, 7).owner == greedy_partition(random_sizes, 7).owner);
}

TEST_CASE("largest-first beats registration order where order hurts") {
  // Small tensors first, one big one last: FairScale's rule piles the big one on a loaded rank.
  const std::vector<std::int64_t> sizes{10, 10, 10, 10, 40};
  CHECK(fairscale_partition(sizes, 2).imbalance() == doctest::Approx(60.0 / 40.0 - 1.0));
  CHECK(greedy_partition(sizes, 2).imbalance() == 0.0);
}

TEST_CASE("imbalance, more ranks than parameters, and bad input") {
  const auto p = greedy_partition({5}, 3);
  CHECK(p.load == std::vector<std::int64_t>{5, 0, 0});
  CHECK(p.imbalance() == doctest::Approx(2.0));
  CHECK(greedy_partition({}, 4).imbalance() == 0.0);
  CHECK_THROWS_AS(greedy_partition({1, 2}, 0), sk::InvalidArgument);
  CHECK_THROWS_AS(greedy_partition({1, -2}, 2), sk::InvalidArgument);
}

TEST_CASE("ResNet-50's 161 tensors on 8 ranks: imbalance at most 2% (FairScale's rule: ~30%)") {
  std::vector<std::int64_t> sizes;
  for (const auto& shape : sk::workloads::kResNet50Shapes) sizes.push_back(shape.numel());
  const auto ours = greedy_partition(sizes, 8);
  check_consistent(ours, sizes);
  CHECK(ours.imbalance() <= 0.02);
  CHECK(fairscale_partition(sizes, 8).imbalance() > 0.2);
}
