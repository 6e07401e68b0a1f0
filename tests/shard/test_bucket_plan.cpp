// BucketPlan and BucketSchedule, without a communicator: buckets follow the backward, each
// rank's part of a bucket is one run, and the schedule launches in order within max_in_flight.
#include <doctest/doctest.h>

#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "shardkit/shard/bucket_plan.hpp"

namespace sk = shardkit;
using namespace sk::shard;

namespace {

std::vector<ParamSpec> random_specs(std::mt19937& rng, int count) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < count; ++i) {
    std::string name = "p";  // (not "p" + to_string: GCC 12 warns falsely, -Wrestrict)
    name += std::to_string(i);
    specs.push_back({name, {1 + static_cast<std::int64_t>(rng() % 500)}, i % 7 != 3});
  }
  return specs;
}

}  // namespace

TEST_CASE("buckets take parameters in reverse registration order up to the capacity") {
  std::mt19937 rng(3);
  const auto specs = random_specs(rng, 23);
  for (auto kind : {PartitionKind::greedy, PartitionKind::flat})
    for (int world : {1, 2, 3, 8}) {
      const ShardPlan plan(specs, world, kind);
      const std::int64_t capacity = 700;
      std::vector<std::int64_t> owned(static_cast<std::size_t>(world), 0);
      for (int rank = 0; rank < world; ++rank) {
        const BucketPlan buckets(plan, rank, capacity);
        std::size_t last_bucket = 0;
        std::int64_t base = 0, own_offset = 0;
        for (std::size_t i = specs.size(); i-- > 0;) {
          if (!specs[i].trainable) continue;
          CHECK(buckets.bucket_of(i) >= last_bucket);  // later parameters, earlier buckets
          last_bucket = buckets.bucket_of(i);
        }
        for (const auto& bucket : buckets.buckets()) {
          CHECK(bucket.base == base);
          CHECK(bucket.own_offset == own_offset);
          base += bucket.numel;
          own_offset += bucket.own_numel;
          // Over the capacity only with a single parameter.
          CHECK((bucket.numel <= capacity || bucket.params.size() == 1));
          const auto total =
              std::accumulate(bucket.counts.begin(), bucket.counts.end(), std::size_t{0});
          CHECK(static_cast<std::int64_t>(total) == bucket.numel);
          // Inside a bucket: flat order, so each rank's part is contiguous and in rank order.
          for (std::size_t k = 1; k < bucket.params.size(); ++k)
            CHECK(plan.layout()[bucket.params[k - 1]].offset <
                  plan.layout()[bucket.params[k]].offset);
          std::int64_t before = 0;
          for (int r = 0; r < rank; ++r)
            before += static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(r)]);
          CHECK(bucket.own_begin == before);
        }
        CHECK(buckets.total_numel() == base);
        CHECK(buckets.owned_numel() == own_offset);
        // Every piece this rank updates lies inside its owned parts, without overlap.
        std::int64_t covered = 0;
        for (const auto& piece : plan.pieces(rank)) {
          const auto at = buckets.owned_offset_of(piece);
          CHECK(at >= 0);
          CHECK(at + piece.numel() <= buckets.owned_numel());
          covered += piece.numel();
        }
        CHECK(covered <= buckets.owned_numel());
        owned[static_cast<std::size_t>(rank)] = buckets.owned_numel();
        if (rank > 0 && !plan.pieces(rank - 1).empty())  // another rank's piece is not here
          CHECK_THROWS_AS((void)buckets.owned_offset_of(plan.pieces(rank - 1).front()),
                          sk::InvalidArgument);
      }
      CHECK(std::accumulate(owned.begin(), owned.end(), std::int64_t{0}) ==
            BucketPlan(plan, 0, capacity).total_numel());
    }
}

