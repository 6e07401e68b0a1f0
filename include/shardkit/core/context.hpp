// Context: everything one rank owns -- device, stream, allocators (with memory statistics),
// random stream, and handles of later layers. No global mutable state: N ranks can be N threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/cuda_allocator.hpp"
#include "shardkit/core/cuda_stream.hpp"
#include "shardkit/core/device.hpp"
#include "shardkit/core/device_kernels.hpp"
#include "shardkit/core/thread_pool.hpp"

namespace shardkit {

struct ContextOptions {
  Device device = Device::cpu();
  int rank = 0;
  std::uint64_t seed = 0;  // seed of the context's random stream
  // Device-code tables; required for a CUDA device. sk::cuda_context_options / make_cuda_context
  // from <shardkit/cuda.hpp> fill them.
  CudaKernelTables kernels{};
  // CPU threads for this rank's host-side ops (fused optimizer steps, casts, norms, copies,
  // the autograd layer's CPU ops); 0: default_cpu_threads() (SHARDKIT_NUM_THREADS, else every
  // hardware thread). Results do not depend on it, except the CPU convolutions and GEMMs when
  // oneDNN runs them (autograd/cpu_dnnl.hpp): those are deterministic per thread count, as
  // PyTorch's are.
  int cpu_threads = 0;
  // CPU contexts only: the allocator of the context's memory (default: a HostAllocator of its
  // own). make_host_context gives CPU offload's host context pinned memory this way.
  std::shared_ptr<Allocator> allocator{};
};

// How often the host waited for the device: reads of device values (to_vector), uploads of
// host values (from_vector: the copy returns once the data has arrived), stream
// synchronisations (Context::synchronize, which every copy between host and device makes on a
// GPU) and waits on collectives (comm::Work::wait on a call of this rank's communicator: the
// host blocks until the call is complete, where a device collective's consumers on the stream
// would need no wait at all). A step that is to run ahead of the GPU, or to be captured in a
// CUDA graph, makes none. Counted on every device: on a CPU context the same calls cost little,
// but counting them there lets CPU tests prove that a code path would make a GPU's host wait.
struct HostWaits {
  std::int64_t reads = 0;
  std::int64_t uploads = 0;
  std::int64_t synchronizations = 0;
  std::int64_t collective_waits = 0;
  std::int64_t total() const { return reads + uploads + synchronizations + collective_waits; }
  HostWaits operator-(const HostWaits& before) const {
    return {reads - before.reads, uploads - before.uploads,
            synchronizations - before.synchronizations, collective_waits - before.collective_waits};
  }
};

// A host value a captured step was built with (a learning rate, a step number): a CUDA graph
// replays it as captured. The record of one capture (core/step_graph.hpp) lists them in order.
struct CapturedScalar {
  std::string name;
  double value;
};

// Host work a graph's every run needs just before and just after it (Context::around_each_run).
struct AroundRun {
  std::string key;
  std::function<void()> action;
  // Told why, when the run fails on this rank between the actions (others may be waiting).
  std::function<void(const std::string&)> failed;
};

// What a step under capture does besides its device work, kept by its graph: the host values it
// was built with, the checks it deferred (defer_check), which a replay registers again, and the
// host work each of the graph's runs needs just before and just after it (around_each_run).
struct CaptureRecord {
  std::vector<CapturedScalar> scalars;
  std::vector<std::pair<std::string, std::function<void()>>> checks;
  std::vector<AroundRun> around_each_run;  // in the order of their keys
};

class Context {
 public:
  explicit Context(ContextOptions options = {})
      : device_(options.device),
        rank_(options.rank),
        seed_(options.seed),
        cpu_threads_(options.cpu_threads == 0 ? default_cpu_threads() : options.cpu_threads),
        kernels_(options.kernels) {
    check(options.cpu_threads >= 0 && options.cpu_threads <= 4096,
          "ContextOptions::cpu_threads is ", options.cpu_threads,
          "; use a thread count from 1 to 4096, or 0 for the default");
    check_device_usable(device_);
    check(
        options.allocator == nullptr || (device_.is_cpu() && options.allocator->device().is_cpu()),
        "ContextOptions::allocator is for CPU contexts with a host allocator; a ", device_,
        " context makes its own");
    host_allocator_ = options.allocator ? options.allocator : std::make_shared<HostAllocator>();
    if (device_.is_cpu()) {
      allocator_ = host_allocator_;
      return;
    }
#if SK_WITH_CUDA
    check(kernels_.tensor != nullptr,
          "a CUDA Context needs its device kernels: create it with "
          "sk::make_cuda_context(device, rank) from <shardkit/cuda.hpp> (and compile "
          "kernels/shardkit_cuda.cu into the program)");
    stream_ = std::make_shared<CudaStream>(device_.index);
    allocator_ = std::make_shared<CudaAllocator>(stream_);
    host_allocator_ = std::make_shared<PinnedHostAllocator>();
#endif
  }

