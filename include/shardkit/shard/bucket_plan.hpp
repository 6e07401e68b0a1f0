// BucketPlan and BucketSchedule: which gradients travel together, and when a bucket may go.
// Pure bookkeeping -- no Context, no communicator -- so both are tested on their own; the
// runtime (grad_bucketer.hpp) moves the data they describe.
//
// BucketPlan: trainable parameters of a ShardPlan are taken in reverse registration order (the
// order a backward produces their gradients) up to a capacity, identical on every rank. Inside
// a bucket the parameters sit in flat-buffer order, so each rank's part of the bucket is one
// contiguous run, in rank order: one reduce_scatter_v per bucket reaches every owner.
//
// BucketSchedule: buckets go strictly in bucket order (every rank issues the same collectives
// in the same order: NCCL's rule), each as soon as all its items are ready; at most
// `max_in_flight` are in flight, launching one more first completes the oldest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::shard {

struct GradBucket {
  std::vector<std::size_t> params;     // layout indices, in flat-buffer order
  std::vector<std::int64_t> position;  // where each parameter starts inside the bucket
  std::vector<std::size_t> counts;     // elements of the bucket owned by each rank, rank order
  std::int64_t numel = 0;
  std::int64_t base = 0;        // offset of the bucket in a buffer holding every bucket
  std::int64_t own_begin = 0;   // where this rank's part starts inside the bucket
  std::int64_t own_offset = 0;  // offset of this rank's part in a buffer of owned parts only
  std::int64_t own_numel = 0;   // size of this rank's part
};

class BucketPlan {
 public:
  // `capacity` in elements; a parameter larger than it gets a bucket of its own.
  BucketPlan(const ShardPlan& plan, int rank, std::int64_t capacity) : plan_(&plan), rank_(rank) {
    check(capacity > 0, "bucket capacity is ", capacity,
          " elements; pass a positive size (PyTorch ",
          "DDP uses 25 MiB, FairScale SDP 2^23 elements)");
    check(rank >= 0 && rank < plan.world_size(), "BucketPlan: rank ", rank,
          " is outside a plan for ", plan.world_size(), " ranks");
    const auto& layout = plan.layout();
    bucket_of_.assign(layout.size(), 0);
    position_of_.assign(layout.size(), 0);
    for (std::size_t i = layout.size(); i-- > 0;) {
      if (!layout[i].trainable) continue;
      const std::int64_t extent = extent_of(i);
      if (buckets_.empty() ||
          (buckets_.back().numel > 0 && buckets_.back().numel + extent > capacity))
        buckets_.emplace_back();
      buckets_.back().params.push_back(i);
      buckets_.back().numel += extent;
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      GradBucket& bucket = buckets_[b];
      std::sort(bucket.params.begin(), bucket.params.end(),
                [&](std::size_t x, std::size_t y) { return layout[x].offset < layout[y].offset; });
      bucket.counts.assign(static_cast<std::size_t>(plan.world_size()), 0);
      std::int64_t at = 0;
      for (auto i : bucket.params) {
        bucket.position.push_back(at);
        bucket_of_[i] = b;
        position_of_[i] = at;
        // The extent split over the ranks whose ranges it overlaps (a flat plan may cut it).
        const std::int64_t begin = layout[i].offset, end = begin + extent_of(i);
        for (std::int64_t e = begin; e < end;) {
          const int owner = plan.rank_of_element(e);
          const std::int64_t stop = std::min(end, plan.end(owner));
          bucket.counts[static_cast<std::size_t>(owner)] += static_cast<std::size_t>(stop - e);
          e = stop;
        }
        at += extent_of(i);
      }
      for (int r = 0; r < rank; ++r)
        bucket.own_begin += static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(r)]);
      bucket.own_numel = static_cast<std::int64_t>(bucket.counts[static_cast<std::size_t>(rank)]);
      bucket.base = total_numel_;
      total_numel_ += bucket.numel;
      bucket.own_offset = owned_numel_;
      owned_numel_ += bucket.own_numel;
    }
  }

  const ShardPlan& shard_plan() const { return *plan_; }
  int rank() const { return rank_; }
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  std::size_t bucket_of(std::size_t param) const { return bucket_of_[param]; }
  // Where parameter `param` starts inside its bucket.
  std::int64_t position_of(std::size_t param) const { return position_of_[param]; }
  std::int64_t total_numel() const { return total_numel_; }  // every bucket, one after another
  std::int64_t owned_numel() const { return owned_numel_; }  // this rank's parts only

  // Parameters per bucket: what the schedule counts down.
  std::vector<int> items_per_bucket() const {
    std::vector<int> out;
    for (const auto& bucket : buckets_) out.push_back(static_cast<int>(bucket.params.size()));
    return out;
  }

  // Where piece `piece` of this rank's pieces sits in the buffer of owned parts.
  std::int64_t owned_offset_of(const ParamPiece& piece) const {
    const GradBucket& bucket = buckets_[bucket_of_[piece.param]];
    const std::int64_t at = position_of_[piece.param] + piece.param_begin;
    check(at >= bucket.own_begin && at + piece.numel() <= bucket.own_begin + bucket.own_numel, "'",
          plan_->layout()[piece.param].name, "' elements [", piece.param_begin, ", ",
          piece.param_end, ") are not owned by rank ", rank_,
          "; a rank keeps only the gradients it owns");
    return bucket.own_offset + (at - bucket.own_begin);
  }

 private:
  // A parameter's extent: its elements plus the alignment padding after it.
  std::int64_t extent_of(std::size_t i) const {
    const std::int64_t a = plan_->layout().alignment();
    return (plan_->layout()[i].numel + a - 1) / a * a;
  }

  const ShardPlan* plan_;
  int rank_;
  std::vector<GradBucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<std::int64_t> position_of_;
  std::int64_t total_numel_ = 0;
  std::int64_t owned_numel_ = 0;
};

