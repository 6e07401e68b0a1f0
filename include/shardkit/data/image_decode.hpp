// Decoding image files into u8 pixels: JPEG (libjpeg-turbo), PNG (libpng's simplified API) and
// binary netpbm (PGM P5 / PPM P6, read here: the format is a text header and raw bytes).
// The format is told by the file's first bytes, not its name, as PIL does. Grey images stay one
// channel and colour ones become RGB (an alpha channel is dropped, as PIL's convert("RGB")).
// Anything else is refused with an IoError naming the file: a corrupt or truncated file
// (libjpeg's warnings count as errors, so a JPEG cut short is not silently padded with grey), a
// CMYK JPEG, a format other than these, an image larger than PIL's decompression-bomb limit.
//
// Needs libjpeg and libpng at link time (Debian: libjpeg-dev libpng-dev); shardkit.hpp does not
// include this header, so programs that read no image files do not need them.
#pragma once

// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
#include <png.h>

#include <algorithm>
#include <cctype>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::data {

struct DecodedImage {
  std::int64_t rows = 0, cols = 0, channels = 0;  // channels: 1 (grey) or 3 (RGB)
  std::vector<std::uint8_t> pixels;               // rows x cols x channels, interleaved
};

// PIL refuses images of more than twice its MAX_IMAGE_PIXELS (89 478 485) as decompression
// bombs; so do we, before allocating anything.
inline constexpr std::int64_t kMaxImagePixels = 2 * 89478485;

