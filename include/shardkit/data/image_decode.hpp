// Decoding image files into u8 pixels: JPEG (libjpeg-turbo), PNG (libpng) and
// binary netpbm (PGM P5 / PPM P6, read here: the format is a text header and raw bytes).
// The format is told by the file's first bytes, not its name, as PIL does. Grey images stay one
// channel and colour ones become RGB (an alpha channel is dropped, and a CMYK JPEG converted,
// as PIL's convert("RGB") does).
// Anything else is refused with an IoError naming the file: a corrupt or truncated file
// (libjpeg's warnings that pixels were lost count as errors, so a JPEG cut short is not
// silently padded with grey; those about metadata do not), a format other than
// these, an image larger than PIL's decompression-bomb limit.
//
// Needs libjpeg and libpng at link time (Debian: libjpeg-dev libpng-dev); shardkit.hpp does not
// include this header, so programs that read no image files do not need them.
#pragma once

// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
// (after jpeglib.h, which it needs: the warnings' codes)
#include <jerror.h>
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
// decode_jpeg's setjmp with the library's message. Warnings that pixels were lost (corrupt
// entropy-coded data, a premature end of the file) are errors here too; those about the
// metadata or the bytes around the image data leave the pixels whole and are let pass, as PIL
// does (ImageNet's training set holds such files: "Corrupt JPEG data: N extraneous bytes
// before marker 0xd9", an unknown JFIF revision).
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

inline bool jpeg_warning_loses_pixels(const jpeg_error_mgr& err) {
  switch (err.msg_code) {
    case JWRN_EXTRANEOUS_DATA: {  // bytes skipped before a marker: harmful only inside the scan
      const int marker = err.msg_parm.i[1];
      return marker >= 0xD0 && marker <= 0xD7;  // (before a restart marker: data lost)
    }
    case JWRN_JFIF_MAJOR:  // metadata the decoder does not need
    case JWRN_ADOBE_XFORM:
    case JWRN_BOGUS_ICC:
      return false;
    default:  // premature end of file, corrupt data, bad Huffman codes, resynchronisation
      return true;
  }
}

inline void jpeg_message(j_common_ptr info, int level) {
  if (level < 0 && jpeg_warning_loses_pixels(*info->err)) jpeg_error_exit(info);
}

// The file's bytes as libjpeg's source (jpeg_mem_src's, but for its end). Where the bytes run
// out, an end marker follows. Silently when the file is one scan of Huffman data and its
// header was read: a file that lacks only its end marker (PIL loads it) then decodes as it is,
// and one cut inside its scan meets the marker early, which libjpeg reports as lost data
// (refused). Otherwise with libjpeg's "premature end" warning (refused): a progressive or
// arithmetic-coded file cut where a scan ends would meet the marker with no warning at all,
// its missing scans silently grey.
struct JpegSource {
  jpeg_source_mgr manager;
  bool ends_whole = false;  // set once the header is read

  void read_from(jpeg_decompress_struct& info, std::span<const std::uint8_t> bytes) {
    manager.next_input_byte = bytes.data();
    manager.bytes_in_buffer = bytes.size();
    manager.init_source = [](j_decompress_ptr) {};
    manager.fill_input_buffer = [](j_decompress_ptr info) -> boolean {
      static const JOCTET kEndMarker[2] = {0xFF, 0xD9};
      if (!reinterpret_cast<JpegSource*>(info->src)->ends_whole) WARNMS(info, JWRN_JPEG_EOF);
      info->src->next_input_byte = kEndMarker;
      info->src->bytes_in_buffer = 2;
      return TRUE;
    };
    manager.skip_input_data = [](j_decompress_ptr info, long count) {
      jpeg_source_mgr* src = info->src;
      if (count <= 0) return;
      while (count > static_cast<long>(src->bytes_in_buffer)) {
        count -= static_cast<long>(src->bytes_in_buffer);
        (void)src->fill_input_buffer(info);
      }
      src->next_input_byte += count;
      src->bytes_in_buffer -= static_cast<std::size_t>(count);
    };
    manager.resync_to_restart = jpeg_resync_to_restart;
    manager.term_source = [](j_decompress_ptr) {};
    info.src = &manager;
  }
};