class BucketSchedule {
 public:
  BucketSchedule(std::vector<int> items_per_bucket, int max_in_flight)
      : items_(std::move(items_per_bucket)), max_in_flight_(max_in_flight) {
    check(max_in_flight >= 1, "max_in_flight must be >= 1 bucket, got ", max_in_flight);
    for (int n : items_) check(n >= 1, "BucketSchedule: a bucket needs at least one item");
    reset();
  }

  std::size_t size() const { return items_.size(); }
  int pending(std::size_t bucket) const { return pending_[bucket]; }
  std::size_t launched() const { return next_launch_; }     // buckets [0, launched()) went out
  std::size_t completed() const { return next_complete_; }  // buckets [0, completed()) are done
  int in_flight() const { return static_cast<int>(next_launch_ - next_complete_); }

  // One item of `bucket` is ready.
  void ready(std::size_t bucket) {
    check<StateError>(bucket < items_.size() && pending_[bucket] > 0, "BucketSchedule: bucket ",
                      bucket, " has no item left to mark ready in this round");
    --pending_[bucket];
  }

  // Launches every bucket that is complete and next in order. Before each launch, buckets that
  // already finished (done(b), which must not block) are completed, and at max_in_flight the
  // oldest is completed (which may block).
  template <class Launch, class Complete, class Done>
  void advance(Launch&& launch, Complete&& complete, Done&& done) {
    while (next_launch_ < items_.size() && pending_[next_launch_] == 0) {
      while (next_complete_ < next_launch_ &&
             (done(next_complete_) || in_flight() >= max_in_flight_))
        complete(next_complete_++);
      launch(next_launch_++);
    }
  }

  // Completes, in order, the launched buckets that already finished (done(b) must not block),
  // launching nothing: frees their buffers while the caller works elsewhere.
  template <class Complete, class Done>
  void collect(Complete&& complete, Done&& done) {
    while (next_complete_ < next_launch_ && done(next_complete_)) complete(next_complete_++);
  }

  // The end of a round: every bucket must be ready; launches the rest and completes everything.
  template <class Launch, class Complete>
  void drain(Launch&& launch, Complete&& complete) {
    advance(launch, complete, [](std::size_t) { return false; });
    check<StateError>(next_launch_ == items_.size(), "BucketSchedule: bucket ", next_launch_,
                      " still waits for ",
                      next_launch_ < items_.size() ? pending_[next_launch_] : 0,
                      " items at the end of the round");
    while (next_complete_ < next_launch_) complete(next_complete_++);
  }

  // Next round: every item pending again.
  void reset() {
    pending_ = items_;
    next_launch_ = 0;
    next_complete_ = 0;
  }

 private:
  std::vector<int> items_;
  std::vector<int> pending_;
  int max_in_flight_;
  std::size_t next_launch_ = 0;
  std::size_t next_complete_ = 0;
};

}  // namespace shardkit::shard
