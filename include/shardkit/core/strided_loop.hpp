// Row-major iteration over one or two strided tensors on the host, on one thread or, for
// element-wise loops, on a rank's CPU threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
  Shape position(rank, 0);  // (inside the object: no allocation per loop)
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

// Elements per task of the element loops: below two tasks' worth a loop stays on the calling
// thread (waking the pool costs microseconds; 64 Ki elements take tens).
inline constexpr std::int64_t kElementsPerTask = std::int64_t{1} << 16;

// The one task driver of the host loops: cuts units [0, units) into chunks of `per_task` and
// calls chunk(first, end) for each on `pool` -- or once for all of them on the calling thread
// when the pool has one thread or there are fewer than two chunks' worth of units (a task too
// small to pay for waking the pool). Callers choose units whose chunks are independent
// (elements, tiles, bytes, Philox blocks).
template <class Chunk>
void for_each_chunk(ThreadPool& pool, std::int64_t units, std::int64_t per_task, Chunk&& chunk) {
  if (units <= 0) return;
  const std::int64_t tasks = (units + per_task - 1) / per_task;
  if (pool.size() == 1 || units < 2 * per_task) return chunk(std::int64_t{0}, units);
  auto task_body = [&](std::int64_t task) {
    const std::int64_t first = task * per_task;
    chunk(first, std::min(units, first + per_task));
  };
  pool.parallel_for(tasks, task_body);
}

// Side of the square tiles a transposing loop walks (32 x 32 f32: 4 KiB each way).
inline constexpr std::int64_t kTransposeTile = 32;

// When tensor b is read across tensor a's rows (a transpose: b's smallest stride is on another
// dimension than a's innermost), the dimension of b's smallest stride; -1 otherwise, or when
// either dimension is too short to tile.
inline std::int64_t transposed_dimension(const Shape& shape, const Shape& strides_b) {
  const std::size_t rank = shape.size();
  if (rank < 2) return -1;
  const std::size_t last = rank - 1;
  std::int64_t best = -1;
  for (std::size_t d = 0; d < last; ++d)
    if (shape[d] > 1 &&
        (best < 0 || std::abs(strides_b[d]) < std::abs(strides_b[static_cast<std::size_t>(best)])))
      best = static_cast<std::int64_t>(d);
  if (best < 0) return -1;
  const auto k = static_cast<std::size_t>(best);
  const bool transposed = std::abs(strides_b[k]) < std::abs(strides_b[last]);
  return transposed && shape[k] >= kTransposeTile && shape[last] >= kTransposeTile ? best : -1;
}

// Square tiles of side `tile` over dimensions `k` and the innermost, spread over `pool`: for
// each, tile_fn(index, base_a, base_b, i_begin, i_end, j_begin, j_end): the row-major index
// and the two offsets of element (i, j) = (0, 0) of the plane (over k and the innermost) the
// tile lies in, and the tile's ranges along k (i) and the innermost (j).
template <class TileFn>
void for_each_tile(ThreadPool& pool, const Shape& shape, const Shape& strides_a,
                   const Shape& strides_b, std::size_t k, std::int64_t tile, TileFn&& tile_fn) {
  const std::size_t rank = shape.size(), last = rank - 1;
  Shape index_strides(rank);  // row-major positions
  for (std::size_t d = rank, at = 1; d-- > 0;) {
    index_strides[d] = static_cast<std::int64_t>(at);
    at *= static_cast<std::size_t>(shape[d]);
  }
  SmallVector<std::size_t, 6> others;  // the dimensions the tiles do not cover, outermost first
  std::int64_t outer = 1;
  for (std::size_t d = 0; d < last; ++d)
    if (d != k) {
      others.push_back(d);
      outer *= shape[d];
    }
  const std::int64_t tiles_k = (shape[k] + tile - 1) / tile,
                     tiles_last = (shape[last] + tile - 1) / tile;
  const std::int64_t tiles = outer * tiles_k * tiles_last;
  auto run = [&](std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t) {
      const std::int64_t tile_last = t % tiles_last, tile_k = t / tiles_last % tiles_k;
      std::int64_t rest = t / (tiles_last * tiles_k), index = 0, base_a = 0, base_b = 0;
      for (std::size_t m = others.size(); m-- > 0;) {
        const std::size_t d = others[m];
        const std::int64_t p = rest % shape[d];
        rest /= shape[d];
        index += p * index_strides[d];
        base_a += p * strides_a[d];
        base_b += p * strides_b[d];
      }
      tile_fn(index, base_a, base_b, tile_k * tile, std::min(shape[k], (tile_k + 1) * tile),
              tile_last * tile, std::min(shape[last], (tile_last + 1) * tile));
    }
  };
  for_each_chunk(pool, tiles, std::max<std::int64_t>(1, kElementsPerTask / (tile * tile)), run);
}

// The elements in square tiles over dimensions `k` and the innermost, so that both tensors
// are read and written a few cache lines at a time (element by element, a 4096 x 4096
// transpose misses the cache on every read). Tiles are spread over `pool`.
template <class Fn>
void for_each_element_in_tiles(ThreadPool& pool, const Shape& shape, const Shape& strides_a,
                               const Shape& strides_b, std::size_t k, Fn& fn) {
  const std::size_t last = shape.size() - 1;
  std::int64_t index_k = 1;  // dimension k's row-major stride
  for (std::size_t d = k + 1; d < shape.size(); ++d) index_k *= shape[d];
  for_each_tile(
      pool, shape, strides_a, strides_b, k, kTransposeTile,
      [&](std::int64_t index, std::int64_t base_a, std::int64_t base_b, std::int64_t i_begin,
          std::int64_t i_end, std::int64_t j_begin, std::int64_t j_end) {
        for (std::int64_t i = i_begin; i < i_end; ++i)
          for (std::int64_t j = j_begin; j < j_end; ++j)
            fn(index + i * index_k + j, base_a + i * strides_a[k] + j * strides_a[last],
               base_b + i * strides_b[k] + j * strides_b[last]);
      });
}

// for_each_element for loops whose fn writes nothing but the element it is given, from values
// no other element's call writes, so that the order does not matter: the elements are cut
// into tasks of kElementsPerTask run on `pool` (each element gets the value it gets on one
// thread), and a transposing loop walks tiles.
template <class Fn>
void parallel_for_each_element(ThreadPool& pool, const Shape& shape, const Shape& strides_a,
                               const Shape& strides_b, Fn&& fn) {
  const std::int64_t total = shape_numel(shape);
  if (total == 0) return;
  if (const std::int64_t k = transposed_dimension(shape, strides_b); k >= 0)
    return for_each_element_in_tiles(pool, shape, strides_a, strides_b, static_cast<std::size_t>(k),
                                     fn);
  if (shape.empty()) return for_each_element(shape, strides_a, strides_b, fn);
  for_each_chunk(pool, total, kElementsPerTask, [&](std::int64_t first, std::int64_t end) {
    for_each_element_in_range(shape, strides_a, strides_b, first, end, fn);
  });
}

}  // namespace shardkit::detail
