// How the GPU's training-mode batch-norm steps (kernels/autograd/batch_norm_sync.cuh) split a
// channel's values over blocks and threads: parts of whole rows of x[outer, channels, inner], a
// block each, and each thread's runs of Per consecutive values of a row in its part; or, where a
// row holds one value of each channel (inner == 1: channels-last activations, [N, C] inputs),
// tiles of channels over parts of rows. Host and device code, so that the CPU tests walk exactly
// the kernels' walk (test_batch_norm_parts.cpp): the GPU runs it only when one is lent.
#pragma once

#include <algorithm>
#include <cstdint>

#include "shardkit/core/config.hpp"

namespace shardkit::autograd {

// Channel c's values split into parts of about kPartValues: whole rows where a row is shorter
// (part p is rows [p·rows, (p + 1)·rows) of its [outer, inner] values, the last part maybe
// short), else a segment of one row (part p is row p / segments, values [s·segment, (s + 1)
// ·segment) of it for s = p % segments, at most kPartValues values, the last segment maybe
// shorter) -- so a channel of one long row (one image of 512², or [N, C, L] with a long L) still
// spreads over many blocks.
struct ChannelParts {
  std::int64_t rows = 1;      // rows a part (1 where rows are split)
  std::int64_t segment = 1;   // a part's values of each of its rows (inner where not split)
  std::int64_t segments = 1;  // parts a row (1 where not split)
  std::int64_t parts = 1;     // parts a channel
};

inline constexpr std::int64_t kPartValues = 4096;  // 16 a thread of 256: enough in flight

// (inner >= 1: the kernels take an x without values by rows, batch_norm_sync.cuh's split)
inline ChannelParts channel_parts(std::int64_t outer, std::int64_t inner) {
  ChannelParts p;
  if (inner < 1) return p;
  if (inner > kPartValues) {
    // Segments of about equal length (so the last one is not a sliver: 112² = 3 x 4096 + 256
    // would leave a block nearly idle; 4 x 3136 instead), a multiple of 4 so that runs of 4 stay
    // whole.
    const std::int64_t wanted = (inner + kPartValues - 1) / kPartValues;
    p.segment = ((inner + wanted - 1) / wanted + 3) / 4 * 4;
    p.segments = (inner + p.segment - 1) / p.segment;  // (the last one not empty)
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

// Rows of channels: x is [rows, channels] (inner == 1), so a channel's values lie a row apart
// and the parts' form above would read one value of each 32-byte sector it fetches. Here a block
// takes a tile of kTileChannels consecutive channels over a part of `part_rows` rows (the last
// part short): lane l of each of its warps reads channel tile·kTileChannels + l, so a warp reads
// a row's 32 channels at once, and the block's kRowLanes warps take every kRowLanes-th row of the
// part. Parts are sized for about kRowBlocks blocks in all (enough to fill a GPU's SMs several
// times), between kMinPartRows and kMaxPartRows rows; a channel's partials are then folded as
// the parts' form's are.
inline constexpr int kTileChannels = 32;
inline constexpr int kRowLanes = 8;  // (kTileChannels · kRowLanes = 256 threads a block)
inline constexpr std::int64_t kRowBlocks = 1024;
inline constexpr std::int64_t kMinPartRows = 64, kMaxPartRows = 512;

struct RowParts {
  std::int64_t part_rows = 1;  // rows a part (the last one maybe short)
  std::int64_t parts = 1;      // parts a channel
  std::int64_t tiles = 1;      // tiles of kTileChannels channels (the last one maybe short)
};

inline RowParts row_parts(std::int64_t rows, std::int64_t channels) {
  RowParts p;
  p.tiles = std::max<std::int64_t>(1, (channels + kTileChannels - 1) / kTileChannels);
  const std::int64_t wanted = (kRowBlocks + p.tiles - 1) / p.tiles;  // parts for kRowBlocks
  const std::int64_t per = (rows + wanted - 1) / wanted;
  p.part_rows = std::clamp<std::int64_t>((per + kRowLanes - 1) / kRowLanes * kRowLanes,
                                         kMinPartRows, kMaxPartRows);
  p.parts = rows > 0 ? (rows + p.part_rows - 1) / p.part_rows : 1;
  return p;
}

// Rows [row0, end) of part `part` (end - row0 of them: a channel's values in the part).
SK_HOST_DEVICE SK_INLINE std::int64_t part_rows_of(std::int64_t part, const RowParts& parts,
                                                   std::int64_t rows) {
  const std::int64_t row0 = part * parts.part_rows;
  return row0 >= rows ? 0 : row0 + parts.part_rows <= rows ? parts.part_rows : rows - row0;
}

// Calls fn(offset) for row lane `row_lane`'s values of channel c in part `part`: rows part·
// part_rows + row_lane, + kRowLanes, ... in order, offset = row · channels + c. Four rows a
// round, so a thread has four loads in flight before it adds (the rows' order is kept).
template <class Fn>
SK_HOST_DEVICE SK_INLINE void for_part_rows(int row_lane, std::int64_t c, std::int64_t part,
                                            const RowParts& parts, std::int64_t rows,
                                            std::int64_t channels, Fn&& fn) {
  const std::int64_t row0 = part * parts.part_rows;
  const std::int64_t end = row0 + part_rows_of(part, parts, rows);
  std::int64_t r = row0 + row_lane, offset = r * channels + c;
  const std::int64_t step = kRowLanes * channels;
  for (; r + 3 * kRowLanes < end; r += 4 * kRowLanes, offset += 4 * step) {
    fn(offset);
    fn(offset + step);
    fn(offset + 2 * step);
    fn(offset + 3 * step);
  }
  for (; r < end; r += kRowLanes, offset += step) fn(offset);
}

}  // namespace shardkit::autograd
