// Generated labelled images for smoke tests and benchmarks (VISSL's `synthetic` data source):
// no files, the same images for the same seed on any machine. Image i has label i % classes
// (all 0 when classes is 0, as VISSL's RANDOM_SYNTHETIC_LABELS = 0) and shows its label's
// pattern -- a colour grating whose orientation and frequency the label sets, at a random
// phase -- under uniform noise, so that a nearest-neighbour or linear probe has something to
// find while no two images are alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>

#include "shardkit/core/error.hpp"
#include "shardkit/core/philox.hpp"
#include "shardkit/data/image_dataset.hpp"

namespace shardkit::data {

struct SyntheticImages {
  std::int64_t count = 1024;
  std::int64_t side = 32;
  std::int64_t channels = 3;  // 1 or 3
  std::int64_t classes = 10;  // 0: every label 0
  std::uint64_t seed = 0;
};

// The most label classes a synthetic set draws (a smoke test's data, not a catalog's).
inline constexpr std::int64_t kMaxSyntheticClasses = 65536;

inline ImageDataset make_synthetic_images(const SyntheticImages& o) {
  check(o.count >= 1 && o.side >= 4 && (o.channels == 1 || o.channels == 3) && o.classes >= 0 &&
            o.classes <= kMaxSyntheticClasses,
        "synthetic images: count ", o.count, ", side ", o.side, ", channels ", o.channels,
        " and classes ", o.classes,
        " must satisfy count >= 1, side >= 4, channels 1 or 3, 0 <= classes <= ",
        kMaxSyntheticClasses);
  ImageDataset d;
  d.count = o.count;
  d.rows = d.cols = o.side;
  d.channels = o.channels;
  const std::int64_t label_count = std::max<std::int64_t>(o.classes, 1);
  for (std::int64_t c = 0; c < label_count; ++c) d.classes.push_back("class" + std::to_string(c));
  d.labels.resize(static_cast<std::size_t>(o.count));
  d.pixels.resize(static_cast<std::size_t>(o.count * d.pixels_per_image()));
  for (std::int64_t i = 0; i < o.count; ++i) {
    const std::int64_t label = o.classes == 0 ? 0 : i % o.classes;
    d.labels[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(label);
    const double angle = std::numbers::pi * double(label) / double(label_count);
    const double frequency = 2 * std::numbers::pi * (1.5 + double(label % 3)) / double(o.side);
    // Image i draws from blocks [i * 2^32, ...) of the seed's stream: its own, whatever the count.
    std::uint64_t counter = static_cast<std::uint64_t>(i) << 32;
    PhiloxBlock block = philox_block(o.seed, counter++);
    int lane = 0;
    auto uniform = [&] {
      if (lane == 4) {
        block = philox_block(o.seed, counter++);
        lane = 0;
      }
      return word_to_unit(block.v[lane++]);
    };
    const double phase = 2 * std::numbers::pi * uniform();
    std::uint8_t* out = d.pixels.data() + i * d.pixels_per_image();
    for (std::int64_t y = 0; y < o.side; ++y)
      for (std::int64_t x = 0; x < o.side; ++x) {
        const double t = frequency * (std::cos(angle) * double(x) + std::sin(angle) * double(y));
        for (std::int64_t c = 0; c < o.channels; ++c) {
          const double wave = 0.5 + 0.35 * std::sin(t + phase + 2.1 * double(c) * double(label));
          const double v = 0.75 * wave + 0.25 * uniform();
          out[(y * o.side + x) * o.channels + c] =
              static_cast<std::uint8_t>(std::lround(std::clamp(v, 0.0, 1.0) * 255));
        }
      }
  }
  return d;
}

}  // namespace shardkit::data
