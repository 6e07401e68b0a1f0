// How the local backend carries out one collective once every rank has posted its buffers: a
// list of copies and of reductions (n sources, in rank order, written to one or more
// destinations). The same plan runs on the CPU (local_host_ops.hpp) and on a GPU (device copies
// plus the reduction kernel), which is why both give the same bits.
//
// In-place safety: a reduction reads all its sources for an element before it writes that
// element anywhere, and no step writes memory another step reads, for every form the
// Communicator interface accepts (in-place all_reduce, all_gather, reduce_scatter, _v forms).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "shardkit/comm/buffer.hpp"
#include "shardkit/comm/comm_stats.hpp"
#include "shardkit/comm/reduction.hpp"

namespace shardkit::comm {

// One rank's part of a collective, as the Communicator normalised it.
struct LocalPost {
  CollectiveKind kind = CollectiveKind::barrier;
  bool is_split = false;
  Buffer send;
  Buffer recv;
  std::vector<std::size_t> counts;  // the _v forms
  int root = 0;
  ReduceOp op = ReduceOp::sum;
  int color = 0;  // split
  int key = 0;
  // Issued inside a captured step (device memory only): each rank's graph carries out its own
  // share (comm/rank_share.hpp) instead of the world's stream carrying out the whole plan.
  bool in_capture = false;
  // With CommOptions::validate_order, what issued it (Communicator::label): the calls of two
  // FSDP units of the same size meet in the same shape, and only their labels tell them apart.
  bool labelled = false;
  std::string label;
};

struct CopyStep {
  const void* src;
  void* dst;
  std::size_t bytes;
};

struct ReduceStep {
  std::vector<const void*> sources;  // rank order
  std::vector<void*> destinations;
  std::size_t count;
};

struct TransferPlan {
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  std::vector<CopyStep> copies;
  std::vector<ReduceStep> reductions;
};

namespace detail {

inline const void* at(const Buffer& b, std::size_t element) {
  return b.bytes() + element * b.element_size();
}
inline void* at_mut(const Buffer& b, std::size_t element) {
  return b.bytes() + element * b.element_size();
}

}  // namespace detail

// Assumes the posts were validated against each other (same kind, dtype, counts, root, op).
inline TransferPlan plan_transfers(const std::vector<LocalPost>& posts) {
  using detail::at;
  using detail::at_mut;
  TransferPlan plan;
  const std::size_t n = posts.size();
  const LocalPost& first = posts[0];
  plan.dtype = first.send.dtype;
  plan.op = first.op;
  const std::size_t esize = dtype_size(plan.dtype);
  auto copy = [&](const void* src, void* dst, std::size_t elements) {
    if (src != dst && elements > 0) plan.copies.push_back({src, dst, elements * esize});
  };
  switch (first.kind) {
    case CollectiveKind::all_reduce:
    case CollectiveKind::reduce: {
      ReduceStep step{{}, {}, first.send.count};
      for (std::size_t r = 0; r < n; ++r) {
        step.sources.push_back(posts[r].send.data);
        if (first.kind == CollectiveKind::all_reduce || static_cast<int>(r) == first.root)
          step.destinations.push_back(posts[r].recv.data);
      }
      if (step.count > 0) plan.reductions.push_back(std::move(step));
      break;
    }
    case CollectiveKind::broadcast: {
      const Buffer& root = posts[static_cast<std::size_t>(first.root)].send;
      for (std::size_t r = 0; r < n; ++r) copy(root.data, posts[r].send.data, root.count);
      break;
    }
    case CollectiveKind::all_gather: {
      const std::size_t count = first.send.count;
      for (std::size_t r = 0; r < n; ++r)
        for (std::size_t q = 0; q < n; ++q)
          copy(posts[r].send.data, at_mut(posts[q].recv, r * count), count);
      break;
    }
    case CollectiveKind::reduce_scatter: {
      const std::size_t count = first.recv.count;
      if (count == 0) break;
      for (std::size_t r = 0; r < n; ++r) {
        ReduceStep step{{}, {posts[r].recv.data}, count};
        for (std::size_t q = 0; q < n; ++q) step.sources.push_back(at(posts[q].send, r * count));
        plan.reductions.push_back(std::move(step));
      }
      break;
    }
    case CollectiveKind::all_gather_v: {
      std::size_t offset = 0;
      for (std::size_t r = 0; r < n; ++r) {
        const std::size_t count = first.counts[r];
        for (std::size_t q = 0; q < n; ++q)
          copy(at(posts[r].send, offset), at_mut(posts[q].send, offset), count);
        offset += count;
      }
      break;
    }
    case CollectiveKind::reduce_scatter_v: {
      std::size_t offset = 0;
      for (std::size_t r = 0; r < n; ++r) {
        const std::size_t count = first.counts[r];
        if (count > 0) {
          ReduceStep step{{}, {posts[r].recv.data}, count};
          for (std::size_t q = 0; q < n; ++q) step.sources.push_back(at(posts[q].send, offset));
          plan.reductions.push_back(std::move(step));
        }
        offset += count;
      }
      break;
    }
    case CollectiveKind::all_to_all_v: {
      std::size_t offset = 0;
      for (std::size_t r = 0; r < n; ++r) {
        const std::size_t count = first.counts[r];
        for (std::size_t q = 0; q < n; ++q)
          copy(at(posts[q].send, offset), at_mut(posts[r].recv, q * count), count);
        offset += count;
      }
      break;
    }
    case CollectiveKind::barrier:
      break;
  }
  return plan;
}

}  // namespace shardkit::comm
