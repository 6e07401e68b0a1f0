// Shared benchmark helpers: the host copy ceiling measured in the same run, and the GBps /
// pct_of_copy counters every benchmark reports.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <vector>

namespace shardkit::bench {

// memcpy bandwidth of a `bytes`-sized copy, counting bytes read plus bytes written (2·bytes),
// median of 15 timed copies after a warm-up. Cached per size for the run.
inline double host_copy_bytes_per_second(std::size_t bytes) {
  static std::map<std::size_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  struct Free {
    void operator()(char* p) const { ::operator delete(p, std::align_val_t{64}); }
  };
  std::unique_ptr<char, Free> a(static_cast<char*>(::operator new(bytes, std::align_val_t{64})));
  std::unique_ptr<char, Free> b(static_cast<char*>(::operator new(bytes, std::align_val_t{64})));
  std::memset(a.get(), 1, bytes);
  std::memset(b.get(), 2, bytes);
  std::vector<double> seconds;
  for (int i = 0; i < 16; ++i) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(b.get(), a.get(), bytes);
    benchmark::ClobberMemory();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (i > 0) seconds.push_back(elapsed.count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return cache[bytes] = 2.0 * static_cast<double>(bytes) / seconds[seconds.size() / 2];
}

// Reports GBps = bytes the operation must move (at minimum) per second, and pct_of_copy = that
// rate over the copy ceiling measured in this run.
inline void report_bandwidth(benchmark::State& state, double bytes_per_iteration,
                             double ceiling_bytes_per_second) {
  using benchmark::Counter;
  state.counters["GBps"] = Counter(bytes_per_iteration / 1e9, Counter::kIsIterationInvariantRate);
  state.counters["pct_of_copy"] = Counter(bytes_per_iteration * 100.0 / ceiling_bytes_per_second,
                                          Counter::kIsIterationInvariantRate);
  state.counters["ceiling_GBps"] = ceiling_bytes_per_second / 1e9;
}

}  // namespace shardkit::bench
