// Shared benchmark helpers: the host copy ceiling measured next to each benchmark with the
// same thread count, a clock around the benchmark loop, and the plain counters every bandwidth
// benchmark reports (GBps, pct_of_copy, ceiling_GBps, ms_per_step: numbers, not rates, so
// Google Benchmark prints no "/s" after a percentage).
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include <shardkit/core/thread_pool.hpp>

namespace shardkit::bench {

// memcpy bandwidth on `threads` threads (each copies one contiguous part), counting bytes read
// plus bytes written (2 x bytes); median of 7 timed copies after a warm-up. Measured at every
// call, so each benchmark gets its ceiling from the machine as it is when it runs. `bytes` is
// capped at 256 MiB: far beyond any cache, and a copy no slower per byte than a larger one.
inline double host_copy_bytes_per_second(std::size_t bytes, int threads = 1) {
  bytes = std::min<std::size_t>(bytes, std::size_t{256} << 20);
  struct Free {
    void operator()(char* p) const { ::operator delete (p, std::align_val_t{64}); }
  };
  std::unique_ptr<char, Free> a(static_cast<char*>(::operator new (bytes, std::align_val_t{64})));
  std::unique_ptr<char, Free> b(static_cast<char*>(::operator new (bytes, std::align_val_t{64})));
  std::memset(a.get(), 1, bytes);
  std::memset(b.get(), 2, bytes);
  ThreadPool pool(threads);
  auto copy = [&] {
    pool.parallel_for(threads, [&](std::int64_t t) {
      const std::size_t lo =
          bytes * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
      const std::size_t hi =
          bytes * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
      std::memcpy(b.get() + lo, a.get() + lo, hi - lo);
    });
    benchmark::ClobberMemory();
  };
  std::vector<double> seconds;
  for (int i = 0; i < 8; ++i) {
    const auto start = std::chrono::steady_clock::now();
    copy();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (i > 0) seconds.push_back(elapsed.count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return 2.0 * static_cast<double>(bytes) / seconds[seconds.size() / 2];
}

// Wall-clock time of a benchmark loop: start it just before `for (auto _ : state)`.
class LoopClock {
 public:
  double seconds_per_iteration(const benchmark::State& state) const {
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_;
    return elapsed.count() /
           static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Reports GBps = the bytes the operation must move (at minimum) per second, pct_of_copy = that
// rate over the copy ceiling measured in this run, the ceiling itself, and ms_per_step.
inline void report_bandwidth(benchmark::State& state, double seconds_per_iteration,
                             double bytes_per_iteration, double ceiling_bytes_per_second) {
  const double rate = bytes_per_iteration / seconds_per_iteration;
  state.counters["GBps"] = rate / 1e9;
  state.counters["pct_of_copy"] = rate * 100.0 / ceiling_bytes_per_second;
  state.counters["ceiling_GBps"] = ceiling_bytes_per_second / 1e9;
  state.counters["ms_per_step"] = seconds_per_iteration * 1e3;
}

}  // namespace shardkit::bench