  ~Context() {
    // Handles (cuBLAS, communicators...) may use the stream: release them first. In no
    // particular order (as when they were kept in a map by type): none of them uses another.
    resources_.clear();
  }

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const { return device_; }
  int rank() const { return rank_; }

  // Allocator for the context's device; its statistics are "the rank's memory".
  Allocator& allocator() const { return *allocator_; }
  const std::shared_ptr<Allocator>& allocator_ptr() const { return allocator_; }
  // Host memory (pinned on CUDA contexts) for staging; counted separately.
  Allocator& host_allocator() const { return *host_allocator_; }
  const std::shared_ptr<Allocator>& host_allocator_ptr() const { return host_allocator_; }
  MemoryStats& memory_stats() const { return allocator_->stats(); }

  const DeviceKernels& kernels() const {
    check<NotAvailable>(kernels_.tensor != nullptr, "no device kernels in this context (", device_,
                        "); create it with sk::make_cuda_context from <shardkit/cuda.hpp>");
    return *kernels_.tensor;
  }
  // The device-code tables of every layer (null entries on a CPU context).
  const CudaKernelTables& kernel_tables() const { return kernels_; }

#if SK_WITH_CUDA
  cudaStream_t stream() const { return stream_ ? stream_->get() : nullptr; }
#endif

  // Waits until all work queued on the context's stream is done (no-op on the CPU; counted on
  // every device), then runs the deferred checks (defer_check) and raises the first error one
  // of them found.
  void synchronize() const {
    refuse_in_capture("a stream synchronisation",
                      "wait after the step, or order the work on the stream instead");
    synchronizations_.fetch_add(1, std::memory_order_relaxed);
#if SK_WITH_CUDA
    if (stream_) stream_->synchronize();
#endif
    run_deferred_checks();
  }

  // Registers `check` to run at the host's next synchronize() on this context, once (a check
  // already pending under the same `key` stays as it is). For an op whose verdict on its input
  // is found by device code (a class label out of range): instead of a stream synchronisation
  // at every call, the op leaves the verdict in device memory and the check reads it when the
  // host next waits anyway (a read, a copy to or from the host) and throws there -- as CUDA
  // itself reports a kernel's faults at the next synchronising call. The stream has finished
  // by then, so the check may read device memory directly.
  void defer_check(const std::string& key, std::function<void()> check) {
    std::lock_guard lock(checks_mutex_);
    if (capture_.record != nullptr && !capture_.replaying)
      capture_.record->checks.emplace_back(key, check);
    deferred_checks_.try_emplace(key, std::move(check));
  }

  // Host work a captured step needs just before and just after each run of its graph -- a
  // CUDA graph's launches, the first one after the capture included, and a CPU replay's runs --
  // registered once per `key` while the step is captured (ignored otherwise): the ranks of a
  // local world meet there (comm/local_communicator.hpp). Actions run in the order of their
  // keys, the same on every rank whatever order each registered them in. `failed` is told why
  // when the run fails between the actions, so that ranks waiting at a later action need not
  // wait for their timeout.
  void around_each_run(const std::string& key, std::function<void()> action,
                       std::function<void(const std::string&)> failed = nullptr) {
    if (capture_.record == nullptr || capture_.replaying) return;
    auto& actions = capture_.record->around_each_run;
    const auto at =
        std::lower_bound(actions.begin(), actions.end(), key,
                         [](const AroundRun& a, const std::string& k) { return a.key < k; });
    if (at != actions.end() && at->key == key) return;
    actions.insert(at, AroundRun{key, std::move(action), std::move(failed)});
  }

