// LocalWorld: the state the N thread-ranks of one local communicator share. Each call gets a
// sequence number per rank; the i-th calls of all ranks meet in one LocalOp. When the last rank
// posts, the op is checked across ranks and then carried out:
// - host memory: by the world's worker thread, so a call returns at once and the rank computes
//   while the collective runs (what DDP's overlap of backward and all-reduce needs);
// - device memory: queued on the world's CUDA stream by the last rank to arrive, after every
//   rank's stream reached the call (events), and every rank's stream waits for the result. The
//   host side of a device call is a rendezvous: it returns once every rank has issued it;
// - device memory inside captured steps: checked here, carried out by each rank on its own
//   stream between waits on the device (comm/device_rendezvous.hpp).
// A rank that waits longer than the timeout for the others aborts the world (and its splits):
// every later call, on every rank, throws CommunicatorAborted instead of hanging.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/cuda_event.hpp"
#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/comm/device_rendezvous.hpp"
#include "shardkit/comm/local_device_ops.hpp"
#include "shardkit/comm/local_host_ops.hpp"
#include "shardkit/comm/local_validation.hpp"
#include "shardkit/comm/transfer_plan.hpp"

#if SK_WITH_CUDA
#include "shardkit/core/cuda_stream.hpp"
#endif

namespace shardkit::comm {

class LocalWorld;

namespace detail {

// Throws a new exception of the same kind and message as `error` (called under the world's
// mutex). Every rank waiting on a failed op gets its own exception object: libstdc++ would
// otherwise hand all of them the one object behind the exception_ptr and free it through a
// reference count inside libstdc++, which ThreadSanitizer cannot see -- it reports the last
// rank's destructor as racing with another rank's what().
[[noreturn]] inline void throw_copy_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const PeerFailed& e) {
    throw PeerFailed(e.what());
  } catch (const CommunicatorAborted& e) {
    throw CommunicatorAborted(e.what());
  } catch (const TimeoutError& e) {
    throw TimeoutError(e.what());
  } catch (const CallsDiffer& e) {
    throw CallsDiffer(e.what());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(e.what());
  } catch (const StateError& e) {
    throw StateError(e.what());
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(e.what());
  } catch (const NotAvailable& e) {
    throw NotAvailable(e.what());
  } catch (const IoError& e) {
    throw IoError(e.what());
  } catch (const CudaError& e) {
    throw CudaError(e.what(), e.code());
  } catch (const NcclError& e) {
    throw NcclError(e.what(), e.code());
  } catch (const LibraryError& e) {
    throw LibraryError(e.what(), e.code());
  } catch (const Error& e) {
    throw Error(e.what());
  } catch (const std::bad_alloc&) {
    throw std::bad_alloc();
  } catch (const std::exception& e) {
    throw Error(e.what());
  }
}

}  // namespace detail

// One call of a local world, met by every rank.
struct LocalOp {
  enum class Phase { posting, queued, done, failed };

  std::string name;  // "all_reduce #12"
  std::vector<LocalPost> posts;
  std::vector<char> arrived;
  int arrived_count = 0;
  Phase phase = Phase::posting;
  std::exception_ptr error;
  // split: each old rank's new world (null for a negative colour) and rank in it
  std::vector<std::shared_ptr<LocalWorld>> split_worlds;
  std::vector<int> split_ranks;
#if SK_WITH_CUDA
  std::vector<std::shared_ptr<CudaEvent>> ready;  // each rank's stream reached the call
  std::shared_ptr<CudaEvent> done;                // the world's stream finished it
  std::shared_ptr<DeviceRendezvous> rendezvous;   // a call inside captured steps meets there
#endif
};

class LocalWorld {
 public:
  // `kernels`: the device reduction table (CudaKernelTables::comm); only needed to
  // reduce device memory over more than one rank.
  explicit LocalWorld(int size, const DeviceCommKernels* kernels = nullptr)
      : size_(size), kernels_(kernels) {
    check(size >= 1, "a local world needs at least 1 rank, got ", size);
  }

  ~LocalWorld() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  int size() const { return size_; }
  const DeviceCommKernels* kernels() const { return kernels_; }

  std::string aborted_reason() const {
    std::lock_guard lock(mutex_);
    return aborted_;
  }

  // A post that is not one of the communicator's calls (a meeting around a graph's run).
  static constexpr std::uint64_t kNotACall = ~std::uint64_t{0};

