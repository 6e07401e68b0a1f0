// The host allocator against what it replaced and against glibc, on the allocations of a real
// training step: the memory each holds beside the step's peak in use, the pages the step faults
// back in, and the step's time spent allocating and touching its memory.
//
// A multi-crop ResNet-18 step as the SwAV trainer runs it on the CPU (its trunk in oneDNN's
// channel blocks; 2 crops of 224 and 6 of 96 pixels for each of 4 images, each resolution one
// forward, the outputs joined for the loss; forward and backward) is run with a recording
// allocator for three steps, and its allocations and frees -- sizes and order, from the model's
// creation on -- are replayed through:
//   segments:   HostAllocator, the library's: blocks under 64 KiB cached by size, larger ones
//               carved out of 64 MiB segments (best fit, split, merged when freed);
//   size_lists: the same cache for every size (what HostAllocator was until 2026-12-05, and what
//               PinnedHostAllocator still is), with HostAllocator's 2 GiB bound;
//   glibc:      64-byte-aligned operator new and delete, nothing cached (the peer: what a
//               library without a cache of its own gets), with glibc's thresholds for mapping
//               blocks and trimming its heap fixed (mallopt, which stops their rise) at their
//               defaults (glibc_fixed_default: 128 KiB) and at the ceiling a process's frees can
//               raise them to (glibc_fixed_ceiling: 32 / 64 MiB).
// Each allocated block has one byte written per 4 KiB page, as the step writes its outputs: a
// page given back to the system costs a fault (and a zeroed page) when it is touched again
// (touch:1); touch:0 times the allocator's own work and the replay's bookkeeping (a hash map's
// insert per allocation, find and erase per free), which BM_bookkeeping times alone (no
// allocator at all).
// Each allocator's replay runs in a process forked for it, from the same state. The model's
// creation and the first two steps are replayed untimed; then the last step -- the same sizes
// in the same order as the one before it, which the recording checks -- is replayed again and
// again, its blocks renumbered each time: once untimed, then 40 times timed (400 for touch:0),
// the median reported. (A trace replayed from a fresh allocator would count the first touches
// of a segment's pages, which a long run pays once.)
//
// Counters: in_use_MB (the trace's peak in use: the floor for what any allocator holds),
// held_MB (the most the replay added to the process's resident set: the blocks in use, what the
// allocator keeps, and what glibc keeps beneath it), held_x (held over in use),
// faults_per_step (minor page faults per steady step), events_per_step, real_step_ms (the step
// itself in this run, arithmetic included, on every hardware thread: the median of 5 steps with
// the context's own allocator, not the recording one) and pct_of_step
// (the replay's time over it: what the allocator's choices cost the step). The benchmark's time
// is the replayed step's: the allocator's work and the touches, no arithmetic.
// benchmarks/core/meson.build builds it; docs/performance.md has its figures.
#include "bench_common.hpp"

#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include <shardkit/shardkit.hpp>

#include "autograd/autograd_workloads.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;

namespace {

constexpr std::size_t kPage = 4096;
constexpr int kSteps = 3;  // recorded: the first allocates the gradients

// One allocation or free of the trace; `block` numbers the allocations in order.
struct Event {
  bool allocate;
  std::size_t block;
  std::size_t bytes;
};
struct Trace {
  std::vector<Event> events;
  std::vector<std::size_t> step_begins;  // each step's first event, then the last one's end
  std::size_t blocks = 0;
  std::size_t peak_in_use = 0;
  // The last step's allocations: its n-th repetition numbers its blocks `period` x n higher.
  std::size_t period = 0;
  double step_seconds = 0;  // the step itself, arithmetic included (median, plain allocator)
};

// Records every allocation of a context, served by the library's HostAllocator (so the recorded
// step runs at the library's own pace).
class RecordingAllocator final : public sk::Allocator {
 public:
  explicit RecordingAllocator(Trace& trace) : trace_(trace) {}
  sk::Device device() const override { return sk::Device::cpu(); }

 protected:
  void* do_allocate(std::size_t bytes) override {
    void* pointer = host_.allocate(bytes, sk::MemoryCategory::other);
    std::lock_guard lock(mutex_);
    live_[pointer] = trace_.blocks;
    trace_.events.push_back({true, trace_.blocks++, bytes});
    return pointer;
  }
  void do_deallocate(void* pointer, std::size_t bytes) noexcept override {
    {
      std::lock_guard lock(mutex_);
      const auto found = live_.find(pointer);
      trace_.events.push_back({false, found->second, bytes});
      live_.erase(found);
    }
    host_.deallocate(pointer, bytes, sk::MemoryCategory::other);
  }

