// Wall-clock helpers for the benchmark programs that print their own tables (no Google
// Benchmark): the seconds since a start, and the median of repeated rounds.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace shardkit::bench {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median of `v` (the upper one of an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace shardkit::bench
