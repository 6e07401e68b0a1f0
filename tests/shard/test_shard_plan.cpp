// ShardPlan: rank ranges are contiguous and in rank order, every trainable element is owned
// exactly once, frozen parameters sit after the sharded range.
#include <doctest/doctest.h>

#include <random>

#include "shardkit/shard/shard_plan.hpp"

namespace sk = shardkit;
using namespace sk::shard;

TEST_CASE("greedy and flat plans: contiguous rank ranges covering each parameter once") {
  std::mt19937 rng(9);
  for (auto kind : {PartitionKind::greedy, PartitionKind::flat})
    for (int world : {1, 2, 3, 4, 8}) {
      std::vector<ParamSpec> specs;
      for (int i = 0; i < 17; ++i) {
        std::string name = "p";
        name += std::to_string(i);
        specs.push_back({name, {1 + static_cast<std::int64_t>(rng() % 300)}, i != 5});
      }
      const ShardPlan plan(specs, world, kind);
      CHECK(plan.begin(0) == 0);
      for (int r = 0; r + 1 < world; ++r) CHECK(plan.end(r) == plan.begin(r + 1));
      CHECK(plan.end(world - 1) == plan.trainable_end());
      std::vector<std::int64_t> covered(specs.size(), 0);
      for (int r = 0; r < world; ++r)
        for (const auto& piece : plan.pieces(r)) {
          const auto& slot = plan.layout()[piece.param];
          CHECK(piece.flat_begin == slot.offset + piece.param_begin);
          CHECK(piece.flat_begin >= plan.begin(r));
          CHECK(piece.flat_begin + piece.numel() <= plan.end(r));
          covered[piece.param] += piece.numel();
        }
      for (std::size_t i = 0; i < specs.size(); ++i)
        CHECK(covered[i] == (specs[i].trainable ? sk::shape_numel(specs[i].shape) : 0));
      CHECK(plan.layout()[5].offset >= plan.trainable_end());  // the frozen one
      if (kind == PartitionKind::greedy) {
        CHECK_FALSE(plan.any_parameter_spans_ranks());
        CHECK(plan.imbalance() < 0.35);
      } else {
        for (int r = 0; r + 1 < world; ++r) CHECK(plan.numel(r) == plan.numel(r + 1));
      }
    }
}

TEST_CASE("the flat plan straddles parameters and pads the last range") {
  const ShardPlan plan({{"a", {100}}, {"b", {100}}}, 3, PartitionKind::flat);
  CHECK(plan.numel(0) == plan.numel(2));
  CHECK(plan.trainable_end() == 3 * plan.numel(0));
  CHECK(plan.any_parameter_spans_ranks());
  CHECK(plan.rank_of_element(0) == 0);
  CHECK(plan.rank_of_element(plan.trainable_end() - 1) == 2);
  CHECK_THROWS_AS(plan.rank_of_element(plan.trainable_end()), sk::InvalidArgument);
}

// An empty parameter starts where the next one does; a negative dimension is refused by name.
TEST_CASE("plans take empty parameters and refuse negative sizes") {
  for (auto kind : {PartitionKind::greedy, PartitionKind::flat})
    for (int world : {1, 2}) {
      CAPTURE(world);
      const ShardPlan plan({{"a", {16}}, {"b", {16}}, {"z", {0}}}, world, kind);
      CHECK(plan.layout()[2].numel == 0);
      // (an empty parameter has no piece: it neither hides nor fakes one split over ranks)
      CHECK_FALSE(plan.any_parameter_spans_ranks());  // (a, b: 16 elements each, a rank each)
      const ShardPlan split({{"z", {0}}, {"a", {100}}}, world, kind);
      CHECK(split.any_parameter_spans_ranks() == (kind == PartitionKind::flat && world == 2));
      const ShardPlan frozen({{"w", {16}}, {"f", {5}, false}, {"z", {0}}}, world, kind);
      CHECK(frozen.layout()[1].offset >= frozen.trainable_end());
      CHECK_THROWS_WITH_AS(ShardPlan({{"a", {-2, -3}}}, world, kind),
                           "parameter 'a' has a negative size in shape [-2, -3]",
                           sk::InvalidArgument);
    }
}