// A CMYK (or YCCK, which libjpeg gives as CMYK) JPEG's pixels as PIL's convert("RGB") gives
// them: PIL takes every four-component JPEG's samples as Adobe's inverted CMYK ("CMYK;I"),
// then r = k' - c'·k'/255 with k' = 255 - k (its cmyk2rgb: integer rounding as MULDIV255), so
// r = k - (255 - c)·k/255 in the file's samples. In place: pixel i's 4 bytes are read before
// its 3 are written, which lie at or before them.
inline void cmyk_to_rgb_in_place(std::vector<std::uint8_t>& pixels, std::int64_t count) {
  auto muldiv255 = [](int a, int b) {
    const int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
  };
  for (std::int64_t i = 0; i < count; ++i) {
    const std::uint8_t* cmyk = pixels.data() + 4 * i;
    const int k = cmyk[3];  // (255 - PIL's inverted k)
    const int rgb[3] = {k - muldiv255(255 - cmyk[0], k), k - muldiv255(255 - cmyk[1], k),
                        k - muldiv255(255 - cmyk[2], k)};
    for (int c = 0; c < 3; ++c)
      pixels[static_cast<std::size_t>(3 * i + c)] =
          static_cast<std::uint8_t>(std::clamp(rgb[c], 0, 255));
  }
  pixels.resize(static_cast<std::size_t>(3 * count));
}

// No object with a destructor may be created between the setjmp and the end of the
// decompression: the jump would skip it. The output vector lives in the caller.
inline bool decode_jpeg_into(std::span<const std::uint8_t> bytes, JpegSource& source,
                             DecodedImage& out, JpegErrors& errors, std::string& refusal) {
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
  source.read_from(info, bytes);
  jpeg_read_header(&info, TRUE);
  source.ends_whole = !jpeg_has_multiple_scans(&info) && !info.arith_code;
  const bool cmyk = info.jpeg_color_space == JCS_CMYK || info.jpeg_color_space == JCS_YCCK;
  const bool grey = info.jpeg_color_space == JCS_GRAYSCALE;
  info.out_color_space = grey ? JCS_GRAYSCALE : cmyk ? JCS_CMYK : JCS_RGB;
  const std::int64_t rows = info.image_height, cols = info.image_width;
  refusal = image_size_problem(rows, cols, bytes.size(), kJpegPixelsPerByte);
  if (!refusal.empty()) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  out.rows = rows;
  out.cols = cols;
  out.channels = grey ? 1 : 3;
  const std::int64_t decoded = cmyk ? 4 : out.channels;  // (CMYK: 4 a pixel, made RGB below)
  try {
    out.pixels.resize(static_cast<std::size_t>(rows * cols * decoded));
  } catch (...) {  // (libjpeg's state would leak)
    jpeg_destroy_decompress(&info);
    throw;
  }
  jpeg_start_decompress(&info);
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = out.pixels.data() +
                   std::size_t{info.output_scanline} * static_cast<std::size_t>(cols * decoded);
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  if (cmyk) cmyk_to_rgb_in_place(out.pixels, rows * cols);
  return true;
}

inline DecodedImage decode_jpeg(std::span<const std::uint8_t> bytes, const std::string& name) {
  DecodedImage out;
  JpegErrors errors;
  JpegSource source;
  std::string refusal;
  if (!decode_jpeg_into(bytes, source, out, errors, refusal))
    fail<IoError>(
        "image '", name, "' ",
        refusal.empty() ? std::string("is not a readable JPEG: ") + errors.message : refusal);
  return out;
}

