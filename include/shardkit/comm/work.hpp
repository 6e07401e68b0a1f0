// Work: the handle an asynchronous collective returns. wait() blocks until the call is complete
// from the host's point of view (its buffers may be read or reused); test() asks without
// blocking. Device collectives are also stream-ordered: later work on the rank's stream sees
// the result without any wait(), and wait_on_stream() says so -- what a training step uses, so
// that its host runs ahead of the GPU.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <utility>

#include "shardkit/core/context.hpp"

namespace shardkit::comm {

// What a backend puts behind a Work.
class WorkState {
 public:
  virtual ~WorkState() = default;
  virtual void wait() = 0;  // throws the call's error (TimeoutError, InvalidArgument...)
  virtual bool test() = 0;  // true once complete; throws like wait() when it failed
  // Work::wait_on_stream: nothing for a device collective already ordered on the rank's stream
  // (later work there sees its result, and its buffers' reuse there comes after it); else the
  // host waits.
  virtual void wait_on_stream() { wait(); }
  // The last Work handle went away before wait() returned true: the backend makes sure its
  // buffers are no longer touched afterwards (finish the call, or cancel it if it never
  // started). Must not throw.
  virtual void on_drop() noexcept {}
};

// Move-only: exactly one owner decides when the buffers are free again.
class [[nodiscard]] Work {
 public:
  Work() = default;  // an already complete call
  explicit Work(std::shared_ptr<WorkState> state) : state_(std::move(state)) {}
  // A communicator's call on the rank of `waits_counted_on`: wait() counts in that context's
  // HostWaits::collective_waits (a Work that wraps others, as then() does, counts nothing
  // itself: the call's own handle does).
  Work(std::shared_ptr<WorkState> state, const Context& waits_counted_on)
      : state_(std::move(state)), counted_on_(&waits_counted_on) {}
  Work(Work&& other) noexcept
      : state_(std::move(other.state_)), counted_on_(other.counted_on_), waited_(other.waited_) {}
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      release();
      state_ = std::move(other.state_);
      counted_on_ = other.counted_on_;
      waited_ = other.waited_;
    }
    return *this;
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work() { release(); }

  void wait() {
    if (!state_) return;
    // Counted when asked, complete or not (a test() may have found it done): the host code
    // that calls wait() would block a GPU's host whenever the device is behind.
    if (counted_on_ != nullptr) counted_on_->count_collective_wait();
    if (waited_) return;
    state_->wait();
    waited_ = true;
  }
  bool test() {
    if (!state_ || waited_) return true;
    // Inside a CUDA capture nothing queued has run, and CUDA refuses to query an event recorded
    // in a capturing stream (the local backend's world of one, NCCL): not complete, unasked.
    if (counted_on_ != nullptr && counted_on_->capturing() && counted_on_->device().is_cuda())
      return false;
    waited_ = state_->test();
    return waited_;
  }
  // What a consumer on the rank's stream needs (PyTorch's Work.wait() for NCCL): a device
  // collective is already ordered there, so this returns at once and the host runs ahead; a
  // call over host memory (the local and MPI backends' CPU path) is waited for, as by wait().
  // Not counted in HostWaits: it makes no GPU's host wait. A host that reads the result goes
  // through to_vector, which synchronises (and counts) by itself. A failure of a device call
  // shows at the next wait() or in the backend's watchdog, not here.
  void wait_on_stream() {
    if (!state_ || waited_) return;
    state_->wait_on_stream();
    waited_ = true;
  }

 private:
  void release() noexcept {
    if (state_ && !waited_) state_->on_drop();
    state_.reset();
  }

  std::shared_ptr<WorkState> state_;
  const Context* counted_on_ = nullptr;
  bool waited_ = false;
};

// slot = std::move(work), for handles kept in members. (Work is [[nodiscard]], and nvcc flags
// the discarded result of its move-assignment.)
inline void assign(Work& slot, Work&& work) {
  Work& assigned = (slot = std::move(work));
  (void)assigned;
}

namespace detail {

// A call followed by host-side work that needs its result (then()).
class ContinuedWork final : public WorkState {
 public:
  ContinuedWork(Work call, std::function<void()> after)
      : call_(std::move(call)), after_(std::move(after)) {}
  void wait() override {
    call_.wait();
    run_after();
  }
  void wait_on_stream() override {
    call_.wait_on_stream();
    run_after();
  }
  bool test() override {
    if (!call_.test()) return false;
    run_after();
    return true;
  }
  // Dropped unwaited: the call is finished or cancelled by its own handle; what would have
  // followed it is not wanted any more.
  void on_drop() noexcept override { assign(call_, Work()); }

 private:
  // Runs `after` once; a failure of it is the Work's outcome, thrown again by a later wait() or
  // test() (a retried wait that returned would pass off a half-finished result as done).
  void run_after() {
    if (failure_) std::rethrow_exception(failure_);
    if (!after_) return;
    auto after = std::move(after_);
    after_ = nullptr;
    try {
      after();
    } catch (...) {
      failure_ = std::current_exception();
      throw;
    }
  }

  Work call_;
  std::function<void()> after_;
  std::exception_ptr failure_;
};

}  // namespace detail

// A Work that completes `call` and then runs `after` on the waiting thread (once, on the first
// wait(), or on the test() that finds the call complete): what a collective's result still
// needs before it is usable, such as dequantising gathered bytes. On device backends `after`
// may simply be issued at once instead (stream order); this serves every backend.
inline Work then(Work call, std::function<void()> after) {
  return Work(std::make_shared<detail::ContinuedWork>(std::move(call), std::move(after)));
}

}  // namespace shardkit::comm
