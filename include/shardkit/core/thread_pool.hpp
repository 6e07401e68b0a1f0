// ThreadPool: the CPU threads one rank's host-side work runs on (the fused optimizer steps,
// casts, norms, copies). A fixed set of workers plus the calling thread; parallel_for splits a
// range of tasks into contiguous blocks, one per thread, so which thread runs a task never
// changes a result: work that sums does it per task and combines the tasks in order.
//
// Each Context owns one (ContextOptions::threads); ranks that run as threads in one process get
// a share of the cores each (run_ranks), so N ranks do not start N x cores threads.
//
// Where the build compiles with OpenMP (builds with oneDNN, whose CPU runtime is OpenMP), the
// blocks run on the calling thread's OpenMP team instead of the pool's own workers: oneDNN's
// convolutions and these ops then share one set of threads. Two sets on the same cores fight:
// OpenMP's workers spin for a while after each oneDNN call, taking the core the pool's worker
// needs for the batch-norm that follows (a 2-thread ResNet-18 step ran ~12% slower that way).
// The blocks, and so the results, are the same either way.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/function_ref.hpp"

namespace shardkit {

// How many processes of this job run on this machine, as the launcher says (Open MPI's
// OMPI_COMM_WORLD_LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE, MPICH's MPI_LOCALNRANKS); 1 when
// none does or the value is not a positive integer (it is the launcher's, not the user's).
inline int launcher_local_processes() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') continue;
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    if (end != nullptr && *end == '\0' && value >= 1 && value <= 65536)
      return static_cast<int>(value);
  }
  return 1;
}

// The default number of CPU threads of a process's ranks: SHARDKIT_NUM_THREADS when set (a
// positive integer), else the machine's hardware threads split between the processes the
// launcher started on this machine (four mpirun processes on 8 cores get 2 each, as torchrun
// keeps its workers from oversubscribing the cores), at least 1.
inline int default_cpu_threads() {
  if (const char* text = std::getenv("SHARDKIT_NUM_THREADS"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    check(end != nullptr && *end == '\0' && value >= 1 && value <= 4096,
          "SHARDKIT_NUM_THREADS is '", text, "'; set it to a thread count from 1 to 4096");
    return static_cast<int>(value);
  }
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::max(1, hardware / launcher_local_processes());
}

class ThreadPool {
 public:
  // `threads` in all, the caller included (1: everything runs on the caller).
  explicit ThreadPool(int threads) : threads_(threads) {
    check(threads >= 1 && threads <= 4096, "a ThreadPool needs 1 to 4096 threads, got ", threads);
#if !defined(_OPENMP)
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    try {
      for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
    } catch (const std::exception& e) {
      // (A destructor is not run for a constructor that throws: the threads started would be
      // destroyed joinable, which terminates the process. std::thread may fail in
      // pthread_create, std::system_error, or allocating its state, std::bad_alloc.)
      stop_workers();
      fail<StateError>("could not start thread ", workers_.size() + 1, " of a pool of ", threads,
                       " (", e.what(), "); ask for fewer with ContextOptions::cpu_threads or ",
                       "SHARDKIT_NUM_THREADS, or raise the process limit");
    }
#endif
  }
  ~ThreadPool() { stop_workers(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }

  // Runs fn(task) for every task in [0, tasks) and returns when all are done. Thread t takes
  // the t-th contiguous block; fewer tasks than threads leave threads idle. An exception of
  // any task is rethrown here (the first by block) after every block ended. Calls made from
  // inside a task, or from a second thread while one runs, run on the calling thread alone.
  //
  // Only the loop over a block is compiled per fn: the locking, the OpenMP region and the
  // exception handling are run_blocks', compiled once. (With all of it a template, every kernel
  // was compiled twice over, once for the serial path and once for the blocks: about a third of
  // the fused-op table's machine code, for one indirect call per block saved.)
  template <class Fn>
  void parallel_for(std::int64_t tasks, Fn&& fn) {
    if (tasks <= 0) return;
    run_blocks(tasks, [&fn](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) fn(i);
    });
  }

 private:
  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  // Runs run(lo, hi) over blocks of [0, tasks): parallel_for's loop over fn's tasks.
  [[gnu::noinline]] void run_blocks(std::int64_t tasks,
                                    detail::FunctionRef<void(std::int64_t, std::int64_t)> run) {
    std::unique_lock run_lock(run_mutex_, std::try_to_lock);
    if (threads_ == 1 || tasks == 1 || inside_task() || !run_lock.owns_lock()) {
      run(0, tasks);
      return;
    }
    const int used = static_cast<int>(std::min<std::int64_t>(threads_, tasks));
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(used));
    auto block = [&](int t) {
      const std::int64_t lo = tasks * t / used, hi = tasks * (t + 1) / used;
      try {
        run(lo, hi);
      } catch (...) {
        errors[static_cast<std::size_t>(t)] = std::current_exception();
      }
    };
#if defined(_OPENMP)
    // Thread t of the team runs blocks t, t + team, ... (all of them if the runtime gave fewer
    // threads than asked for); a block never throws out of the region.
#pragma omp parallel num_threads(used)
    {
      inside_task() = true;  // nested calls from a task run serially, as with the pool's workers
      const int team = omp_get_num_threads();
      for (int t = omp_get_thread_num(); t < used; t += team) block(t);
      inside_task() = false;
    }
#else
    {
      std::lock_guard lock(mutex_);
      job_.emplace(block);  // (refers to `block`: every worker is done with it before we return)
      used_ = used;
      pending_.store(used - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    inside_task() = true;
    block(0);
    inside_task() = false;
    // The others usually finish within microseconds of the caller: spin briefly before sleeping.
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    {
      std::lock_guard lock(mutex_);
      job_.reset();
    }
#endif
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  static bool& inside_task() {
    thread_local bool inside = false;
    return inside;
  }

  // Polls `ready` for up to kSpin (a fused step issues a parallel_for every few hundred
  // microseconds; waking a sleeping thread costs tens of microseconds on a VM). Returns
  // whether it became true.
  template <class Ready>
  static bool spin_until(Ready&& ready) {
    constexpr auto kSpin = std::chrono::microseconds(100);
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int polls = 0;; ++polls) {
      if (ready()) return true;
      if ((polls & 63) == 63 && std::chrono::steady_clock::now() >= until) return false;
    }
  }

  void work(int t) {
    inside_task() = true;
    std::uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      std::optional<detail::FunctionRef<void(int)>> job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(
            lock, [&] { return stopping_ || generation_.load(std::memory_order_acquire) != seen; });
        if (stopping_) return;
        seen = generation_.load(std::memory_order_acquire);
        if (t >= used_) continue;  // this call needs fewer threads
        job = job_;
      }
      (*job)(t);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);  // so the caller cannot miss the notification
        done_.notify_one();
      }
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one parallel_for at a time
  std::mutex mutex_;      // guards job_, used_, stopping_; orders the sleeps and wake-ups
  std::condition_variable wake_, done_;
  // The call's blocks, as a reference (copying a std::function of them allocated on every call
  // and in every worker).
  std::optional<detail::FunctionRef<void(int)>> job_;
  int used_ = 0;
  std::atomic<int> pending_{0};               // workers still running this call's job
  std::atomic<std::uint64_t> generation_{0};  // bumped once per call
  bool stopping_ = false;
};

}  // namespace shardkit
