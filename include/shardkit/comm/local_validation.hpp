// Cross-rank checks of the local backend: once every rank has posted a call, all posts must
// agree on the collective, dtype, counts, root, op and device, and on being captured or not. One
// process sees every rank, so the local backend checks what MPI and NCCL cannot.
#pragma once

#include <string_view>
#include <vector>

#include "shardkit/comm/calls_differ.hpp"
#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/comm/transfer_plan.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

namespace detail {

inline std::string post_call_name(const LocalPost& post) {
  return post.is_split ? "split" : std::string(collective_name(post.kind));
}

inline std::string counts_str(const std::vector<std::size_t>& counts) {
  std::string out = "[";
  for (std::size_t i = 0; i < counts.size(); ++i)
    out += (i ? ", " : "") + std::to_string(counts[i]);
  return out + "]";
}

}  // namespace detail

// Throws CallsDiffer naming the call, both ranks and the values that differ. `name` is the
// call as "all_reduce #12".
inline void validate_local_posts(const std::vector<LocalPost>& posts, std::string_view name) {
  const LocalPost& a = posts[0];
  const auto n = posts.size();
  auto differ = [&](std::size_t r, std::string_view what, const auto& value_r, const auto& value_0,
                    std::string_view fix) {
    fail<CallsDiffer>("local ", name, " (world of ", n, "): rank ", r, " passed ", what, " ",
                      value_r, " but rank 0 passed ", value_0, "; ", fix);
  };
  for (std::size_t r = 1; r < n; ++r) {
    const LocalPost& b = posts[r];
    if (a.is_split != b.is_split || a.kind != b.kind)
      differ(r, "the call", detail::post_call_name(b), detail::post_call_name(a),
             "every rank must issue the same collectives in the same order");
    if (a.labelled && b.labelled && a.label != b.label)  // (CommOptions::validate_order)
      fail<CallsDiffer>("local ", name, " (world of ", n, "): rank ", r, " issued it for '",
                        b.label, "' but rank 0 for '", a.label,
                        "'; every rank must issue the same collectives in the same order "
                        "(the same units, micro-batches and branches on every rank)");
    if (a.is_split) continue;
    if (a.kind == CollectiveKind::barrier) {
      // A barrier posted with in_capture is the ranks' meeting around a captured step's run
      // (LocalCommunicator::meet_around_graph_run): it pairs with no user's barrier.
      auto what = [](const LocalPost& post) {
        return post.in_capture ? "the meeting around a captured step's run" : "a barrier";
      };
      if (a.in_capture != b.in_capture)
        fail<CallsDiffer>("local ", name, " (world of ", n, "): rank ", r, " is at ", what(b),
                          " but rank 0 at ", what(a),
                          "; every rank of the world must run its captured steps together "
                          "and issue the same barriers");
      continue;
    }
    if (a.send.dtype != b.send.dtype)
      differ(r, "dtype", dtype_name(b.send.dtype), dtype_name(a.send.dtype),
             "every rank must pass the same dtype");
    const bool recv_counts = a.kind == CollectiveKind::reduce_scatter;
    const std::size_t count_a = recv_counts ? a.recv.count : a.send.count;
    const std::size_t count_b = recv_counts ? b.recv.count : b.send.count;
    if (count_a != count_b)
      differ(r, "a count of", count_b, count_a, "every rank must pass the same element count");
    if (a.counts != b.counts)
      differ(r, "counts", detail::counts_str(b.counts), detail::counts_str(a.counts),
             "every rank must pass the same per-owner counts");
    if ((a.kind == CollectiveKind::reduce || a.kind == CollectiveKind::broadcast) &&
        a.root != b.root)
      differ(r, "root", b.root, a.root, "every rank must name the same root");
    const bool reduces = a.kind == CollectiveKind::all_reduce || a.kind == CollectiveKind::reduce ||
                         a.kind == CollectiveKind::reduce_scatter ||
                         a.kind == CollectiveKind::reduce_scatter_v;
    if (reduces && a.op != b.op)
      differ(r, "op", reduce_op_name(b.op), reduce_op_name(a.op),
             "every rank must pass the same reduction");
    if (a.in_capture != b.in_capture) {
      auto how = [](const LocalPost& post) {
        return post.in_capture ? "inside a captured step" : "eagerly";
      };
      fail<CallsDiffer>("local ", name, " (world of ", n, "): rank ", r, " issued it ", how(b),
                        " but rank 0 ", how(a),
                        "; capture the step on every rank of the world together (each "
                        "rank's StepGraph with the same key and warm-up steps), or on none");
    }
    if (a.send.device != b.send.device)
      differ(r, "buffers on", b.send.device.str(), a.send.device.str(),
             "a local world moves host memory or the memory of one GPU; keep every rank's buffers "
             "on the same device");
  }
  if (!a.is_split && a.send.device.is_cuda())
    check(static_cast<int>(n) <= kMaxLocalDeviceRanks, "local ", name, ": ", n,
          " ranks reduce device memory, but one kernel takes at most ", kMaxLocalDeviceRanks,
          "; use fewer local ranks per GPU (or NCCL across GPUs)");
}

}  // namespace shardkit::comm
