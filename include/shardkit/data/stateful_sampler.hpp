// VISSL's StatefulDistributedSampler: each rank shuffles only its own contiguous block of the
// dataset, and training can resume mid-epoch from start_iter.
//
// total = N - N mod R (the tail is dropped, never padded); n = total / R; rank r takes
// [r·n, (r+1)·n) permuted by a generator seeded with seed + epoch (the same permutation on
// every rank) and yields indices[start_iter · batch_size :]. The permutation comes from our
// Philox stream (Fisher-Yates), so it is reproducible across machines but not bit-equal to
// torch.randperm's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/philox.hpp"

namespace shardkit::data {

class StatefulDistributedSampler {
 public:
  StatefulDistributedSampler(std::int64_t dataset_size, int world_size, int rank,
                             std::int64_t batch_size, std::uint64_t seed = 0)
      : dataset_size_(dataset_size),
        world_size_(world_size),
        rank_(rank),
        batch_size_(batch_size),
        seed_(seed) {
    check(world_size >= 1, "sampler: world size must be >= 1, got ", world_size);
    check(rank >= 0 && rank < world_size, "sampler: rank ", rank, " outside [0, ", world_size, ")");
    check(batch_size >= 1, "sampler: batch size must be >= 1, got ", batch_size);
    check(dataset_size >= world_size, "sampler: ", dataset_size, " samples cannot feed ",
          world_size, " ranks; use fewer ranks or more data");
  }

  void set_epoch(std::int64_t epoch) { epoch_ = epoch; }
  // Resume mid-epoch: skip the first `start_iter` batches of this rank.
  void set_start_iter(std::int64_t start_iter) {
    check(start_iter >= 0, "sampler: start_iter must be >= 0, got ", start_iter);
    start_iter_ = start_iter;
  }

  std::int64_t samples_per_rank() const {
    return (dataset_size_ - dataset_size_ % world_size_) / world_size_;
  }
  std::int64_t epoch() const { return epoch_; }
  std::int64_t start_iter() const { return start_iter_; }

  // This rank's dataset indices for the epoch, from start_iter on.
  std::vector<std::int64_t> indices() const {
    const std::int64_t n = samples_per_rank();
    std::vector<std::int64_t> block(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) block[static_cast<std::size_t>(i)] = rank_ * n + i;
    // Fisher-Yates with draws from Philox keyed by seed + epoch: the same on every rank.
    const std::uint64_t key = seed_ + static_cast<std::uint64_t>(epoch_);
    for (std::int64_t i = n - 1; i > 0; --i) {
      const PhiloxBlock draw = philox_block(key, static_cast<std::uint64_t>(i));
      const std::uint64_t wide = (std::uint64_t{draw.v[0]} << 32) | draw.v[1];
      const auto j = static_cast<std::int64_t>(wide % static_cast<std::uint64_t>(i + 1));
      std::swap(block[static_cast<std::size_t>(i)], block[static_cast<std::size_t>(j)]);
    }
    // (start_iter comes from a checkpoint: past the epoch's end it skips every index, without
    // the product overflowing.)
    const std::int64_t skip =
        start_iter_ >= n / batch_size_ + 1 ? n : std::min(n, start_iter_ * batch_size_);
    return std::vector<std::int64_t>(block.begin() + skip, block.end());
  }

 private:
  std::int64_t dataset_size_;
  int world_size_;
  int rank_;
  std::int64_t batch_size_;
  std::uint64_t seed_;
  std::int64_t epoch_ = 0;
  std::int64_t start_iter_ = 0;
};

}  // namespace shardkit::data