  // Step capture (core/step_graph.hpp). Between begin_capture and end_capture the context's
  // work is being captured -- or, on a CPU, a captured step is being run again under the same
  // rules (`replaying`): what a CUDA graph cannot replay is refused by name (host waits, random
  // draws), host values the step is built with are recorded in `record` (capture_scalar) and,
  // on a CPU replay, compared with it. `pool` (captures only) serves the step's allocations.
  void begin_capture(std::string name, CaptureRecord& record, bool replaying,
                     const std::shared_ptr<CapturePool>& pool = nullptr) {
    check<StateError>(capture_.record == nullptr, "Context of ", device_,
                      ": a step is already under capture (", capture_.name,
                      "); captures do not nest");
    if (pool) allocator_->begin_capture(pool);
    capture_ = CaptureState{std::move(name), &record, replaying, 0, pool != nullptr};
    ++capture_serial_;
  }
  void end_capture() noexcept {
    if (capture_.pooled) allocator_->end_capture();
    capture_ = CaptureState{};
  }
  bool capturing() const { return capture_.record != nullptr; }
  // Counts the captures and CPU replays begun: what a step under capture computed on the host
  // before it began (a cached value) is told apart from what it computes itself, which a
  // replay repeats.
  std::uint64_t capture_serial() const { return capture_serial_; }
  // Whether a StepGraph runs the step (warming up, capturing or replaying): state a replay
  // could not advance on the host is kept on the device from the first warm-up step on.
  bool in_step_graph() const { return in_step_graph_ > 0; }
  void enter_step_graph() { ++in_step_graph_; }
  void leave_step_graph() noexcept { --in_step_graph_; }
  // Throws CaptureRefused naming `what` when a step is under capture (see begin_capture).
  void refuse_in_capture(std::string_view what, std::string_view fix) const {
    if (capture_.record == nullptr) return;
    fail<CaptureRefused>(what, " inside the captured step ", capture_.name,
                         ": a CUDA graph replays the step's device work, not its host side; ", fix);
  }
  // A host value `name` the step's device work is built with (a kernel's scalar argument that
  // may change between steps). Recorded when captured; on a CPU replay a value other than the
  // captured one is refused -- on a GPU the replay would silently use the captured one.
  void capture_scalar(std::string_view name, double value) {
    if (capture_.record == nullptr) return;
    auto& scalars = capture_.record->scalars;
    if (!capture_.replaying) {
      scalars.push_back({std::string(name), value});
      return;
    }
    const std::size_t at = capture_.next_scalar++;
    if (at >= scalars.size() || scalars[at].name != name)
      fail<CaptureRefused>("the captured step ", capture_.name,
                           " took a different course on this replay: its host value #", at, " is '",
                           name, "' but was '",
                           at < scalars.size() ? scalars[at].name : std::string("(none)"),
                           "' when captured; a step that branches on host state needs a key "
                           "per branch (StepGraph::run's key)");
    const double captured = scalars[at].value;
    check<CaptureRefused>(captured == value || (captured != captured && value != value),
                          "the captured step ", capture_.name, " was built with ", name, " = ",
                          captured, " but this replay has ", value,
                          ": a GPU replays the captured value; put it in the step's key "
                          "(StepGraph::run) so that a change captures anew, or keep it in a "
                          "device tensor");
  }

  // The host's waits on this context so far (see HostWaits); a step's are the difference.
  HostWaits host_waits() const {
    return {reads_.load(std::memory_order_relaxed), uploads_.load(std::memory_order_relaxed),
            synchronizations_.load(std::memory_order_relaxed),
            collective_waits_.load(std::memory_order_relaxed)};
  }
  // Called by to_vector and from_vector (core/tensor_ops.hpp), and by comm::Work::wait.
  // Each refused in a captured step (begin_capture).
  void count_host_read() const {
    refuse_in_capture("a read of device values on the host (to_vector)",
                      "read them outside the step (a logged step can run uncaptured), or keep "
                      "them on the device");
    reads_.fetch_add(1, std::memory_order_relaxed);
  }
  void count_host_upload() const {
    refuse_in_capture("an upload of host values (from_vector)",
                      "upload them once before the step is captured, or form them on the device");
    uploads_.fetch_add(1, std::memory_order_relaxed);
  }
  void count_collective_wait() const {
    refuse_in_capture("a host wait on a collective (Work::wait)",
                      "order its consumers after it on the stream (Work::wait_on_stream)");
    collective_waits_.fetch_add(1, std::memory_order_relaxed);
  }

  // The CPU threads of this rank's host-side ops (started on first use).
  int cpu_threads() const { return cpu_threads_; }
  ThreadPool& cpu_pool() {
    std::call_once(pool_once_, [&] { pool_ = std::make_unique<ThreadPool>(cpu_threads_); });
    return *pool_;
  }