namespace detail {

// `pixels_per_byte`: the most pixels a file of the format can describe per byte of it (see
// the callers); a header that claims more is corrupt, and is refused before its pixels are
// allocated.
inline std::string image_size_problem(std::int64_t rows, std::int64_t cols, std::size_t file_bytes,
                                      std::int64_t pixels_per_byte) {
  if (rows <= 0 || cols <= 0)
    return "has a size of " + std::to_string(cols) + " x " + std::to_string(rows) +
           " pixels; the file is corrupt";
  if (rows > kMaxImagePixels / cols)  // (rows * cols could overflow)
    return "has " + std::to_string(cols) + " x " + std::to_string(rows) +
           " pixels, more than the " + std::to_string(kMaxImagePixels) +
           " allowed (a decompression bomb, or an image to downscale before training)";
  if ((rows * cols - 1) / pixels_per_byte >= static_cast<std::int64_t>(file_bytes))
    return "claims " + std::to_string(cols) + " x " + std::to_string(rows) + " pixels in " +
           std::to_string(file_bytes) +
           " bytes, more than the format can compress; the file is "
           "corrupt";
  return {};
}

inline void check_image_size(std::int64_t rows, std::int64_t cols, std::size_t file_bytes,
                             std::int64_t pixels_per_byte, const std::string& name) {
  const std::string problem = image_size_problem(rows, cols, file_bytes, pixels_per_byte);
  if (!problem.empty()) fail<IoError>("image '", name, "' ", problem);
}

// The densest encodings: a baseline or progressive JPEG spends at least a bit or so on each
// 8 x 8 block (a DC code, an end-of-block run), so well under 1024 pixels per byte; deflate
// expands at most 1032-fold, and a 1-bit PNG packs 8 pixels per byte of that.
inline constexpr std::int64_t kJpegPixelsPerByte = 4096;
inline constexpr std::int64_t kPngPixelsPerByte = 8 * 1032 + 64;

// libjpeg reports errors through a callback that must not return: it jumps back to
// decode_jpeg's setjmp with the library's message. Warnings (corrupt data, a premature end of
// the file) are errors here too.
struct JpegErrors {
  jpeg_error_mgr manager;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

inline void jpeg_error_exit(j_common_ptr info) {
  auto* errors = reinterpret_cast<JpegErrors*>(info->err);
  errors->manager.format_message(info, errors->message);
  std::longjmp(errors->jump, 1);
}

inline void jpeg_message(j_common_ptr info, int level) {
  if (level < 0) jpeg_error_exit(info);  // a warning: the data is damaged
}

// No object with a destructor may be created between the setjmp and the end of the
// decompression: the jump would skip it. The output vector lives in the caller.
inline bool decode_jpeg_into(std::span<const std::uint8_t> bytes, DecodedImage& out,
                             JpegErrors& errors, std::string& refusal) {
  jpeg_decompress_struct info;
  info.err = jpeg_std_error(&errors.manager);
  errors.manager.error_exit = jpeg_error_exit;
  errors.manager.emit_message = jpeg_message;
  errors.message[0] = '\0';
  if (setjmp(errors.jump)) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, bytes.data(), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&info, TRUE);
  if (info.jpeg_color_space == JCS_CMYK || info.jpeg_color_space == JCS_YCCK) {
    refusal = "is a CMYK JPEG; convert it to RGB (e.g. `convert in.jpg -colorspace sRGB out.jpg`)";
    jpeg_destroy_decompress(&info);
    return false;
  }
  const bool grey = info.jpeg_color_space == JCS_GRAYSCALE;
  info.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
  const std::int64_t rows = info.image_height, cols = info.image_width;
  refusal = image_size_problem(rows, cols, bytes.size(), kJpegPixelsPerByte);
  if (!refusal.empty()) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  out.rows = rows;
  out.cols = cols;
  out.channels = grey ? 1 : 3;
  out.pixels.resize(static_cast<std::size_t>(rows * cols * out.channels));
  jpeg_start_decompress(&info);
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = out.pixels.data() + std::size_t{info.output_scanline} *
                                           static_cast<std::size_t>(cols * out.channels);
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  return true;
}

inline DecodedImage decode_jpeg(std::span<const std::uint8_t> bytes, const std::string& name) {
  DecodedImage out;
  JpegErrors errors;
  std::string refusal;
  if (!decode_jpeg_into(bytes, out, errors, refusal))
    fail<IoError>(
        "image '", name, "' ",
        refusal.empty() ? std::string("is not a readable JPEG: ") + errors.message : refusal);
  return out;
}

inline DecodedImage decode_png(std::span<const std::uint8_t> bytes, const std::string& name) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  auto refuse = [&](const char* stage) {
    const std::string message = image.message;
    png_image_free(&image);
    fail<IoError>("image '", name, "' is not a readable PNG (", stage, "): ", message);
  };
  if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size())) refuse("header");
  if (const auto problem =
          image_size_problem(image.height, image.width, bytes.size(), kPngPixelsPerByte);
      !problem.empty()) {
    png_image_free(&image);
    fail<IoError>("image '", name, "' ", problem);
  }
  const bool colour = (image.format & PNG_FORMAT_FLAG_COLOR) != 0;
  const bool alpha = (image.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  // 8-bit sRGB output, alpha kept (not premultiplied) so that it can be dropped as PIL does
  // instead of being composited onto the buffer.
  image.format = colour ? (alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB)
                        : (alpha ? PNG_FORMAT_GA : PNG_FORMAT_GRAY);
  const std::int64_t stored = colour ? (alpha ? 4 : 3) : (alpha ? 2 : 1);
  std::vector<std::uint8_t> buffer(PNG_IMAGE_SIZE(image));
  // Missing or damaged image data fails here; libpng's warnings are about ancillary chunks
  // (a colour profile, a text field) and leave the pixels whole, as PIL takes them.
  if (!png_image_finish_read(&image, nullptr, buffer.data(), 0, nullptr)) refuse("pixels");
  DecodedImage out;
  out.rows = image.height;
  out.cols = image.width;
  out.channels = colour ? 3 : 1;
  if (!alpha) {
    out.pixels = std::move(buffer);
  } else {
    out.pixels.resize(static_cast<std::size_t>(out.rows * out.cols * out.channels));
    for (std::int64_t p = 0; p < out.rows * out.cols; ++p)
      for (std::int64_t c = 0; c < out.channels; ++c)
        out.pixels[static_cast<std::size_t>(p * out.channels + c)] =
            buffer[static_cast<std::size_t>(p * stored + c)];
  }
  png_image_free(&image);
  return out;
}