// libpng's low-level reader, set to give the values PIL gives: palettes expanded to their
// colours (a tRNS transparency ignored, as convert("RGB") does), 1-, 2- and 4-bit grey scaled to
// 8 bits, 16-bit samples cut to their high byte (PIL's "RGB;16B" unpacking), alpha dropped, and
// no gamma correction (PIL ignores gAMA; libpng's simplified API applied it, and read 16-bit
// files without one as linear light: a sample of 0x8080 gave 188 where PIL gives 128).
// 16-bit grey is refused: PIL opens it as 32-bit integers, which its convert("RGB") clips
// to 255, so there is no value to match. Errors longjmp back to the setjmp below, as in
// decode_jpeg; warnings (ancillary chunks) leave the pixels whole and pass, as in PIL.
struct PngSource {
  std::span<const std::uint8_t> bytes;
  std::size_t at = 0;
  char message[256] = {};
};

inline void png_read_from_memory(png_structp png, png_bytep out, png_size_t count) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  if (count > source->bytes.size() - source->at) png_error(png, "the file ends early");
  std::memcpy(out, source->bytes.data() + source->at, count);
  source->at += count;
}

inline void png_error_exit(png_structp png, png_const_charp message) {
  auto* source = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(source->message, sizeof source->message, "%s", message);
  png_longjmp(png, 1);
}

inline void png_warning_ignored(png_structp, png_const_charp) {}

// No object with a destructor may be created between the setjmp and the end of the reading:
// the jump would skip it. The output lives in the caller.
inline bool decode_png_into(PngSource& source, png_structp png, png_infop info, DecodedImage& out,
                            std::string& refusal) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, &source, png_read_from_memory);
  png_read_info(png, info);
  const auto rows = static_cast<std::int64_t>(png_get_image_height(png, info));
  const auto cols = static_cast<std::int64_t>(png_get_image_width(png, info));
  refusal = image_size_problem(rows, cols, source.bytes.size(), kPngPixelsPerByte);
  if (!refusal.empty()) return false;
  const int type = png_get_color_type(png, info);
  const int depth = png_get_bit_depth(png, info);
  if (depth == 16 && type == PNG_COLOR_TYPE_GRAY) {
    refusal =
        "is a 16-bit grey PNG, which is not read (PIL's convert(\"RGB\") clips its values to "
        "255); convert it to 8 bits, e.g. `convert in.png -depth 8 out.png`";
    return false;
  }
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (type == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (depth == 16) png_set_strip_16(png);
  png_set_strip_alpha(png);  // (an alpha channel, or a palette's tRNS that palette_to_rgb expands)
  const int passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out.rows = rows;
  out.cols = cols;
  out.channels = png_get_channels(png, info);
  const auto row_bytes = static_cast<std::size_t>(cols * out.channels);
  if (png_get_rowbytes(png, info) != row_bytes) png_error(png, "unexpected row size");
  out.pixels.resize(static_cast<std::size_t>(rows) * row_bytes);
  for (int pass = 0; pass < passes; ++pass)  // (an interlaced image: each pass adds its pixels)
    for (std::int64_t r = 0; r < rows; ++r)
      png_read_row(png, out.pixels.data() + static_cast<std::size_t>(r) * row_bytes, nullptr);
  // (No png_read_end: the image data is whole and checked once the last row is read; what
  // follows -- text chunks, IEND, or nothing in a file cut there -- PIL does not need either.)
  return true;
}

inline DecodedImage decode_png(std::span<const std::uint8_t> bytes, const std::string& name) {
  PngSource source{bytes};
  png_structp png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, &source, png_error_exit, png_warning_ignored);
  png_infop info = png != nullptr ? png_create_info_struct(png) : nullptr;
  if (info == nullptr) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    fail<OutOfMemory>("image '", name, "': libpng could not allocate its reader");
  }
  DecodedImage out;
  std::string refusal;
  bool read = false;
  try {
    read = decode_png_into(source, png, info, out, refusal);
  } catch (...) {  // (the pixels' allocation)
    png_destroy_read_struct(&png, &info, nullptr);
    throw;
  }
  png_destroy_read_struct(&png, &info, nullptr);
  if (!read)
    fail<IoError>(
        "image '", name, "' ",
        refusal.empty() ? std::string("is not a readable PNG: ") + source.message : refusal);
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
