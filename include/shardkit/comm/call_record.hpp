// One collective call as the order check and the flight recorder see it.
//
// Every rank of a communicator must issue the same collectives in the same order. When they do
// not -- a parameter used on one rank only, a different number of micro-batches, a branch taken
// on one rank -- MPI and NCCL hang or move the wrong bytes. With CommOptions::validate_order
// each call first exchanges its fingerprint (sequence number, kind, dtype, count, root, op, the
// per-owner counts and the caller's label, 48 bytes) with every rank, and a mismatch is refused
// on every rank before the real call is issued, naming both calls. Each communicator also keeps
// its last calls (FlightRecorder), which a timeout's message lists, so a rank blocked on a peer
// that never came says what it was waiting in and what came before.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/comm_stats.hpp"
#include "shardkit/comm/reduction.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

inline std::uint64_t fnv1a(std::string_view text, std::uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

struct CallRecord {
  std::uint64_t seq = 0;  // this communicator's call number, from 0
  CollectiveKind kind = CollectiveKind::barrier;
  bool is_split = false;
  DType dtype = DType::f32;
  std::uint64_t count = 0;  // elements: the buffer, or the gathered / scattered whole
  std::int64_t root = -1;   // reduce, broadcast
  ReduceOp op = ReduceOp::sum;
  bool reduces = false;
  std::uint64_t counts_hash = 0;  // the per-owner counts of the _v forms
  std::string label;              // what issued it (Communicator::label), or empty

  std::string name() const { return is_split ? "split" : std::string(collective_name(kind)); }

  // "all_gather #12 of 4096 f32 ('fsdp unit 2: gather for forward')"
  std::string describe() const {
    std::string out = shardkit::detail::concat(name(), " #", seq);
    if (!is_split && kind != CollectiveKind::barrier)
      out += shardkit::detail::concat(" of ", count, " ", dtype_name(dtype));
    if (root >= 0) out += shardkit::detail::concat(" from root ", root);
    if (reduces) out += shardkit::detail::concat(" (", reduce_op_name(op), ")");
    if (!label.empty()) out += " ('" + label + "')";
    return out;
  }

  static constexpr std::size_t kFingerprintWords = 6;
  using Fingerprint = std::array<std::uint64_t, kFingerprintWords>;

  Fingerprint fingerprint() const {
    const std::uint64_t shape = static_cast<std::uint64_t>(kind) |
                                static_cast<std::uint64_t>(is_split) << 8 |
                                static_cast<std::uint64_t>(dtype) << 16 |
                                static_cast<std::uint64_t>(reduces ? op : ReduceOp::sum) << 24;
    return {seq, shape, count, static_cast<std::uint64_t>(root), counts_hash, fnv1a(label)};
  }

  // Another rank's call, as far as its fingerprint tells (its label only as "another label").
  static std::string describe(const Fingerprint& f, const CallRecord& mine) {
    CallRecord other;
    other.seq = f[0];
    other.kind = static_cast<CollectiveKind>(f[1] & 0xff);
    other.is_split = ((f[1] >> 8) & 0xff) != 0;
    other.dtype = static_cast<DType>((f[1] >> 16) & 0xff);
    other.op = static_cast<ReduceOp>((f[1] >> 24) & 0xff);
    other.reduces = mine.reduces && other.kind == mine.kind;
    other.count = f[2];
    other.root = static_cast<std::int64_t>(f[3]);
    std::string out = other.describe();
    if (f[4] != mine.counts_hash && other.kind == mine.kind) out += " with other per-owner counts";
    if (f[5] != fnv1a(mine.label)) out += " under another label";
    return out;
  }
};

// The order check's verdict over every rank's fingerprint of one call (`all`: rank r's words at
// r x kFingerprintWords): the first rank whose call differs from `mine`, or -1.
inline int first_mismatch(std::span<const std::uint64_t> all, const CallRecord::Fingerprint& mine) {
  const std::size_t ranks = all.size() / mine.size();
  for (std::size_t r = 0; r < ranks; ++r)
    if (!std::equal(mine.begin(), mine.end(), all.begin() + r * mine.size()))
      return static_cast<int>(r);
  return -1;
}

// The refusal's text: `where` is the call's prefix ("all_reduce on rank 0 of 4 (mpi)"), `rank`
// the first rank that differs, `all` every rank's fingerprint as first_mismatch reads them.
inline std::string mismatch_message(std::string_view where, const CallRecord& call, int rank,
                                    std::span<const std::uint64_t> all, std::string_view recent) {
  CallRecord::Fingerprint theirs;
  std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(rank) * CallRecord::kFingerprintWords,
              theirs.size(), theirs.begin());
  return shardkit::detail::concat(
      where, ": rank ", rank, "'s collective #", call.seq, " is ",
      CallRecord::describe(theirs, call), " but this rank's is ", call.describe(),
      "; every rank must issue the same collectives in the same order (a parameter used on some "
      "ranks only? a different number of micro-batches? a branch taken on one rank?); ",
      recent);
}

