// Row-major iteration over one or two strided tensors on the host.
#pragma once

#include <cstdint>
#include <vector>

#include "shardkit/core/tensor.hpp"

namespace shardkit::detail {

// Calls fn(index, offset_a, offset_b) for every element in row-major order: `index` is the
// element's linear position, the offsets are in elements relative to each tensor's first
// element. The innermost dimension runs as a plain loop so the compiler can vectorise it.
template <class Fn>
void for_each_element(const Shape& shape, const Shape& strides_a, const Shape& strides_b,
                      Fn&& fn) {
  const std::int64_t total = shape_numel(shape);
  if (total == 0) return;
  if (shape.empty()) {
    fn(std::int64_t{0}, std::int64_t{0}, std::int64_t{0});
    return;
  }
  const std::size_t rank = shape.size();
  const std::int64_t inner = shape[rank - 1];
  const std::int64_t inner_a = strides_a[rank - 1], inner_b = strides_b[rank - 1];
  std::vector<std::int64_t> position(rank, 0);
  std::int64_t base_a = 0, base_b = 0;
  for (std::int64_t index = 0; index < total; index += inner) {
    for (std::int64_t i = 0; i < inner; ++i) fn(index + i, base_a + i * inner_a, base_b + i * inner_b);
    // Advance the odometer over the outer dimensions.
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

}  // namespace shardkit::detail
