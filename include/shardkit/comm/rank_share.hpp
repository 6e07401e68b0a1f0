// One rank's share of a collective's TransferPlan: the copies and reductions that write this
// rank's receive buffer. The local backend normally carries out the whole plan in one place
// (the world's worker thread, or the world's CUDA stream). Inside a captured step each rank's
// CUDA graph must hold its own part instead (comm/device_rendezvous.hpp): every rank waits until
// all have reached the call, writes its own receive buffer from everyone's send buffers, and
// waits again until all have read, so no rank overwrites memory another still reads.
//
// Staging: a rank whose writes overlap memory the collective reads (an in-place all_reduce: its
// receive buffer is its send buffer, which every rank reads) writes into a scratch block first
// and copies the written ranges back after the second wait. Writes that overlap nothing read
// (an in-place all_gather fills the other ranks' segments around its own) go straight in.
// Every share together writes exactly what the whole plan writes, with the same reductions in
// the same rank order: the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardkit/comm/transfer_plan.hpp"

namespace shardkit::comm {

struct RankShare {
  TransferPlan plan;  // this rank's steps; every destination lies in its receive buffer
  bool staged = false;
  // When staged: where each written range goes back to, as (offset in the receive buffer, bytes).
  std::vector<std::pair<std::size_t, std::size_t>> written;
};

namespace detail {

struct ByteRange {
  std::uintptr_t begin;
  std::uintptr_t end;
  bool overlaps(const ByteRange& other) const { return begin < other.end && other.begin < end; }
  bool contains(const ByteRange& other) const { return begin <= other.begin && other.end <= end; }
};

inline ByteRange range_of(const void* data, std::size_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  return {begin, begin + bytes};
}

}  // namespace detail

// `plan` is plan_transfers(posts); `rank` indexes posts. A rank whose receive buffer nothing
// writes (a reduce's non-root) gets an empty share: it still takes part in both waits.
inline RankShare rank_share(const TransferPlan& plan, const std::vector<LocalPost>& posts,
                            int rank) {
  using detail::ByteRange;
  using detail::range_of;
  const Buffer& recv = posts[static_cast<std::size_t>(rank)].recv;
  const std::size_t esize = dtype_size(plan.dtype);
  const ByteRange mine = range_of(recv.data, recv.count * recv.element_size());
  RankShare share;
  share.plan.dtype = plan.dtype;
  share.plan.op = plan.op;
  std::vector<ByteRange> reads, writes;
  for (const CopyStep& c : plan.copies) {
    reads.push_back(range_of(c.src, c.bytes));
    const ByteRange dst = range_of(c.dst, c.bytes);
    if (!mine.contains(dst)) continue;
    share.plan.copies.push_back(c);
    writes.push_back(dst);
  }
  for (const ReduceStep& step : plan.reductions) {
    for (const void* source : step.sources) reads.push_back(range_of(source, step.count * esize));
    for (void* destination : step.destinations) {
      const ByteRange dst = range_of(destination, step.count * esize);
      if (!mine.contains(dst)) continue;
      share.plan.reductions.push_back({step.sources, {destination}, step.count});
      writes.push_back(dst);
    }
  }
  for (const ByteRange& w : writes)
    for (const ByteRange& r : reads)
      if (w.overlaps(r)) share.staged = true;
  if (share.staged)
    for (const ByteRange& w : writes)
      share.written.emplace_back(w.begin - mine.begin, w.end - w.begin);
  return share;
}

// The share with its destinations moved into `scratch` (as large as the receive buffer), at
// the same offsets: what a staged rank runs before the second wait.
inline TransferPlan staged_into(const RankShare& share, const Buffer& recv, void* scratch) {
  auto moved = [&](const void* dst) {
    return static_cast<void*>(
        static_cast<std::byte*>(scratch) +
        (static_cast<const std::byte*>(dst) - static_cast<const std::byte*>(recv.data)));
  };
  TransferPlan plan = share.plan;
  for (CopyStep& c : plan.copies) c.dst = moved(c.dst);
  for (ReduceStep& step : plan.reductions)
    for (void*& destination : step.destinations) destination = moved(destination);
  return plan;
}

}  // namespace shardkit::comm