  // Adds rank's part of the world's `sequence`-th operation: the communicator's call `number`
  // (what messages name it by, as the flight recorder does), or kNotACall. `ready` (device calls)
  // is recorded on the rank's stream.
  std::shared_ptr<LocalOp> post(int rank, std::uint64_t sequence, std::string_view call,
                                std::uint64_t number, LocalPost post,
                                [[maybe_unused]] std::shared_ptr<void> ready) {
    std::unique_lock lock(mutex_);
    if (!aborted_.empty())
      fail<CommunicatorAborted>(op_name(call, number), " on rank ", rank,
                                " (local): the world was aborted (", aborted_, ")");
    auto& slot = ops_[sequence];
    if (!slot) {
      slot = std::make_shared<LocalOp>();
      slot->name = op_name(call, number);
      slot->posts.resize(static_cast<std::size_t>(size_));
      slot->arrived.assign(static_cast<std::size_t>(size_), 0);
#if SK_WITH_CUDA
      slot->ready.resize(static_cast<std::size_t>(size_));
#endif
    }
    std::shared_ptr<LocalOp> op = slot;
    const auto index = static_cast<std::size_t>(rank);
    SK_ASSERT(!op->arrived[index]);
    op->posts[index] = std::move(post);
    op->arrived[index] = 1;
#if SK_WITH_CUDA
    op->ready[index] = std::static_pointer_cast<CudaEvent>(ready);
#endif
    if (++op->arrived_count == size_) {
      ops_.erase(sequence);
      if (op->phase == LocalOp::Phase::posting) start(op);
    }
    cv_.notify_all();
    return op;
  }