// Binary PGM (P5) and PPM (P6) with a maximum value of at most 255: a header of four
// whitespace-separated fields ("P5", width, height, maxval; '#' starts a comment) and one
// whitespace byte before the raw pixels. Values are scaled to 0..255 when maxval < 255.
inline DecodedImage decode_netpbm(std::span<const std::uint8_t> bytes, const std::string& name) {
  std::size_t at = 2;
  auto number = [&](const char* what) -> std::int64_t {
    for (;;) {
      while (at < bytes.size() && std::isspace(bytes[at])) ++at;
      if (at < bytes.size() && bytes[at] == '#') {
        while (at < bytes.size() && bytes[at] != '\n') ++at;
        continue;
      }
      break;
    }
    std::int64_t value = 0;
    const std::size_t begin = at;
    while (at < bytes.size() && std::isdigit(bytes[at]) && at - begin < 10)
      value = value * 10 + (bytes[at++] - '0');
    check<IoError>(at > begin, "image '", name, "' is not a readable PGM/PPM: its header's ", what,
                   " is missing or not a number");
    return value;
  };
  const std::int64_t channels = bytes[1] == '5' ? 1 : 3;
  const std::int64_t cols = number("width"), rows = number("height"), maxval = number("maxval");
  check_image_size(rows, cols, bytes.size(), kMaxImagePixels, name);  // bytes: exactly, below
  check<IoError>(maxval >= 1 && maxval <= 255, "image '", name, "' has a maximum value of ", maxval,
                 "; 16-bit PGM/PPM files are not read (convert them to 8-bit PNG)");
  check<IoError>(at < bytes.size() && std::isspace(bytes[at]), "image '", name,
                 "' is not a readable PGM/PPM: no whitespace after its header");
  ++at;
  const auto need = static_cast<std::size_t>(rows * cols * channels);
  check<IoError>(bytes.size() - at >= need, "image '", name, "' is truncated: ", bytes.size() - at,
                 " bytes of pixels where ", need, " are needed");
  DecodedImage out{rows, cols, channels, {}};
  out.pixels.assign(bytes.begin() + static_cast<std::ptrdiff_t>(at),
                    bytes.begin() + static_cast<std::ptrdiff_t>(at + need));
  if (maxval < 255)
    for (auto& v : out.pixels)
      v = static_cast<std::uint8_t>((std::min<std::int64_t>(v, maxval) * 255 + maxval / 2) /
                                    maxval);
  return out;
}

}  // namespace detail

// Decodes an image held in memory; `name` (the file's path) is what errors name.
inline DecodedImage decode_image(std::span<const std::uint8_t> bytes, const std::string& name) {
  auto starts_with = [&](std::initializer_list<std::uint8_t> magic) {
    return bytes.size() >= magic.size() && std::equal(magic.begin(), magic.end(), bytes.begin());
  };
  if (starts_with({0xFF, 0xD8, 0xFF})) return detail::decode_jpeg(bytes, name);
  if (starts_with({0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'}))
    return detail::decode_png(bytes, name);
  if (starts_with({'P', '5'}) || starts_with({'P', '6'})) return detail::decode_netpbm(bytes, name);
  if (bytes.empty()) fail<IoError>("image '", name, "' is an empty file");
  fail<IoError>("image '", name,
                "' is neither JPEG, PNG nor binary PGM/PPM (by its first bytes); convert it to "
                "PNG or JPEG (BMP, TIFF and WebP are not read)");
}

inline std::vector<std::uint8_t> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  check<IoError>(in.good(), "cannot open '", path, "' for reading");
  const auto size = static_cast<std::streamoff>(in.tellg());
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), size);
  check<IoError>(in.good() || size == 0, "cannot read the ", size, " bytes of '", path, "'");
  return bytes;
}

inline DecodedImage decode_image_file(const std::string& path) {
  return decode_image(read_file_bytes(path), path);
}

}  // namespace shardkit::data