 private:
  sk::HostAllocator host_;
  Trace& trace_;
  std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;
};

// `steps` of the multi-crop ResNet-18 step on `ctx` (model built first); `at_step(i)` runs
// before step i, and `at_step(steps)` after the last, before the model is freed. Returns each
// step's seconds.
template <class AtStep>
std::vector<double> run_steps(sk::Context& ctx, int steps, AtStep&& at_step) {
  nn::ResNetOptions o;
  o.num_classes = 128;  // SwAV's projection width
  o.channel_blocks = true;
  std::shared_ptr<nn::ResNet> net = nn::resnet18(ctx, o);
  namespace wl = shardkit::bench::autograd_workloads;
  constexpr std::int64_t kImages = 4;
  const ag::Variable large = wl::random_variable(ctx, {2 * kImages, 3, 224, 224}, false);
  const ag::Variable small = wl::random_variable(ctx, {6 * kImages, 3, 96, 96}, false);
  const sk::Tensor labels = sk::zeros(ctx, {8 * kImages}, sk::DType::i64);
  std::vector<double> seconds;
  for (int step = 0; step < steps; ++step) {
    at_step(step);
    const auto start = std::chrono::steady_clock::now();
    net->zero_grad();
    const ag::Variable out = ag::cat(ctx, {(*net)(ctx, large), (*net)(ctx, small)});
    ag::backward(ctx, ag::cross_entropy(ctx, out, labels));
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  at_step(steps);
  return seconds;
}

// The step's allocations, recorded once per process (a few seconds on two cores).
const Trace& step_trace() {
  static const Trace trace = [] {
    Trace t;
    auto recorder = std::make_shared<RecordingAllocator>(t);
    {
      sk::Context ctx(sk::ContextOptions{.seed = 1, .allocator = recorder});
      // (step_begins' last entry: the end of the last step)
      (void)run_steps(ctx, kSteps, [&](int) { t.step_begins.push_back(t.events.size()); });
    }  // (the context's frees close the trace)
    {
      // The step's own time, with the context's usual allocator (the recording one's lock and
      // map would inflate it): the median of 5 steps after 2 that allocate the gradients and
      // fill the caches.
      sk::Context ctx(sk::ContextOptions{.seed = 1});
      auto seconds = run_steps(ctx, 7, [](int) {});
      seconds.erase(seconds.begin(), seconds.begin() + 2);
      std::nth_element(seconds.begin(), seconds.begin() + 2, seconds.end());
      t.step_seconds = seconds[2];
    }
    std::size_t in_use = 0;
    for (const Event& e : t.events) {
      in_use = e.allocate ? in_use + e.bytes : in_use - e.bytes;
      t.peak_in_use = std::max(t.peak_in_use, in_use);
    }
    // The last step must repeat the one before it, its blocks numbered `period` higher, for
    // its replay to be a step of a longer run.
    const std::size_t last = t.step_begins[kSteps - 1], before = t.step_begins[kSteps - 2];
    t.period = static_cast<std::size_t>(
        std::count_if(t.events.begin() + static_cast<std::ptrdiff_t>(before),
                      t.events.begin() + static_cast<std::ptrdiff_t>(last),
                      [](const Event& e) { return e.allocate; }));
    bool periodic = last - before == t.step_begins[kSteps] - last;
    for (std::size_t i = 0; periodic && i < last - before; ++i) {
      const Event &a = t.events[before + i], &b = t.events[last + i];
      periodic = a.allocate == b.allocate && a.bytes == b.bytes && a.block + t.period == b.block;
    }
    if (!periodic) {
      std::fprintf(stderr, "bench_host_allocator: the recorded steps differ; nothing to replay\n");
      std::exit(1);
    }
    return t;
  }();
  return trace;
}

// The size lists for every size: CachingHostAllocator without segments.
class SizeListsAllocator final : public sk::CachingHostAllocator {
 public:
  SizeListsAllocator() : CachingHostAllocator(1, std::size_t{2} << 30) {}
  ~SizeListsAllocator() override { release_cached(); }

 protected:
  void* raw_allocate(std::size_t bytes) noexcept override {
    return ::operator new (bytes, std::align_val_t{64}, std::nothrow);
  }
  void raw_free(void* pointer) noexcept override {
    ::operator delete (pointer, std::align_val_t{64});
  }
};

// No memory at all, every block the same byte (never touched: touch:0 only): the replay's own
// cost.
class NullAllocator final : public sk::Allocator {
 public:
  sk::Device device() const override { return sk::Device::cpu(); }

 protected:
  void* do_allocate(std::size_t) override { return &nothing_; }
  void do_deallocate(void*, std::size_t) noexcept override {}

 private:
  alignas(64) char nothing_ = 0;
};

// glibc's own: nothing kept beside what malloc keeps. glibc maps a block of `mmap_from` bytes
// or more on its own and unmaps it when freed, and gives the top of its heap back past
// `trim_from` free bytes. By default both start at 128 KiB and rise as the process frees mapped
// blocks (to at most 32 and 64 MiB): glibc's behaviour depends on what the process did before,
// so the replay fixes them (mallopt, which also stops their rise), at their defaults and at
// that ceiling. A process's own settle in between, at about its largest block freed.
template <std::size_t mmap_from, std::size_t trim_from>
class GlibcAllocator final : public sk::Allocator {
 public:
  GlibcAllocator() {  // (in the replay's process)
    if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_from)) != 1 ||
        mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_from)) != 1) {
      std::fprintf(stderr, "bench_host_allocator: glibc refused the thresholds\n");
      _exit(1);
    }
  }
  sk::Device device() const override { return sk::Device::cpu(); }

 protected:
  void* do_allocate(std::size_t bytes) override {
    return ::operator new (bytes, std::align_val_t{64}, std::nothrow);
  }
  void do_deallocate(void* pointer, std::size_t) noexcept override {
    ::operator delete (pointer, std::align_val_t{64});
  }
};
using GlibcFixedDefault = GlibcAllocator<std::size_t{128} << 10, std::size_t{128} << 10>;
using GlibcFixedCeiling = GlibcAllocator<std::size_t{32} << 20, std::size_t{64} << 20>;