TEST_CASE("a zero capacity is refused with a clear message") {
  const ShardPlan plan({{"w", {10}}}, 1, PartitionKind::flat);
  CHECK_THROWS_WITH_AS(BucketPlan(plan, 0, 0), doctest::Contains("bucket capacity is 0"),
                       sk::InvalidArgument);
  CHECK_THROWS_AS(BucketPlan(plan, 1, 10), sk::InvalidArgument);
}

TEST_CASE("the schedule launches strictly in bucket order, within max_in_flight") {
  std::mt19937 rng(11);
  for (int max_in_flight : {1, 2, 3}) {
    for (int trial = 0; trial < 50; ++trial) {
      const int buckets = 1 + static_cast<int>(rng() % 9);
      std::vector<int> items;
      std::vector<std::size_t> events;
      for (int b = 0; b < buckets; ++b) {
        items.push_back(1 + static_cast<int>(rng() % 4));
        for (int k = 0; k < items.back(); ++k) events.push_back(static_cast<std::size_t>(b));
      }
      std::shuffle(events.begin(), events.end(), rng);  // gradients finish in any order
      BucketSchedule schedule(items, max_in_flight);
      std::vector<std::size_t> launched, completed;
      std::vector<int> ready_items(static_cast<std::size_t>(buckets), 0);
      int worst = 0;
      auto launch = [&](std::size_t b) {
        // Only complete buckets, only the next one, never more than max_in_flight out.
        CHECK(ready_items[b] == items[b]);
        CHECK(b == launched.size());
        launched.push_back(b);
        worst = std::max(worst, static_cast<int>(launched.size() - completed.size()));
      };
      auto complete = [&](std::size_t b) {
        CHECK(b == completed.size());  // oldest first
        completed.push_back(b);
      };
      const bool finish_at_once = trial % 2 == 0;  // the backend reports done or not
      for (auto b : events) {
        ++ready_items[b];
        schedule.ready(b);
        schedule.advance(launch, complete, [&](std::size_t) { return finish_at_once; });
      }
      schedule.drain(launch, complete);
      CHECK(launched.size() == static_cast<std::size_t>(buckets));
      CHECK(completed.size() == static_cast<std::size_t>(buckets));
      CHECK(worst <= max_in_flight);
      // A new round starts with everything pending.
      schedule.reset();
      CHECK(schedule.launched() == 0);
      CHECK(schedule.pending(0) == items[0]);
    }
  }
}

TEST_CASE("collect completes finished buckets in order without launching or blocking") {
  BucketSchedule schedule({1, 1, 1}, 3);
  std::vector<std::size_t> launched, completed;
  auto launch = [&](std::size_t b) { launched.push_back(b); };
  auto complete = [&](std::size_t b) { completed.push_back(b); };
  for (std::size_t b = 0; b < 3; ++b) {
    schedule.ready(b);
    schedule.advance(launch, complete, [](std::size_t) { return false; });
  }
  CHECK(launched.size() == 3);
  CHECK(completed.empty());
  // Bucket 1 finished but bucket 0 did not: nothing completes out of order.
  schedule.collect(complete, [](std::size_t b) { return b == 1; });
  CHECK(completed.empty());
  schedule.collect(complete, [](std::size_t b) { return b <= 1; });
  CHECK(completed == std::vector<std::size_t>{0, 1});
  schedule.drain(launch, complete);
  CHECK(completed == std::vector<std::size_t>{0, 1, 2});
  CHECK(launched.size() == 3);
}

TEST_CASE("the schedule refuses extra ready marks and an unfinished round") {
  BucketSchedule schedule({2, 1}, 2);
  schedule.ready(1);
  CHECK_THROWS_AS(schedule.ready(1), sk::StateError);
  auto none = [](std::size_t) {};
  CHECK_THROWS_WITH_AS(schedule.drain(none, none), doctest::Contains("still waits for 2 items"),
                       sk::StateError);
  CHECK_THROWS_AS(BucketSchedule({1}, 0), sk::InvalidArgument);
}
