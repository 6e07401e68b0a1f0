// ReduceScatterCoalescer: many small reduce_scatter_v calls as one (FairScale's
// ReduceScatterBucketer; FSDP's bucket_cap_mb). FSDP reduces each unit's gradients separately,
// and a model of many small units would pay one collective's latency per unit; the coalescer
// holds small calls back and sends up to `capacity_bytes` of them together.
//
// submit(send, recv, counts, op) records a call (send: every rank's segment, in rank order;
// recv: this rank's result) and returns its Work. The calls are launched together when the
// held bytes reach the capacity, when one of their Works is waited for, or at flush(): the
// held sends are copied rank-major into one staging buffer (rank 0's segments of every call,
// then rank 1's, ...), one reduce_scatter_v reduces it, and each call's part of the result is
// copied into its recv. Every rank submits and waits in the same order, so every rank launches
// at the same points. test() on a held call says false (it does not launch), so a caller that
// polls leaves the batch to fill. The send and recv tensors must live until the Work completes
// (as with any collective). Results equal the separate calls bit for bit: a reduction sums the
// ranks' values element by element, whatever the layout. The launch is labelled with its calls'
// labels in order (each unit's "unit 'NAME': gradient reduction"), so the order check refuses
// ranks whose batches hold the same bytes from other units or in another order -- a unit
// reached by the loss on some ranks only -- instead of summing one unit's gradients into
// another's.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::parallel {

class ReduceScatterCoalescer {
 public:
  ReduceScatterCoalescer(Context& ctx, comm::Communicator& comm, std::size_t capacity_bytes)
      : ctx_(&ctx), comm_(&comm), capacity_bytes_(capacity_bytes) {
    check(capacity_bytes > 0, "ReduceScatterCoalescer: capacity must be > 0 bytes");
  }
  ReduceScatterCoalescer(const ReduceScatterCoalescer&) = delete;
  ReduceScatterCoalescer& operator=(const ReduceScatterCoalescer&) = delete;
  // Calls still held are dropped unlaunched: collectives are never started from a destructor
  // (the ranks would not agree on when).
  ~ReduceScatterCoalescer() = default;

  std::size_t capacity_bytes() const { return capacity_bytes_; }

  [[nodiscard]] comm::Work submit(const Tensor& send, const Tensor& recv,
                                  std::vector<std::size_t> counts, comm::ReduceOp op) {
    check(static_cast<int>(counts.size()) == comm_->size(),
          "ReduceScatterCoalescer: ", counts.size(), " counts for ", comm_->size(), " ranks");
    if (batch_ && (batch_->op != op || batch_->dtype != send.dtype())) flush();
    if (!batch_) {
      batch_ = std::make_shared<Batch>();
      batch_->ctx = ctx_;
      batch_->op = op;
      batch_->dtype = send.dtype();
    }
    batch_->calls.push_back(
        Call{send, recv, std::move(counts), std::string(comm_->current_label())});
    batch_->bytes += send.nbytes();
    auto state = std::make_shared<HeldWork>(this, batch_);
    if (batch_->bytes >= capacity_bytes_) flush();
    return comm::Work(std::move(state));
  }

  // Launches what is held (every rank at the same point).
  void flush() {
    if (!batch_) return;
    auto batch = std::move(batch_);
    batch_.reset();
    batch->launch(*comm_);
  }
  // Drops what is held, unlaunched (a backward cut short: its gradients are discarded, and
  // every rank cut short at the same point holds the same calls): their Works complete at once
  // without a result.
  void drop_held() {
    if (!batch_) return;
    batch_->calls.clear();
    batch_->launched = batch_->done = true;
    batch_.reset();
  }

 private:
  struct Call {
    Tensor send, recv;
    std::vector<std::size_t> counts;
    std::string label;  // the communicator's label when it was submitted
  };
  struct Batch {
    Context* ctx = nullptr;
    comm::ReduceOp op = comm::ReduceOp::sum;
    DType dtype = DType::f32;
    std::vector<Call> calls;
    std::size_t bytes = 0;
    bool launched = false;
    bool done = false;
    Tensor staging, result;
    comm::Work work;
    std::string label;  // the launch's: its calls' labels in order (kept while it runs)

