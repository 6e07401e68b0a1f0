// How the GPU's training-mode batch-norm steps (kernels/autograd/batch_norm_sync.cuh) split a
// channel's values over blocks and threads: parts of whole rows of x[outer, channels, inner], a
// block each, and each thread's runs of Per consecutive values of a row in its part. Host and
// device code, so that the CPU tests walk exactly the kernels' walk (test_batch_norm_parts.cpp):
// the GPU runs it only when one is lent.
#pragma once

#include <algorithm>
#include <cstdint>

#include "shardkit/core/config.hpp"

namespace shardkit::autograd {

// Channel c's values split into parts of about kPartValues: whole rows where a row is shorter
// (part p is rows [p·rows, (p + 1)·rows) of its [outer, inner] values, the last part maybe
// short), else a segment of one row (part p is row p / segments, values [s·segment, (s + 1)
// ·segment) of it for s = p % segments, the last segment maybe short) -- so a channel of one
// long row (one image of 512², or [N, C, L] with a long L) still spreads over many blocks.
struct ChannelParts {
  std::int64_t rows = 1;      // rows a part (1 where rows are split)
  std::int64_t segment = 1;   // a part's values of each of its rows (inner where not split)
  std::int64_t segments = 1;  // parts a row (1 where not split)
  std::int64_t parts = 1;     // parts a channel
};

inline constexpr std::int64_t kPartValues = 4096;  // 16 a thread of 256: enough in flight

inline ChannelParts channel_parts(std::int64_t outer, std::int64_t inner) {
  ChannelParts p;
  if (inner > kPartValues) {  // (a multiple of 4, so runs of 4 stay whole)
    p.segment = kPartValues;
    p.segments = (inner + kPartValues - 1) / kPartValues;
    p.parts = std::max<std::int64_t>(outer, 1) * p.segments;
    return p;
  }
  p.segment = inner;
  p.rows = std::max<std::int64_t>(1, std::min<std::int64_t>(outer, kPartValues / inner));
  p.parts = outer > 0 ? (outer + p.rows - 1) / p.rows : 1;
  return p;
}

// Calls fn(offset) for thread `thread` of `threads`' runs of Per values (Per divides inner) in
// part `part` of channel c -- offset: the run's first element in x -- the threads striding over
// the part's runs in order; returns the part's count of values. The row and the place in it
// advance by the stride, so nothing is divided per value (a 32-bit division per value held the
// moments at 0.8 TB/s on an H200).
template <int Per, class Fn>
SK_HOST_DEVICE SK_INLINE std::int64_t for_part_runs(std::int64_t thread, std::int64_t threads,
                                                    std::int64_t c, std::int64_t part,
                                                    const ChannelParts& parts, std::int64_t outer,
                                                    std::int64_t channels, std::int64_t inner,
                                                    Fn&& fn) {
  const std::int64_t row0 = part / parts.segments * parts.rows;
  const std::int64_t col0 = part % parts.segments * parts.segment;
  const std::int64_t rows = row0 + parts.rows <= outer ? parts.rows : outer - row0;
  const std::int64_t cols = col0 + parts.segment <= inner ? parts.segment : inner - col0;
  const std::int64_t per_row = cols / Per;  // runs in each of the part's rows
  const std::int64_t runs = rows * per_row;
  std::int64_t k = thread, i = k % per_row;
  std::int64_t offset = ((row0 + k / per_row) * channels + c) * inner + col0 + i * Per;
  // One stride: step_i more runs and step_r more rows; past the part's end of a row, on to the
  // next row (back by the part's values of a row, on by a row of every channel).
  const std::int64_t step_i = threads % per_row, step_r = threads / per_row;
  const std::int64_t advance = step_i * Per + step_r * channels * inner;
  const std::int64_t wrap = channels * inner - cols;
  for (; k < runs; k += threads) {
    fn(offset);
    offset += advance;
    i += step_i;
    if (i >= per_row) {
      i -= per_row;
      offset += wrap;
    }
  }
  return rows * cols;
}

}  // namespace shardkit::autograd
