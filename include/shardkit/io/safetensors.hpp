// safetensors files (the format of Hugging Face's safetensors, read by PyTorch, JAX and others):
// an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
// byte range, then the raw little-endian data. Checkpoints in it map onto torch state dicts.
//
// Writing is atomic: the file is written beside the target under a temporary name, flushed to
// disk, then renamed over the target, so a crash leaves either the old file or the new one,
// never a torn one. Reading validates everything the header claims before trusting it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::io {

// One tensor of a safetensors file, on the host.
struct NamedBytes {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::vector<std::byte> bytes;  // row-major, little-endian

  template <class T>
  static NamedBytes of(std::string name, Shape shape, const std::vector<T>& values) {
    NamedBytes out{std::move(name), dtype_of<T>, std::move(shape), std::vector<std::byte>(values.size() * sizeof(T))};
    check(shape_numel(out.shape) == static_cast<std::int64_t>(values.size()), "safetensors entry '",
          out.name, "': ", values.size(), " values do not fill shape ", shape_str(out.shape));
    if (!values.empty()) std::memcpy(out.bytes.data(), values.data(), out.bytes.size());
    return out;
  }

  template <class T>
  std::vector<T> values() const {
    check(dtype == dtype_of<T>, "safetensors entry '", name, "' holds ", dtype_name(dtype),
          ", not ", dtype_name(dtype_of<T>));
    std::vector<T> out(bytes.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
};

// The host bytes of any tensor on the context's device (any dtype, any strides).
inline NamedBytes host_bytes(Context& ctx, std::string name, const Tensor& t) {
  NamedBytes out{std::move(name), t.dtype(), t.shape(),
                 std::vector<std::byte>(static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()))};
  if (!out.bytes.empty()) {
    auto host = Storage::borrow(out.bytes.data(), out.bytes.size(), Device::cpu());
    copy(ctx, Tensor(host, t.shape(), t.dtype()), t);
  }
  return out;
}

// Copies a file's tensor into `target` (on the context's device); dtype and shape must match.
inline void copy_to_tensor(Context& ctx, const NamedBytes& from, const Tensor& target) {
  check(from.dtype == target.dtype() && from.shape == target.shape(), "'", from.name, "' is ",
        dtype_name(from.dtype), shape_str(from.shape), " in the file but ", dtype_name(target.dtype()),
        shape_str(target.shape()), " here");
  if (from.bytes.empty()) return;
  auto host = Storage::borrow(const_cast<std::byte*>(from.bytes.data()), from.bytes.size(), Device::cpu());
  copy(ctx, target, Tensor(host, from.shape, from.dtype));
}

struct SafetensorsContents {
  std::vector<NamedBytes> tensors;             // in file order
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (strings only)