    // Rank-major staging, one reduce_scatter_v.
    void launch(comm::Communicator& comm) {
      const auto n = static_cast<std::size_t>(comm.size());
      std::vector<std::size_t> counts(n, 0);
      for (const auto& call : calls)
        for (std::size_t r = 0; r < n; ++r) counts[r] += call.counts[r];
      std::int64_t total = 0;
      for (auto c : counts) total += static_cast<std::int64_t>(c);
      staging = empty(*ctx, {total}, dtype, MemoryCategory::communication);
      std::int64_t at = 0;
      for (std::size_t r = 0; r < n; ++r) {
        for (const auto& call : calls) {
          std::int64_t from = 0;
          for (std::size_t q = 0; q < r; ++q) from += static_cast<std::int64_t>(call.counts[q]);
          const auto count = static_cast<std::int64_t>(call.counts[r]);
          if (count > 0)
            copy(*ctx, staging.slice(0, at, at + count), call.send.slice(0, from, from + count));
          at += count;
        }
      }
      const auto own = static_cast<std::int64_t>(counts[static_cast<std::size_t>(comm.rank())]);
      result = empty(*ctx, {own}, dtype, MemoryCategory::communication);
      for (const auto& call : calls)
        if (!call.label.empty()) label += (label.empty() ? "" : "; ") + call.label;
      std::optional<comm::Communicator::Label> scope;  // (none: the caller's label stays)
      if (!label.empty()) scope.emplace(comm, label);
      comm::assign(work, comm.reduce_scatter_v(staging, result, counts, op));
      launched = true;
    }
    // After the collective: each call's part of this rank's result into its recv (the copies
    // on the stream: `on_stream` needs the collective only ordered before them, Work's
    // wait_on_stream).
    void finish(int rank, bool on_stream = false) {
      if (done) return;
      if (on_stream)
        work.wait_on_stream();
      else
        work.wait();
      std::int64_t at = 0;
      for (const auto& call : calls) {
        const auto count = static_cast<std::int64_t>(call.counts[static_cast<std::size_t>(rank)]);
        if (count > 0) copy(*ctx, call.recv.slice(0, 0, count), result.slice(0, at, at + count));
        at += count;
      }
      calls.clear();
      staging = Tensor();
      result = Tensor();
      done = true;
    }
  };

  class HeldWork final : public comm::WorkState {
   public:
    HeldWork(ReduceScatterCoalescer* owner, std::shared_ptr<Batch> batch)
        : owner_(owner), batch_(std::move(batch)) {}
    void wait() override {
      if (!batch_->launched) owner_->flush();
      batch_->finish(owner_->comm_->rank());
    }
    void wait_on_stream() override {
      if (!batch_->launched) owner_->flush();
      batch_->finish(owner_->comm_->rank(), true);
    }
    bool test() override {
      if (!batch_->launched) return false;
      if (!batch_->done && !batch_->work.test()) return false;
      // Complete: finishing needs no wait, and none is counted (HostWaits).
      batch_->finish(owner_->comm_->rank(), true);
      return true;
    }
    // Dropped without a wait: a launched batch is completed so its buffers are free; a held
    // call stays held (its tensors live in the batch) and goes out with the next flush.
    void on_drop() noexcept override {
      if (!batch_->launched) return;
      try {
        batch_->finish(owner_->comm_->rank());
      } catch (...) {  // the collective failed; its error went to whoever waited first
      }
    }

   private:
    ReduceScatterCoalescer* owner_;
    std::shared_ptr<Batch> batch_;
  };

  Context* ctx_;
  comm::Communicator* comm_;
  std::size_t capacity_bytes_;
  std::shared_ptr<Batch> batch_;  // the calls held back
};

}  // namespace shardkit::parallel
