// Reading IDX files (the MNIST / Fashion-MNIST format), gzip-compressed or not, with zlib.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::data {

// An IDX array of unsigned bytes: dims (big-endian in the file) and the row-major data.
struct IdxArray {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;
};

namespace detail {

class GzFile {
 public:
  explicit GzFile(const std::string& path) : file_(gzopen(path.c_str(), "rb")) {
    check<IoError>(file_ != nullptr, "cannot open '", path, "' for reading");
  }
  ~GzFile() {
    if (file_) gzclose(file_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  // Reads exactly `bytes` bytes or throws, naming the file and what was being read.
  void read(void* out, std::size_t bytes, const std::string& path, const char* what) {
    auto* cursor = static_cast<unsigned char*>(out);
    while (bytes > 0) {
      const unsigned chunk = bytes > (1u << 30) ? (1u << 30) : static_cast<unsigned>(bytes);
      const int got = gzread(file_, cursor, chunk);
      if (got <= 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        fail<IoError>("'", path, "' ends early or is corrupt while reading ", what,
                      " (zlib: ", code == Z_OK ? "unexpected end of file" : message, ")");
      }
      cursor += got;
      bytes -= static_cast<std::size_t>(got);
    }
  }

  // No byte is left, and a gzip stream ended whole: zlib reports a stream cut short in its
  // trailer (its CRC-32 and length) only through gzerror, as Z_BUF_ERROR, with a read of 0.
  bool at_end(const std::string& path) {
    unsigned char probe;
    if (gzread(file_, &probe, 1) != 0) return false;
    int code = Z_OK;
    const char* message = gzerror(file_, &code);
    check<IoError>(code == Z_OK || code == Z_STREAM_END, "'", path,
                   "' ends early or is corrupt at its end (zlib: ",
                   code == Z_BUF_ERROR ? "the gzip stream is cut short" : message,
                   "); download it again");
    return true;
  }

 private:
  gzFile file_;
};

inline std::uint32_t big_endian_u32(const unsigned char* b) {
  return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) |
         std::uint32_t{b[3]};
}

}  // namespace detail

// Reads an unsigned-byte IDX file (magic 0x0000 08 NN: type u8, NN dimensions). zlib reads
// plain and gzip files alike. Throws IoError naming the file and what is wrong.
inline IdxArray read_idx(const std::string& path) {
  detail::GzFile file(path);
  unsigned char header[4];
  file.read(header, 4, path, "the magic number");
  check<IoError>(header[0] == 0 && header[1] == 0, "'", path,
                 "' is not an IDX file: its magic number starts with ", int{header[0]}, ", ",
                 int{header[1]}, " instead of 0, 0");
  static constexpr char kHex[] = "0123456789ABCDEF";
  const char type_text[] = {kHex[header[2] >> 4], kHex[header[2] & 15], '\0'};
  check<IoError>(header[2] == 0x08, "'", path, "' holds IDX type 0x", type_text,
                 "; only unsigned bytes (0x08) are supported");
  const int rank = header[3];
  check<IoError>(rank >= 1 && rank <= 4, "'", path, "' claims ", rank,
                 " dimensions; expected 1 to 4");
  IdxArray array;
  // The element count, checked before each multiplication (four 32-bit sizes overflow 64 bits).
  constexpr std::int64_t kLimit = std::int64_t{1} << 34;
  std::int64_t total = 1;
  for (int d = 0; d < rank; ++d) {
    unsigned char size[4];
    file.read(size, 4, path, "the dimensions");
    const std::int64_t dim = detail::big_endian_u32(size);
    array.dims.push_back(dim);
    check<IoError>(dim == 0 || total <= kLimit / dim, "'", path,
                   "' claims dimensions of more than ", kLimit, " elements in all (dimension ", d,
                   " is ", dim, "); refusing a file that large");
    total *= dim;
  }
  // In bounded chunks, so memory follows the bytes that are really there: a 20-byte file that
  // claims 2^34 elements fails at its end instead of reserving 16 GiB first.
  constexpr std::int64_t kChunk = std::int64_t{1} << 24;
  for (std::int64_t at = 0; at < total; at += kChunk) {
    const std::int64_t n = std::min(kChunk, total - at);
    array.data.resize(static_cast<std::size_t>(at + n));
    file.read(array.data.data() + at, static_cast<std::size_t>(n), path, "the data");
  }
  check<IoError>(file.at_end(path), "'", path, "' has bytes after its ", total, " data elements");
  return array;
}

}  // namespace shardkit::data
