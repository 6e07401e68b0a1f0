// Max-pool cases shared by the CPU test of the GPU kernels' per-thread functions
// (test_max_pool_windows.cpp) and test_gpu's kernels-against-CPU case (test_autograd_gpu.cpp):
// the window geometries and values with many ties, and equality as stored.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "shardkit/core/tensor.hpp"

namespace max_pool_cases {

struct Geometry {
  shardkit::Shape shape;  // [N, C, H, W]
  std::int64_t kernel, stride, padding;
};

// What either test walks: the ImageNet stem's pool, heavy overlap, disjoint windows, windows cut
// by the padding, inputs in no window and a window too large for u8 offsets.
inline const std::vector<Geometry>& geometries() {
  static const std::vector<Geometry> all = {
      {{2, 5, 11, 13}, 3, 2, 1},   // ImageNet's stem pool
      {{2, 5, 11, 13}, 3, 1, 1},   // every input in up to 9 windows
      {{2, 5, 12, 10}, 2, 2, 0},   // disjoint windows
      {{3, 4, 13, 11}, 4, 3, 2},   // windows cut by the padding on both sides
      {{2, 3, 9, 9}, 2, 3, 0},     // inputs in no window
      {{1, 3, 20, 18}, 17, 1, 8},  // 289 values a window: i32 offsets
  };
  return all;
}

// Integers in [-2, 2] (ties everywhere: which of the equal values a window takes decides where
// its gradient goes) and, where asked, a NaN in about one of 23 values.
inline std::vector<double> tied_values(std::int64_t n, std::uint32_t salt, bool nans) {
  std::vector<double> v(static_cast<std::size_t>(n));
  std::uint32_t s = 2654435761u * (salt + 1);
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = nans && (s >> 8) % 23 == 0 ? std::numeric_limits<double>::quiet_NaN()
                                   : static_cast<double>(static_cast<int>((s >> 12) % 5) - 2);
  }
  return v;
}

// Equal as stored: both NaN, or the same value with the same sign (+0 is not -0).
inline bool same_value(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

// How many of a's values b does not hold as stored (the sizes must agree).
template <class A, class B>
std::int64_t values_differing(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return -1;
  std::int64_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) count += same_value(a[i], b[i]) ? 0 : 1;
  return count;
}

}  // namespace max_pool_cases