  const NamedBytes* find(std::string_view name) const {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

namespace detail {

inline std::string_view safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
  }
  return "?";
}

inline DType dtype_from_safetensors(std::string_view name, const std::string& path, const std::string& tensor) {
  for (auto dtype : kAllDTypes)
    if (safetensors_dtype(dtype) == name) return dtype;
  fail<IoError>("'", path, "': tensor '", tensor, "' has dtype '", name,
                "', which shardkit does not hold (F32, F64, F16, BF16, I32, I64, U8)");
}

// Closes on scope exit; write_all/sync report errno with the file's name.
class PosixFile {
 public:
  PosixFile(const std::string& path, int flags) : path_(path), fd_(::open(path.c_str(), flags, 0644)) {
    check<IoError>(fd_ >= 0, "cannot open '", path, "' for writing: ", std::strerror(errno));
  }
  ~PosixFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  void write_all(const void* data, std::size_t bytes) {
    const auto* at = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t wrote = ::write(fd_, at, bytes);
      if (wrote < 0 && errno == EINTR) continue;
      check<IoError>(wrote > 0, "writing '", path_, "' failed: ", std::strerror(errno),
                     " (is the disk full?)");
      at += wrote;
      bytes -= static_cast<std::size_t>(wrote);
    }
  }
  void sync_and_close() {
    check<IoError>(::fsync(fd_) == 0, "flushing '", path_, "' to disk failed: ", std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    check<IoError>(::close(fd) == 0, "closing '", path_, "' failed: ", std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_;
};

}  // namespace detail

// Writes `tensors` (names unique) and string `metadata` to `path`, atomically.
inline void save_safetensors(const std::string& path, const std::vector<NamedBytes>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    check(!t.name.empty() && t.name != "__metadata__", "save_safetensors '", path,
          "': a tensor name may be neither empty nor '__metadata__'");
    check(!header.contains(t.name), "save_safetensors '", path, "': tensor name '", t.name,
          "' appears twice; names must be unique");
    check(static_cast<std::int64_t>(t.bytes.size()) == shape_numel(t.shape) * static_cast<std::int64_t>(dtype_size(t.dtype)),
          "save_safetensors '", path, "': tensor '", t.name, "' has ", t.bytes.size(),
          " bytes for shape ", shape_str(t.shape), " of ", dtype_name(t.dtype));
    header[t.name] = {{"dtype", std::string(detail::safetensors_dtype(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::uint64_t length = text.size();
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(length >> (8 * i));

  const std::filesystem::path target(path);
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  try {
    detail::PosixFile file(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
    file.write_all(length_bytes, 8);
    file.write_all(text.data(), text.size());
    for (const auto& t : tensors) file.write_all(t.bytes.data(), t.bytes.size());
    file.sync_and_close();
    std::error_code error;
    std::filesystem::rename(temporary, target, error);
    check<IoError>(!error, "replacing '", path, "' with the new file failed: ", error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);  // never leave a half-written file behind
    throw;
  }
  // Make the rename itself durable: sync the directory that holds the file.
  const auto folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

inline SafetensorsContents load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check<IoError>(in.good(), "cannot open '", path, "' for reading");
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char length_bytes[8] = {};
  check<IoError>(file_size >= 8 && in.read(reinterpret_cast<char*>(length_bytes), 8),
                 "'", path, "' is not a safetensors file: it is shorter than its 8-byte header length");
  std::uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= std::uint64_t{length_bytes[i]} << (8 * i);
  check<IoError>(length <= file_size - 8 && length <= (std::uint64_t{100} << 20), "'", path,
                 "' is not a safetensors file or is truncated: its header claims ", length,
                 " bytes of a ", file_size, "-byte file");
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  const std::uint64_t data_size = file_size - 8 - length;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail<IoError>("'", path, "' has a header that is not valid JSON: ", e.what());
  }
  check<IoError>(header.is_object(), "'", path, "': the header is not a JSON object");

  SafetensorsContents out;
  struct Range {
    std::uint64_t begin, end;
    std::size_t index;
  };
  std::vector<Range> ranges;
  try {
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        for (const auto& [key, value] : entry.items()) out.metadata[key] = value.get<std::string>();
        continue;
      }
      NamedBytes t;
      t.name = name;
      t.dtype = detail::dtype_from_safetensors(entry.at("dtype").get<std::string>(), path, name);
      t.shape = entry.at("shape").get<Shape>();
      const auto offsets = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      check<IoError>(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_size,
                     "'", path, "': tensor '", name, "' has data_offsets outside the ", data_size,
                     "-byte data section (truncated file?)");
      for (auto d : t.shape) check<IoError>(d >= 0, "'", path, "': tensor '", name, "' has a negative dimension");
      check<IoError>(offsets[1] - offsets[0] == static_cast<std::uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype),
                     "'", path, "': tensor '", name, "' covers ", offsets[1] - offsets[0],
                     " bytes but its shape ", shape_str(t.shape), " of ", dtype_name(t.dtype), " needs ",
                     shape_numel(t.shape) * static_cast<std::int64_t>(dtype_size(t.dtype)));
      ranges.push_back({offsets[0], offsets[1], out.tensors.size()});
      out.tensors.push_back(std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    fail<IoError>("'", path, "' has a malformed header entry: ", e.what());
  }
  // The format forbids overlaps and holes: the ranges must tile the data section exactly.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::uint64_t expected = 0;
  for (const auto& r : ranges) {
    check<IoError>(r.begin == expected, "'", path, "': tensor '", out.tensors[r.index].name,
                   "' starts at byte ", r.begin, " of the data, expected ", expected,
                   " (overlapping or holed data section)");
    expected = r.end;
  }
  check<IoError>(expected == data_size, "'", path, "': the tensors cover ", expected, " of ",
                 data_size, " data bytes");
  // The ranges tile the data section in order: read each tensor straight into its own bytes.
  std::vector<NamedBytes> ordered;
  ordered.reserve(ranges.size());
  for (const auto& r : ranges) {
    NamedBytes& t = out.tensors[r.index];
    t.bytes.resize(r.end - r.begin);
    in.read(reinterpret_cast<char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    check<IoError>(static_cast<std::uint64_t>(in.gcount()) == t.bytes.size(), "'", path,
                   "' ends early inside tensor '", t.name, "'");
    ordered.push_back(std::move(t));  // file (data) order; the JSON object is sorted by name
  }
  out.tensors = std::move(ordered);
  return out;
}

}  // namespace shardkit::io
