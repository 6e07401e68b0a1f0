// Per-communicator counters: calls, message bytes and bus bytes per collective kind, so that a
// benchmark can compare what a ZeRO stage sends with the ZeRO formulas (docs/semantics.md).
//
// Accounting (the same on every backend, counted when a call is issued on this rank):
// - payload_bytes: the message size S as nccl-tests names it -- all_reduce, reduce, broadcast:
//   the buffer (count x element size); all_gather: the gathered output (size x count);
//   reduce_scatter: the input (size x count); the _v forms: the whole buffer (sum of counts);
//   all_to_all_v: what this rank sends (sum of counts).
// - bus_bytes: what each rank sends in a bandwidth-optimal ring/pipeline, S x factor with
//   factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter, their _v forms and
//   all_to_all_v (a rank keeps its own segment), 1 for broadcast and reduce (nccl-tests' busbw
//   factors), and 0 when n = 1 (nothing leaves the rank). Integer bytes, rounded down. bus_bytes /
//   time is nccl-tests' busbw. So DDP's gradient all-reduce of Psi elements counts 2 Psi (n-1)/n
//   elements, and ZeRO-3's all-gather + all-gather + reduce-scatter 3 Psi (n-1)/n, as the ZeRO
//   paper states.
// - Bytes are in the caller's dtype. A backend that widens f16/bf16 to f32 on the wire (MPI
//   does, to sum in f32) sends twice that; the counters stay comparable across backends.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardkit/core/enum_names.hpp"

namespace shardkit::comm {

enum class CollectiveKind : std::uint8_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  all_gather_v,      // per-owner broadcast of uneven segments
  reduce_scatter_v,  // per-owner reduce of uneven segments
  all_to_all_v,      // per-owner segments moved, not reduced (the owner gets every rank's)
  barrier,
};

inline constexpr std::size_t kCollectiveKindCount = 9;

inline constexpr CollectiveKind kAllCollectiveKinds[kCollectiveKindCount] = {
    CollectiveKind::all_reduce,       CollectiveKind::reduce,         CollectiveKind::broadcast,
    CollectiveKind::all_gather,       CollectiveKind::reduce_scatter, CollectiveKind::all_gather_v,
    CollectiveKind::reduce_scatter_v, CollectiveKind::all_to_all_v,   CollectiveKind::barrier};

inline constexpr EnumName<CollectiveKind> kCollectiveNames[] = {
    {CollectiveKind::all_reduce, "all_reduce"},
    {CollectiveKind::reduce, "reduce"},
    {CollectiveKind::broadcast, "broadcast"},
    {CollectiveKind::all_gather, "all_gather"},
    {CollectiveKind::reduce_scatter, "reduce_scatter"},
    {CollectiveKind::all_gather_v, "all_gather_v"},
    {CollectiveKind::reduce_scatter_v, "reduce_scatter_v"},
    {CollectiveKind::all_to_all_v, "all_to_all_v"},
    {CollectiveKind::barrier, "barrier"}};

constexpr std::string_view collective_name(CollectiveKind kind) {
  return name_of(kind, kCollectiveNames);
}

// nccl-tests' bus-bandwidth factor for a world of n ranks, as numerator / denominator.
struct BusFactor {
  std::uint64_t numerator = 0;
  std::uint64_t denominator = 1;
  double value() const { return static_cast<double>(numerator) / static_cast<double>(denominator); }
};

constexpr BusFactor bus_factor(CollectiveKind kind, int n) {
  if (n <= 1) return {0, 1};
  const auto size = static_cast<std::uint64_t>(n);
  switch (kind) {
    case CollectiveKind::all_reduce:
      return {2 * (size - 1), size};
    case CollectiveKind::all_gather:
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_gather_v:
    case CollectiveKind::reduce_scatter_v:
    case CollectiveKind::all_to_all_v:
      return {size - 1, size};
    case CollectiveKind::broadcast:
    case CollectiveKind::reduce:
      return {1, 1};
    case CollectiveKind::barrier:
      return {0, 1};
  }
  return {0, 1};
}

constexpr std::uint64_t bus_bytes(CollectiveKind kind, std::uint64_t payload_bytes, int n) {
  const BusFactor f = bus_factor(kind, n);
  return payload_bytes * f.numerator / f.denominator;
}

struct CollectiveCounters {
  std::uint64_t calls = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t bus_bytes = 0;
};

// Counters of one communicator. Not atomic: like an NCCL communicator, one is driven by one
// thread (its rank) at a time.
class CommStats {
 public:
  void record(CollectiveKind kind, std::uint64_t payload, int world_size) {
    auto& c = per_kind_[static_cast<std::size_t>(kind)];
    c.calls += 1;
    c.payload_bytes += payload;
    c.bus_bytes += comm::bus_bytes(kind, payload, world_size);
  }

  const CollectiveCounters& of(CollectiveKind kind) const {
    return per_kind_[static_cast<std::size_t>(kind)];
  }

  std::uint64_t total_calls() const { return sum(&CollectiveCounters::calls); }
  std::uint64_t total_payload_bytes() const { return sum(&CollectiveCounters::payload_bytes); }
  std::uint64_t total_bus_bytes() const { return sum(&CollectiveCounters::bus_bytes); }

  void reset() { per_kind_ = {}; }

 private:
  std::uint64_t sum(std::uint64_t CollectiveCounters::*field) const {
    std::uint64_t total = 0;
    for (const auto& c : per_kind_) total += c.*field;
    return total;
  }

  std::array<CollectiveCounters, kCollectiveKindCount> per_kind_{};
};

}  // namespace shardkit::comm
