// Labelled images held decoded in memory, as the trainers read them: u8 pixels, interleaved
// channels (HWC: one byte per channel, grey or RGB), one size for all images or one per image.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::data {

// One image of a dataset: rows x cols pixels of `channels` interleaved bytes.
struct ImageView {
  const std::uint8_t* pixels = nullptr;
  std::int64_t rows = 0, cols = 0, channels = 1;

  std::int64_t bytes() const { return rows * cols * channels; }
};

struct ImageDataset {
  std::int64_t count = 0;
  std::int64_t channels = 1;        // 1 (grey) or 3 (RGB), the same for every image
  std::int64_t rows = 0, cols = 0;  // every image's size; 0 when the sizes vary (extents)
  std::vector<std::uint8_t> pixels;
  std::vector<std::int32_t> labels;  // 0 .. classes.size() - 1 (ImageNet's 1000 classes and more)
  std::vector<std::string> classes;  // label -> name
  // Where each image lies, only when the sizes vary.
  struct Extent {
    std::int64_t offset = 0, rows = 0, cols = 0;
  };
  std::vector<Extent> extents;

  bool uniform() const { return extents.empty(); }
  // Bytes of one image; only for a uniform dataset.
  std::int64_t pixels_per_image() const { return rows * cols * channels; }
  ImageView image(std::int64_t i) const {
    if (uniform()) return {pixels.data() + i * pixels_per_image(), rows, cols, channels};
    const Extent& e = extents[static_cast<std::size_t>(i)];
    return {pixels.data() + e.offset, e.rows, e.cols, channels};
  }
  std::int64_t num_classes() const { return static_cast<std::int64_t>(classes.size()); }
};

// The first `limit` images (all of them when limit < 0 or >= count).
inline ImageDataset first_images(ImageDataset d, std::int64_t limit) {
  if (limit < 0 || limit >= d.count) return d;
  const std::int64_t end =
      d.uniform() ? limit * d.pixels_per_image()
                  : d.extents[static_cast<std::size_t>(limit)].offset;  // the next one's start
  d.count = limit;
  d.pixels.resize(static_cast<std::size_t>(end));
  d.labels.resize(static_cast<std::size_t>(limit));
  if (!d.uniform()) d.extents.resize(static_cast<std::size_t>(limit));
  return d;
}

}  // namespace shardkit::data
