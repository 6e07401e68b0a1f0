// The collective-order check over NCCL (CommOptions::validate_order), without a host wait.
//
// MPI's check all-gathers each call's fingerprint and waits for it before issuing the call (an
// MPI call waits on the host anyway). Over NCCL that wait would stall the host on the GPU at
// every collective, so here the exchange is queued on the stream instead, ahead of the call it
// describes: the fingerprint is copied up from pinned memory, all-gathered by NCCL (48 bytes a
// rank) and copied back into pinned memory, with an event after it. The host compares finished
// exchanges later, oldest first, without waiting: before it issues its next collective, after a
// Work's wait, and when a wait times out. A mismatch aborts the communicator (the calls after
// it may already be queued on the GPU, and NCCL cannot take them back) and throws
// InvalidArgument naming both ranks' calls, as MPI's check does -- so a rank that issues an
// extra all-gather, another size or dtype, or skips a unit gets that error at its next
// collective or wait, and at the latest when its wait times out, instead of a bare timeout or a
// result computed from mismatched buffers.
//
// The exchanges pair up even when the calls do not: every call is preceded by one exchange of
// the same shape, so rank A's n-th exchange meets rank B's n-th, whatever the calls are. Inside
// a group scope the exchange joins the group (and is read back when the group ends); a
// mismatch there can only surface as the group's timeout. While a StepGraph captures a step
// nothing is exchanged: its eager warm-up steps issued the same calls and were checked.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <nccl.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardkit/comm/call_record.hpp"
#include "shardkit/comm/cuda_event.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/nccl_check.hpp"
#include "shardkit/core/storage.hpp"

namespace shardkit::comm::detail {

class NcclOrderCheck {
 public:
  // `where` names this rank for messages ("rank 2 of 8 (nccl)").
  NcclOrderCheck(Context& ctx, int size, std::string where,
                 std::shared_ptr<const FlightRecorder> recorder)
      : ctx_(ctx), size_(size), where_(std::move(where)), recorder_(std::move(recorder)) {}

  // Queues `call`'s exchange on the context's stream, ahead of the call itself. `issue` runs the
  // NCCL all-gather it is given (the communicator settles non-blocking calls); in a group scope
  // the read-back waits for end_group().
  template <class Issue>
  void exchange(const CallRecord& call, ncclComm_t comm, bool in_group, Issue&& issue) {
    if (ctx_.capturing()) return;
    Slot& slot = take_slot();
    slot.call = call;
    const auto mine = call.fingerprint();
    auto* host = static_cast<std::uint64_t*>(slot.host->data());
    std::copy(mine.begin(), mine.end(), host);
    auto* device = static_cast<std::uint64_t*>(slot.device->data());
    SK_CUDA_CHECK(cudaMemcpyAsync(device, host, kBytes, cudaMemcpyHostToDevice, ctx_.stream()));
    issue(ncclAllGather(device, device + kWords, kWords, ncclUint64, comm, ctx_.stream()));
    if (in_group)
      grouped_.push_back(&slot);
    else
      read_back(slot);
  }

  // The group's calls were launched: queue their exchanges' read-backs.
  void end_group() {
    for (Slot* slot : grouped_) read_back(*slot);
    grouped_.clear();
  }

  // Compares every exchange the GPU has finished, oldest first, and returns the first
  // mismatch's message (empty when every finished exchange agreed). Never waits.
  std::string harvest() {
    while (!pending_.empty() && pending_.front()->done->query()) {
      Slot& slot = *pending_.front();
      pending_.pop_front();
      free_.push_back(&slot);
      const auto* host = static_cast<const std::uint64_t*>(slot.host->data());
      const std::span<const std::uint64_t> all(host + kWords, kWords * size_);
      CallRecord::Fingerprint mine;  // as sent: the slot's first words (not hashed again)
      std::copy(host, host + kWords, mine.begin());
      const int rank = first_mismatch(all, mine);
      if (rank >= 0)
        return mismatch_message(shardkit::detail::concat(slot.call.name(), " on ", where_),
                                slot.call, rank, all, recorder_->recent());
    }
    return {};
  }

  // Exchanges queued and not compared yet (tests: a drained check holds none).
  std::size_t pending() const { return pending_.size() + grouped_.size(); }
  // Slots made so far: they are reused, so this stays at the GPU's lag behind the host.
  std::size_t slots() const { return slots_.size(); }

 private:
  static constexpr std::size_t kWords = CallRecord::kFingerprintWords;
  static constexpr std::size_t kBytes = kWords * sizeof(std::uint64_t);

  // One exchange in flight: this rank's words then every rank's, in pinned memory and on the
  // device, and the event after the read-back.
  struct Slot {
    std::shared_ptr<Storage> host;
    std::shared_ptr<Storage> device;
    std::unique_ptr<CudaEvent> done;
    CallRecord call;
  };

  Slot& take_slot() {
    if (!free_.empty()) {
      Slot* slot = free_.back();
      free_.pop_back();
      return *slot;
    }
    const std::size_t bytes = kBytes * (1 + static_cast<std::size_t>(size_));
    auto slot = std::make_unique<Slot>();
    slot->host =
        std::make_shared<Storage>(ctx_.host_allocator_ptr(), bytes, MemoryCategory::communication);
    slot->device =
        std::make_shared<Storage>(ctx_.allocator_ptr(), bytes, MemoryCategory::communication);
    slot->done = std::make_unique<CudaEvent>(ctx_.device().index);
    slots_.push_back(std::move(slot));
    return *slots_.back();
  }

  void read_back(Slot& slot) {
    auto* host = static_cast<std::uint64_t*>(slot.host->data());
    const auto* device = static_cast<const std::uint64_t*>(slot.device->data());
    SK_CUDA_CHECK(cudaMemcpyAsync(host + kWords, device + kWords, kBytes * size_,
                                  cudaMemcpyDeviceToHost, ctx_.stream()));
    slot.done->record(ctx_.stream());
    pending_.push_back(&slot);
  }

  Context& ctx_;
  int size_;
  std::string where_;
  std::shared_ptr<const FlightRecorder> recorder_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::deque<Slot*> pending_;   // read-backs queued, oldest first
  std::vector<Slot*> grouped_;  // exchanged in the open group, not read back yet
  std::vector<Slot*> free_;     // compared: ready for another exchange
};

}  // namespace shardkit::comm::detail

#endif  // SK_WITH_CUDA