  // The random stream: each fill takes the next `blocks` 128-bit Philox blocks, so successive
  // fills draw fresh numbers and a given seed replays the same sequence on any device.
  std::uint64_t seed() const { return seed_; }
  void manual_seed(std::uint64_t seed) {
    seed_ = seed;
    rng_offset_ = 0;
  }
  std::uint64_t take_random_blocks(std::uint64_t blocks) {
    refuse_in_capture("a random draw",
                      "a replay would draw the captured numbers again; draw them outside the "
                      "step (into a tensor the step reads)");
    const std::uint64_t first = rng_offset_;
    rng_offset_ += blocks;
    return first;
  }

  // While on, tensors made for parameters (sk::empty under MemoryCategory::parameters) get no
  // memory and record their initialisation instead: DeferredParameters (deferred_init.hpp)
  // turns it on for a scope.
  bool defers_parameters() const { return defer_parameters_; }
  void set_defer_parameters(bool on) { defer_parameters_ = on; }

  // One object of type T per context (cuBLAS/cuDNN handles, communicators...), made on first use
  // by `make()` -> std::shared_ptr<T>. Lets upper layers hang state here without core knowing them.
  // Every op finds its tape here, so the lookup is an index (a number per type, given on the
  // type's first use), not a map search comparing type names.
  template <class T, class Make>
  T& resource(Make&& make) {
    const std::size_t id = resource_id<T>();
    std::lock_guard lock(resources_mutex_);
    if (resources_.size() <= id) resources_.resize(id + 1);
    std::shared_ptr<void>& slot = resources_[id];
    if (!slot) slot = std::shared_ptr<void>(make());
    return *static_cast<T*>(slot.get());
  }

 private:
  Device device_;
  int rank_;
  std::uint64_t seed_;
  std::uint64_t rng_offset_ = 0;
  bool defer_parameters_ = false;
  int cpu_threads_;
  std::once_flag pool_once_;
  std::unique_ptr<ThreadPool> pool_;
  CudaKernelTables kernels_;
#if SK_WITH_CUDA
  std::shared_ptr<CudaStream> stream_;  // shared with the allocator, which frees on it
#endif
  std::shared_ptr<Allocator> host_allocator_;
  std::shared_ptr<Allocator> allocator_;
  mutable std::atomic<std::int64_t> reads_{0}, uploads_{0}, synchronizations_{0},
      collective_waits_{0};
  // The step under capture, if any (begin_capture). Written by the rank's own thread only.
  struct CaptureState {
    std::string name;
    CaptureRecord* record = nullptr;
    bool replaying = false;
    std::size_t next_scalar = 0;
    bool pooled = false;
  };
  CaptureState capture_;
  std::uint64_t capture_serial_ = 0;
  int in_step_graph_ = 0;
  // Runs and clears the pending checks; every one runs, the first error is raised.
  void run_deferred_checks() const {
    std::map<std::string, std::function<void()>> checks;
    {
      std::lock_guard lock(checks_mutex_);
      if (deferred_checks_.empty()) return;
      checks.swap(deferred_checks_);
    }
    std::exception_ptr first;
    for (auto& [key, check] : checks) {
      try {
        check();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  std::mutex resources_mutex_;
  static std::size_t next_resource_id() {
    static std::atomic<std::size_t> next{0};
    return next++;
  }
  template <class T>
  static std::size_t resource_id() {
    static const std::size_t id = next_resource_id();
    return id;
  }
  std::vector<std::shared_ptr<void>> resources_;  // by resource_id<T>()
  mutable std::mutex checks_mutex_;
  mutable std::map<std::string, std::function<void()>> deferred_checks_;
};

// A CPU context beside `device` for host-side work done on its behalf (CPU offload: the
// optimizer's state and step in host memory): the same rank, seed and CPU threads, and an
// allocator of its own, so its memory statistics are the host's share and `device`'s stay the
// device's -- page-locked memory when `device` is a GPU, so copies between the two can run
// asynchronously. On a CPU `device` the two contexts are two ledgers of the same RAM, which is
// how the CPU path shows what offload moves.
// `allocator`: its memory's own (a MappedFileAllocator: files on disk); by default as above.
inline std::unique_ptr<Context> make_host_context(const Context& device,
                                                  std::shared_ptr<Allocator> allocator = nullptr) {
  ContextOptions options;
  options.rank = device.rank();
  options.seed = device.seed();
  options.cpu_threads = device.cpu_threads();
  options.allocator = std::move(allocator);
#if SK_WITH_CUDA
  if (device.device().is_cuda() && !options.allocator)
    options.allocator = std::make_shared<PinnedHostAllocator>();
#endif
  return std::make_unique<Context>(options);
}

}  // namespace shardkit
