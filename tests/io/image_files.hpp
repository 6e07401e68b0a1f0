// Writing image files for the tests of the image readers: PNG (libpng's simplified API), JPEG
// (libjpeg) and binary PGM/PPM, from u8 pixels with interleaved channels.
#pragma once

// jpeglib.h uses size_t and FILE without including their headers.
#include <cstddef>
#include <cstdio>

#include <jpeglib.h>
#include <png.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace image_files {

struct Pixels {
  std::int64_t rows = 0, cols = 0, channels = 1;  // 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA
  std::vector<std::uint8_t> data;
};

inline void write_png(const std::string& path, const Pixels& p) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(p.cols);
  image.height = static_cast<png_uint_32>(p.rows);
  image.format = p.channels == 1   ? PNG_FORMAT_GRAY
                 : p.channels == 2 ? PNG_FORMAT_GA
                 : p.channels == 3 ? PNG_FORMAT_RGB
                                   : PNG_FORMAT_RGBA;
  if (!png_image_write_to_file(&image, path.c_str(), 0, p.data.data(), 0, nullptr))
    throw std::runtime_error("cannot write " + path + ": " + image.message);
}

// channels 1 or 3; `cmyk` writes four channels marked as CMYK (the data repeated) instead;
// `progressive`: libjpeg's progressive script (several scans).
inline void write_jpeg(const std::string& path, const Pixels& p, int quality = 95,
                       bool cmyk = false, bool progressive = false) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) throw std::runtime_error("cannot open " + path);
  jpeg_compress_struct info;
  jpeg_error_mgr errors;
  info.err = jpeg_std_error(&errors);
  jpeg_create_compress(&info);
  jpeg_stdio_dest(&info, file);
  info.image_width = static_cast<JDIMENSION>(p.cols);
  info.image_height = static_cast<JDIMENSION>(p.rows);
  info.input_components = cmyk ? 4 : static_cast<int>(p.channels);
  info.in_color_space = cmyk ? JCS_CMYK : p.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, quality, TRUE);
  if (progressive) jpeg_simple_progression(&info);
  jpeg_start_compress(&info, TRUE);
  std::vector<std::uint8_t> row(static_cast<std::size_t>(p.cols * info.input_components));
  while (info.next_scanline < info.image_height) {
    const std::uint8_t* from = p.data.data() + info.next_scanline * p.cols * p.channels;
    for (std::int64_t x = 0; x < p.cols; ++x)
      for (int c = 0; c < info.input_components; ++c)
        row[static_cast<std::size_t>(x * info.input_components + c)] =
            from[x * p.channels + (c % p.channels)];
    JSAMPROW r = row.data();
    jpeg_write_scanlines(&info, &r, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::fclose(file);
}

inline void write_netpbm(const std::string& path, const Pixels& p, int maxval = 255) {
  std::ofstream out(path, std::ios::binary);
  out << (p.channels == 1 ? "P5" : "P6") << "\n# written by a test\n"
      << p.cols << " " << p.rows << "\n"
      << maxval << "\n";
  out.write(reinterpret_cast<const char*>(p.data.data()),
            static_cast<std::streamsize>(p.data.size()));
}

inline void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace image_files