// The resident set of the process that made it, from /proc/self/statm (kept open: read after
// every allocation).
class ResidentSet {
 public:
  ResidentSet() : fd_(open("/proc/self/statm", O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) std::abort();
  }
  ResidentSet(const ResidentSet&) = delete;
  ResidentSet& operator=(const ResidentSet&) = delete;
  ~ResidentSet() { close(fd_); }
  std::size_t bytes() const {
    char text[128] = {};
    unsigned long size = 0, resident = 0;
    if (pread(fd_, text, sizeof text - 1, 0) <= 0 ||
        std::sscanf(text, "%lu %lu", &size, &resident) != 2)
      std::abort();
    return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  }

 private:
  int fd_;
};
long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// The replay's live blocks: (renumbered) block -> its memory and size.
using Blocks = std::unordered_map<std::size_t, std::pair<char*, std::size_t>>;

// Replays events [begin, end) of the trace, their blocks numbered `shift` higher (a repetition
// of the last step); `resident`, where given, is sampled after each allocation into `held_peak`.
void replay(const Trace& trace, std::size_t begin, std::size_t end, std::size_t shift,
            sk::Allocator& allocator, Blocks& blocks, bool touch, const ResidentSet* resident,
            std::size_t& held_peak) {
  for (std::size_t i = begin; i < end; ++i) {
    const Event& e = trace.events[i];
    if (!e.allocate) {
      const auto found = blocks.find(e.block + shift);
      if (found == blocks.end()) {
        std::fprintf(stderr, "bench_host_allocator: the trace frees block %zu, not live here\n",
                     e.block + shift);
        _exit(1);  // (in the replay's process: the parent's buffered output is not its to flush)
      }
      allocator.deallocate(found->second.first, e.bytes, sk::MemoryCategory::other);
      blocks.erase(found);
      continue;
    }
    char* block = static_cast<char*>(allocator.allocate(e.bytes, sk::MemoryCategory::other));
    if (touch)
      for (std::size_t b = 0; b < e.bytes; b += kPage) block[b] = 1;  // as the step writes it
    benchmark::DoNotOptimize(block);
    blocks.emplace(e.block + shift, std::pair{block, e.bytes});
    if (resident != nullptr) held_peak = std::max(held_peak, resident->bytes());
  }
}

// What a replay measured, handed from its process to the benchmark's.
struct Measured {
  double seconds_per_step = 0;  // the median of the timed steps
  double held = 0;              // bytes added to the resident set, at most
  double faults_per_step = 0;
};

