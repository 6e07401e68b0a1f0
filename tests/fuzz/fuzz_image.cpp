// libFuzzer target: bytes through decode_image (JPEG via libjpeg, PNG via libpng, PGM/PPM read
// here). An accepted image must hold exactly rows x cols x channels bytes, grey or RGB, within
// the pixel limit.
#include <cstddef>
#include <cstdint>
#include <span>

#include "shardkit/data/image_decode.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto image = shardkit::data::decode_image(std::span(data, size), "fuzz-input");
    const bool channels_ok = image.channels == 1 || image.channels == 3;
    const bool size_ok =
        image.rows > 0 && image.cols > 0 &&
        image.rows * image.cols <= shardkit::data::kMaxImagePixels &&
        image.pixels.size() == static_cast<std::size_t>(image.rows * image.cols * image.channels);
    if (!channels_ok || !size_ok) __builtin_trap();
  } catch (const shardkit::Error&) {
  }
  return 0;
}