  // Until the op is complete; throws its error. The timeout covers the wait for the other ranks
  // to post; once all have, the data movement itself is always waited for.
  void wait(LocalOp& op, int rank, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (op.phase == LocalOp::Phase::done) return;
      if (op.phase == LocalOp::Phase::failed) detail::throw_copy_of(op.error);
      if (op.arrived_count == size_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, deadline) != std::cv_status::timeout || op.arrived_count == size_ ||
          op.phase != LocalOp::Phase::posting)
        continue;
      std::string missing;
      for (int r = 0; r < size_; ++r)
        if (!op.arrived[static_cast<std::size_t>(r)])
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      const std::string message =
          shardkit::detail::concat(op.name, " on rank ", rank, " (local) timed out after ",
                                   timeout.count(), " ms: rank(s) ", missing,
                                   " never called it; check that every rank issues the same "
                                   "calls, or raise CommOptions::timeout");
      auto children = abort_locked(message);
      lock.unlock();
      abort_children(children, message);
      throw TimeoutError(message);
    }
  }

  // True once complete; throws the op's error.
  bool test(const LocalOp& op) const {
    std::lock_guard lock(mutex_);
    if (op.phase == LocalOp::Phase::failed) detail::throw_copy_of(op.error);
    return op.phase == LocalOp::Phase::done;
  }

  // A rank let go of its Work: cancel the op if it has not started (so its buffers are never
  // touched), otherwise let it finish first.
  void drop(LocalOp& op, int rank) noexcept {
    std::unique_lock lock(mutex_);
    if (op.phase == LocalOp::Phase::posting) {
      op.phase = LocalOp::Phase::failed;
      // (a consequence of that rank's failure, as an abort's error is: run_ranks then reports
      // the failing rank's own error, not this one from a rank that waited)
      op.error = std::make_exception_ptr(PeerFailed(shardkit::detail::concat(
          op.name, " (local): rank ", rank,
          " dropped its Work before every rank had called it, "
          "so the call was cancelled; keep each Work until wait() returns")));
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return op.phase != LocalOp::Phase::queued; });
  }

  // Fails every pending call and every later one, here and in the worlds split from this one.
  void abort(const std::string& reason) {
    // (an empty reason would read as "not aborted": later calls would go ahead, out of step)
    const std::string why = reason.empty() ? std::string("aborted without a reason") : reason;
    std::unique_lock lock(mutex_);
    if (!aborted_.empty()) return;
    auto children = abort_locked(why);
    lock.unlock();
    abort_children(children, why);
  }

 private:
  // "all_reduce #12", or the post's name alone when it is not a call.
  static std::string op_name(std::string_view call, std::uint64_t number) {
    if (number == kNotACall) return std::string(call);
    return shardkit::detail::concat(call, " #", number);
  }

  std::vector<std::shared_ptr<LocalWorld>> abort_locked(const std::string& reason) {
    aborted_ = reason;
    for (auto& [sequence, op] : ops_) {
      if (op->phase != LocalOp::Phase::posting) continue;
      op->phase = LocalOp::Phase::failed;
      op->error = std::make_exception_ptr(CommunicatorAborted(
          shardkit::detail::concat(op->name, " (local): the world was aborted (", reason, ")")));
    }
    cv_.notify_all();
    std::vector<std::shared_ptr<LocalWorld>> children;
    for (auto& weak : children_)
      if (auto child = weak.lock()) children.push_back(std::move(child));
    return children;
  }

  static void abort_children(const std::vector<std::shared_ptr<LocalWorld>>& children,
                             const std::string& reason) {
    for (const auto& child : children) child->abort(reason);
  }

  // Every rank has posted `op`; called with the lock held.
  void start(const std::shared_ptr<LocalOp>& op) {
    try {
      validate_local_posts(op->posts, op->name);
      const LocalPost& first = op->posts[0];
      if (first.is_split) {
        split(*op);
        op->phase = LocalOp::Phase::done;
      } else if (first.kind == CollectiveKind::barrier) {
        op->phase = LocalOp::Phase::done;
      } else if (first.in_capture) {
        prepare_rendezvous(*op);
        op->phase = LocalOp::Phase::done;
      } else if (first.send.device.is_cuda()) {
        run_on_device(*op);
        op->phase = LocalOp::Phase::done;
      } else {
        // (the worker first: an op queued without one, failed here, would run when a later
        // op starts the worker -- after its ranks were told it failed and freed its buffers)
        if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
        op->phase = LocalOp::Phase::queued;
        queue_.push_back(op);
      }
    } catch (...) {
      op->phase = LocalOp::Phase::failed;
      op->error = std::current_exception();
    }
  }

  void split(LocalOp& op) {
    std::map<int, std::vector<std::pair<int, int>>> groups;  // colour -> (key, old rank)
    for (int r = 0; r < size_; ++r) {
      const LocalPost& post = op.posts[static_cast<std::size_t>(r)];
      if (post.color >= 0) groups[post.color].emplace_back(post.key, r);
    }
    op.split_worlds.assign(static_cast<std::size_t>(size_), nullptr);
    op.split_ranks.assign(static_cast<std::size_t>(size_), -1);
    for (auto& [color, members] : groups) {
      std::sort(members.begin(), members.end());
      auto world = std::make_shared<LocalWorld>(static_cast<int>(members.size()), kernels_);
      children_.push_back(world);
      for (std::size_t i = 0; i < members.size(); ++i) {
        const auto old_rank = static_cast<std::size_t>(members[i].second);
        op.split_worlds[old_rank] = world;
        op.split_ranks[old_rank] = static_cast<int>(i);
      }
    }
  }

  void run_on_device([[maybe_unused]] LocalOp& op) {
#if SK_WITH_CUDA
    const int device = op.posts[0].send.device.index;
    CudaDeviceGuard guard(device);
    if (!stream_) stream_ = std::make_unique<CudaStream>(device);
    check(stream_->device() == device, "local ", op.name,
          ": this world already moved memory of cuda:", stream_->device(),
          " and now got buffers on cuda:", device, "; a local world reduces the memory of one GPU");
    const cudaStream_t stream = stream_->get();
    for (const auto& ready : op.ready) SK_CUDA_CHECK(cudaStreamWaitEvent(stream, ready->get(), 0));
    run_plan_on_device(plan_transfers(op.posts), stream, kernels_, op.name, size_);
    op.done = std::make_shared<CudaEvent>(device);
    op.done->record(stream);
#else
    fail<NotAvailable>("local ", op.name, ": device buffers in a build without CUDA");
#endif
  }

  // A call inside captured steps: each rank carries out its own share on its own stream
  // (LocalCommunicator); here the ranks' buffers were checked and the device flags they meet
  // at are made on first use.
  void prepare_rendezvous([[maybe_unused]] LocalOp& op) {
#if SK_WITH_CUDA
    const int device = op.posts[0].send.device.index;
    const int before = rendezvous_ ? rendezvous_->device() : stream_ ? stream_->device() : device;
    check(before == device, "local ", op.name, ": this world already moved memory of cuda:", before,
          " and now got buffers on cuda:", device, "; a local world reduces the memory of one GPU");
    check<NotAvailable>(kernels_ != nullptr && kernels_->flag_barrier != nullptr, "local ", op.name,
                        ": a collective across ranks inside a captured step needs the device "
                        "rendezvous kernel; build the world with the comm table of "
                        "sk::cuda_kernel_tables() from <shardkit/cuda.hpp>");
    if (!rendezvous_) {
      CudaDeviceGuard guard(device);
      if (!stream_) stream_ = std::make_unique<CudaStream>(device);
      rendezvous_ = std::make_shared<DeviceRendezvous>(size_, device, stream_->get());
    }
    op.rendezvous = rendezvous_;
#else
    fail<NotAvailable>("local ", op.name, ": device buffers in a build without CUDA");
#endif
  }

  void worker_loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::shared_ptr<LocalOp> op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        run_plan_on_host(plan_transfers(op->posts));
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      op->phase = error ? LocalOp::Phase::failed : LocalOp::Phase::done;
      op->error = error;
      cv_.notify_all();
    }
  }

  const int size_;
  const DeviceCommKernels* const kernels_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::shared_ptr<LocalOp>> ops_;  // calls some rank has not posted yet
  std::deque<std::shared_ptr<LocalOp>> queue_;             // host calls ready to run
  std::vector<std::weak_ptr<LocalWorld>> children_;
  std::string aborted_;
  bool stopping_ = false;
  std::thread worker_;
#if SK_WITH_CUDA
  std::unique_ptr<CudaStream> stream_;
  std::shared_ptr<DeviceRendezvous> rendezvous_;  // made at the first call inside a capture
#endif
};

}  // namespace shardkit::comm