// The model's creation and the first steps, then the last step `steps` + 2 times: the first
// repetition untimed, then `steps` timed one by one, then one more with the resident set
// sampled (the steady state's holdings).
template <class Made>
Measured replay_steps(const Trace& trace, bool touch, int steps) {
  const std::size_t last_begin = trace.step_begins[kSteps - 1];
  const std::size_t last_end = trace.step_begins[kSteps];
  Blocks blocks;
  blocks.reserve(trace.blocks);
  malloc_trim(0);  // (what glibc can give back of the recording's memory)
  const ResidentSet resident;
  const std::size_t held_before = resident.bytes();
  std::size_t held_peak = held_before;
  Made allocator;
  replay(trace, 0, last_end, 0, allocator, blocks, touch, &resident, held_peak);
  std::size_t shift = trace.period;
  replay(trace, last_begin, last_end, shift, allocator, blocks, touch, &resident, held_peak);
  std::vector<double> seconds;
  seconds.reserve(static_cast<std::size_t>(steps));
  const long faults_before = minor_faults();
  for (int i = 0; i < steps; ++i) {
    shift += trace.period;
    const auto start = std::chrono::steady_clock::now();
    replay(trace, last_begin, last_end, shift, allocator, blocks, touch, nullptr, held_peak);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const long faults = minor_faults() - faults_before;
  shift += trace.period;
  replay(trace, last_begin, last_end, shift, allocator, blocks, touch, &resident, held_peak);
  for (const auto& [id, block] : blocks)
    allocator.deallocate(block.first, block.second, sk::MemoryCategory::other);
  std::nth_element(seconds.begin(), seconds.begin() + steps / 2, seconds.end());
  return {seconds[static_cast<std::size_t>(steps / 2)],
          static_cast<double>(held_peak - held_before),
          static_cast<double>(faults) / static_cast<double>(steps)};
}

// replay_steps in a child process forked for it: each allocator starts from the same process
// state. (glibc's malloc adapts its thresholds to what the process has freed before -- in one
// process the benchmark run before would decide how often glibc faults.)
template <class Made>
Measured replay_in_child(const Trace& trace, bool touch, int steps) {
  int pipe_ends[2];
  if (pipe(pipe_ends) != 0) std::abort();
  const pid_t child = fork();
  if (child < 0) std::abort();
  if (child == 0) {
    close(pipe_ends[0]);
    const Measured measured = replay_steps<Made>(trace, touch, steps);
    const bool sent = write(pipe_ends[1], &measured, sizeof measured) == sizeof measured;
    _exit(sent ? 0 : 1);
  }
  close(pipe_ends[1]);
  Measured measured;
  const bool received = read(pipe_ends[0], &measured, sizeof measured) == sizeof measured;
  close(pipe_ends[0]);
  int status = 0;
  waitpid(child, &status, 0);
  if (!received || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_host_allocator: the replay's process failed\n");
    std::exit(1);
  }
  return measured;
}

template <class Made>
void BM_replay(benchmark::State& state) {
  const Trace& trace = step_trace();
  const bool touch = state.range(0) != 0;
  Measured measured;
  for (auto _ : state) {
    measured = replay_in_child<Made>(trace, touch, touch ? 40 : 400);
    state.SetIterationTime(measured.seconds_per_step);
  }
  if (touch) {  // (untouched pages are not resident: nothing to count without the touches)
    const double in_use = static_cast<double>(trace.peak_in_use);
    state.counters["in_use_MB"] = in_use / 1e6;
    state.counters["held_MB"] = measured.held / 1e6;
    state.counters["held_x"] = measured.held / in_use;
    state.counters["faults_per_step"] = measured.faults_per_step;
  }
  std::size_t pages = 0;  // what the step's touches write: a page of each 4 KiB of its blocks
  for (std::size_t i = trace.step_begins[kSteps - 1]; i < trace.step_begins[kSteps]; ++i)
    if (trace.events[i].allocate) pages += (trace.events[i].bytes + kPage - 1) / kPage;
  if (touch) state.counters["pages_per_step"] = static_cast<double>(pages);
  state.counters["events_per_step"] =
      static_cast<double>(trace.step_begins[kSteps] - trace.step_begins[kSteps - 1]);
  // The replay's time against the real step's, recorded in this run (every hardware thread).
  state.counters["real_step_ms"] = trace.step_seconds * 1e3;
  state.counters["pct_of_step"] = measured.seconds_per_step * 100.0 / trace.step_seconds;
}

void BM_segments(benchmark::State& state) { BM_replay<sk::HostAllocator>(state); }
void BM_size_lists(benchmark::State& state) { BM_replay<SizeListsAllocator>(state); }
void BM_glibc_fixed_default(benchmark::State& state) { BM_replay<GlibcFixedDefault>(state); }
void BM_glibc_fixed_ceiling(benchmark::State& state) { BM_replay<GlibcFixedCeiling>(state); }
void BM_bookkeeping(benchmark::State& state) { BM_replay<NullAllocator>(state); }

}  // namespace

// touch:1 writes a byte per page of each block (the step as it is); touch:0 leaves the pages
// alone: the allocator's own work and the replay's bookkeeping, which BM_bookkeeping times alone.
void each_allocator(benchmark::internal::Benchmark* b) {
  b->ArgName("touch")->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
}
BENCHMARK(BM_segments)->Apply(each_allocator)->Arg(1)->Arg(0);
BENCHMARK(BM_size_lists)->Apply(each_allocator)->Arg(1)->Arg(0);
BENCHMARK(BM_glibc_fixed_default)->Apply(each_allocator)->Arg(1)->Arg(0);
BENCHMARK(BM_glibc_fixed_ceiling)->Apply(each_allocator)->Arg(1)->Arg(0);
BENCHMARK(BM_bookkeeping)->Apply(each_allocator)->Arg(0);
BENCHMARK_MAIN();
