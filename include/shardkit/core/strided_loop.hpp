// Row-major iteration over one or two strided tensors on the host, on one thread or, for
// element-wise loops, on a rank's CPU threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/core/tensor.hpp"
#include "shardkit/core/thread_pool.hpp"

namespace shardkit::detail {

// Calls fn(index, offset_a, offset_b) for elements [first, last) in row-major order: `index`
// is the element's linear position, the offsets are in elements relative to each tensor's
// first element. The innermost dimension runs as a plain loop so the compiler can vectorise it.
template <class Fn>
void for_each_element_in_range(const Shape& shape, const Shape& strides_a, const Shape& strides_b,
                               std::int64_t first, std::int64_t last, Fn& fn) {
  const std::size_t rank = shape.size();
  const std::int64_t inner = shape[rank - 1];
  const std::int64_t inner_a = strides_a[rank - 1], inner_b = strides_b[rank - 1];
  // The odometer over the outer dimensions, started at first's row.
  std::vector<std::int64_t> position(rank, 0);
  std::int64_t base_a = 0, base_b = 0;
  std::int64_t rest = first / inner;
  for (std::size_t d = rank - 1; d-- > 0;) {
    position[d] = rest % shape[d];
    rest /= shape[d];
    base_a += position[d] * strides_a[d];
    base_b += position[d] * strides_b[d];
  }
  for (std::int64_t index = first - first % inner; index < last; index += inner) {
    const std::int64_t from = std::max(first - index, std::int64_t{0});
    const std::int64_t to = std::min(last - index, inner);
    for (std::int64_t i = from; i < to; ++i)
      fn(index + i, base_a + i * inner_a, base_b + i * inner_b);
    for (std::size_t d = rank - 1; d-- > 0;) {
      base_a += strides_a[d];
      base_b += strides_b[d];
      if (++position[d] < shape[d]) break;
      base_a -= strides_a[d] * shape[d];
      base_b -= strides_b[d] * shape[d];
      position[d] = 0;
    }
  }
}

// for_each_element_in_range over the whole shape, on the calling thread.
template <class Fn>
void for_each_element(const Shape& shape, const Shape& strides_a, const Shape& strides_b, Fn&& fn) {
  const std::int64_t total = shape_numel(shape);
  if (total == 0) return;
  if (shape.empty()) {
    fn(std::int64_t{0}, std::int64_t{0}, std::int64_t{0});
    return;
  }
  for_each_element_in_range(shape, strides_a, strides_b, 0, total, fn);
}

// Elements per task of parallel_for_each_element: below two tasks' worth a loop stays on the
// calling thread (waking the pool costs microseconds; 64 Ki elements take tens).
inline constexpr std::int64_t kElementsPerTask = std::int64_t{1} << 16;

// for_each_element with the elements cut into tasks of kElementsPerTask run on `pool`. Only
// for loops whose fn writes nothing but the element it is given, from values no other
// element's call writes: then each element gets the value it gets on one thread.
template <class Fn>
void parallel_for_each_element(ThreadPool& pool, const Shape& shape, const Shape& strides_a,
                               const Shape& strides_b, Fn&& fn) {
  const std::int64_t total = shape_numel(shape);
  if (pool.size() == 1 || total < 2 * kElementsPerTask || shape.empty())
    return for_each_element(shape, strides_a, strides_b, fn);
  pool.parallel_for((total + kElementsPerTask - 1) / kElementsPerTask, [&](std::int64_t task) {
    const std::int64_t first = task * kElementsPerTask;
    for_each_element_in_range(shape, strides_a, strides_b, first,
                              std::min(total, first + kElementsPerTask), fn);
  });
}

}  // namespace shardkit::detail