// The hash of an uneven collective's per-owner counts.
inline std::uint64_t counts_hash(std::span<const std::size_t> counts) {
  std::uint64_t hash = 1469598103934665603ull;
  for (std::size_t c : counts)
    for (int b = 0; b < 8; ++b) hash = (hash ^ ((c >> (8 * b)) & 0xff)) * 1099511628211ull;
  return hash;
}

// The last calls of one communicator (a ring of kCapacity), for timeouts' messages.
class FlightRecorder {
 public:
  static constexpr std::size_t kCapacity = 16;

  void add(const CallRecord& call) {
    std::lock_guard lock(mutex_);
    if (calls_.size() < kCapacity)
      calls_.push_back(call);
    else
      calls_[call.seq % kCapacity] = call;
  }

  // Call `seq` described, while it is among the kept ones ("call #seq" after that).
  std::string describe(std::uint64_t seq) const {
    std::lock_guard lock(mutex_);
    for (const auto& c : calls_)
      if (c.seq == seq) return c.describe();
    return shardkit::detail::concat("call #", seq);
  }

  // "this rank's last calls: all_reduce #10 of ..., all_gather #11 of ... (oldest first)"
  std::string recent() const {
    std::lock_guard lock(mutex_);
    if (calls_.empty()) return "no call before this one";
    std::vector<const CallRecord*> ordered;
    for (const auto& c : calls_) ordered.push_back(&c);
    std::sort(ordered.begin(), ordered.end(),
              [](const CallRecord* a, const CallRecord* b) { return a->seq < b->seq; });
    std::string out = "this rank's last calls, oldest first: ";
    for (std::size_t i = 0; i < ordered.size(); ++i)
      out += (i ? "; " : "") + ordered[i]->describe();
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<CallRecord> calls_;
};

// Every communicator's recorder in this process, by who it is ("rank 2 of 4"), for a dump on
// demand (recorder_dump.hpp). Entries are weak: a communicator that is gone drops out.
class RecorderRegistry {
 public:
  static RecorderRegistry& instance() {
    static RecorderRegistry registry;
    return registry;
  }

  void add(std::weak_ptr<const FlightRecorder> recorder, std::string who) {
    std::lock_guard lock(mutex_);
    std::erase_if(entries_, [](const Entry& e) { return e.recorder.expired(); });
    entries_.push_back({std::move(recorder), std::move(who)});
  }

  // One line per live communicator: who it is and its last calls.
  std::string dump() const {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& entry : entries_)
      if (const auto recorder = entry.recorder.lock())
        out += "  communicator (" + entry.who + "): " + recorder->recent() + "\n";
    return out.empty() ? "  no live communicator\n" : out;
  }

 private:
  struct Entry {
    std::weak_ptr<const FlightRecorder> recorder;
    std::string who;
  };
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
};

}  // namespace shardkit::comm
