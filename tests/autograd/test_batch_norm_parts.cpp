// The GPU batch-norm steps' walk over a channel's values (autograd/batch_norm_parts.hpp), on the
// CPU: for every part of every channel, the threads' runs cover the part's values exactly once
// -- whole rows, the last part short, rows shorter and longer than a stride of threads, rows
// longer than a part split into segments (the last one short), runs of 1 and of 4 -- and the
// parts cover the channel. The kernels call the same function with
// threadIdx.x and blockDim.x, so a GPU runs what this checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardkit/autograd/batch_norm_parts.hpp"

namespace ag = shardkit::autograd;

namespace {

template <int Per>
void check_walk(std::int64_t outer, std::int64_t channels, std::int64_t inner,
                std::int64_t threads) {
  CAPTURE(outer);
  CAPTURE(channels);
  CAPTURE(inner);
  CAPTURE(threads);
  CAPTURE(Per);
  const ag::ChannelParts parts = ag::channel_parts(outer, inner);
  CHECK(parts.rows >= 1);
  CHECK(parts.parts >= 1);
  CHECK(parts.segment % Per == 0);
  CHECK(parts.parts / parts.segments * parts.rows >= outer);
  CHECK(parts.segment <= ag::kPartValues);
  if (parts.segments > 1) {  // segments of about equal length: the last not a sliver
    const std::int64_t last = inner - (parts.segments - 1) * parts.segment;
    CHECK(last > 0);
    CHECK(last + 4 * parts.segments >= parts.segment);
  }
  std::vector<int> seen(static_cast<std::size_t>(outer * channels * inner), 0);
  std::int64_t outside = 0, unordered = 0, misplaced = 0, unaligned = 0;
  for (std::int64_t c = 0; c < channels; ++c) {
    std::int64_t values = 0;
    for (std::int64_t part = 0; part < parts.parts; ++part) {
      const std::int64_t first_row = part / parts.segments * parts.rows;
      const std::int64_t first_col = part % parts.segments * parts.segment;
      std::int64_t counted = -1;
      for (std::int64_t t = 0; t < threads; ++t) {
        std::int64_t previous = -1;
        const std::int64_t n = ag::for_part_runs<Per>(
            t, threads, c, part, parts, outer, channels, inner, [&](std::int64_t offset) {
              // (counted, not CHECKed, per value: a million values are walked)
              if (offset < 0 || offset + Per > static_cast<std::int64_t>(seen.size())) {
                ++outside;
                return;
              }
              if (offset <= previous) ++unordered;  // a thread's runs in order
              // (runs of 4 start on multiples of 4 elements: x's base alignment is theirs)
              if (offset % Per != 0) ++unaligned;
              previous = offset;
              for (int k = 0; k < Per; ++k) {
                const std::int64_t at = offset + k;
                const std::int64_t row = at / (inner * channels), col = at % inner;
                if ((at / inner) % channels != c || row < first_row ||
                    row >= first_row + parts.rows || col < first_col ||
                    col >= first_col + parts.segment)
                  ++misplaced;  // another channel's value, or outside the part
                ++seen[static_cast<std::size_t>(at)];
              }
            });
        if (counted >= 0) CHECK(n == counted);
        counted = n;
      }
      values += counted;
    }
    CHECK(values == outer * inner);
  }
  CHECK(outside == 0);
  CHECK(unordered == 0);
  CHECK(misplaced == 0);
  CHECK(unaligned == 0);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != 1) {
      FAIL_CHECK("element ", i, " was walked ", seen[i], " times");
      break;
    }
  }
}

}  // namespace

TEST_CASE("batch-norm parts on the GPU: the threads' runs cover each channel's values once") {
  // (outer, channels, inner): a ResNet's layers at 32² and 224² scaled down in outer, rows of one
  // value (channels-last and [N, C]), rows longer than a part, odd sizes.
  const std::int64_t shapes[][3] = {{8, 3, 1024},  {5, 2, 196},   {3, 4, 12544}, {7, 3, 16},
                                    {300, 2, 1},   {2, 2, 4096},  {9, 3, 4100},  {1, 5, 4},
                                    {33, 2, 64},   {4, 1, 6},     {1000, 1, 20}, {3, 2, 3},
                                    {1, 2, 65536}, {2, 3, 10004}, {1, 1, 8193}};
  for (const auto& s : shapes)
    for (std::int64_t threads : {256, 32, 1000}) {
      check_walk<1>(s[0], s[1], s[2], threads);
      if (s[2] % 4 == 0) check_walk<4>(s[0], s[1], s[2], threads);
    }
}

TEST_CASE("batch-norm rows of channels on the GPU: the tiles' row lanes cover each value once") {
  // (rows, channels): channels-last layers ([N·H·W, C]) of a ResNet at 32² scaled down, [N, C]
  // inputs of a projection head, channels short of a tile, one row, rows short of a part.
  const std::int64_t shapes[][2] = {{4096, 64}, {1000, 96}, {256, 2048}, {3, 5}, {1, 40},
                                    {777, 33},  {65, 1},    {20000, 8},  {0, 4}, {513, 512}};
  for (const auto& shape : shapes) {
    const std::int64_t rows = shape[0], channels = shape[1];
    CAPTURE(rows);
    CAPTURE(channels);
    const ag::RowParts parts = ag::row_parts(rows, channels);
    CHECK(parts.part_rows % ag::kRowLanes == 0);
    CHECK(parts.part_rows >= ag::kMinPartRows);
    CHECK(parts.part_rows <= ag::kMaxPartRows);
    CHECK(parts.tiles * ag::kTileChannels >= channels);
    CHECK((parts.tiles - 1) * ag::kTileChannels < std::max<std::int64_t>(channels, 1));
    CHECK(parts.parts >= 1);
    CHECK(parts.parts * parts.part_rows >= rows);
    if (rows > 0) CHECK((parts.parts - 1) * parts.part_rows < rows);
    std::vector<int> seen(static_cast<std::size_t>(rows * channels), 0);
    std::int64_t misplaced = 0, unordered = 0;
    for (std::int64_t c = 0; c < channels; ++c) {
      std::int64_t values = 0;
      for (std::int64_t part = 0; part < parts.parts; ++part) {
        const std::int64_t n = ag::part_rows_of(part, parts, rows);
        values += n;
        for (int lane = 0; lane < ag::kRowLanes; ++lane) {
          std::int64_t previous = -1, walked = 0;
          ag::for_part_rows(lane, c, part, parts, rows, channels, [&](std::int64_t offset) {
            const std::int64_t row = offset / channels;
            if (offset % channels != c || row < part * parts.part_rows ||
                row >= part * parts.part_rows + n || row % ag::kRowLanes != lane % ag::kRowLanes)
              ++misplaced;
            if (offset <= previous) ++unordered;
            previous = offset;
            ++walked;
            if (offset >= 0 && offset < rows * channels) ++seen[static_cast<std::size_t>(offset)];
          });
          // (a lane takes every kRowLanes-th row of the part, from its own)
          CHECK(walked == (n > lane ? (n - lane + ag::kRowLanes - 1) / ag::kRowLanes : 0));
        }
      }
      CHECK(values == rows);
    }
    CHECK(misplaced == 0);
    CHECK(unordered == 0);
    for (std::size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] != 1) {
        FAIL_CHECK("element ", i, " was walked ", seen[i], " times");
        break;
      }
    }
  }
  // About kRowBlocks blocks where the rows allow: a 64-channel layer of 256 x 32² images.
  const ag::RowParts layer = ag::row_parts(256 * 32 * 32, 64);
  CHECK(layer.tiles * layer.parts == ag::kRowBlocks);
}
