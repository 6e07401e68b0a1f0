// safetensors files (the format of Hugging Face's safetensors, read by PyTorch, JAX and others):
// an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
// byte range, then the raw little-endian data. Checkpoints in it map onto torch state dicts.
//
// Writing is atomic: the file is written beside the target under a temporary name, flushed to
// disk, then renamed over the target, so a crash leaves either the old file or the new one,
// never a torn one. Reading validates everything the header claims before trusting it.
//
//   SafetensorsWriter  the header first (every tensor's name, dtype and shape are known up
//                      front), then any tensor's bytes at any offset, in any order, as they
//                      arrive: a checkpoint streams through it without the whole state in
//                      memory. commit() makes the file appear.
//   SafetensorsReader  the validated header, then any byte range of any tensor: a rank
//                      reads only the pieces it needs from another rank's checkpoint file.
//   save_safetensors / load_safetensors  whole files in memory, over the two.
//
// Integrity: the writer records every tensor's CRC32 (zlib's) in the metadata as
// "shardkit.crc32.<tensor>" = 8 hex digits, so any other reader still loads the file, and the
// reader checks it the first time it reads any part of that tensor: a flipped bit is an error
// naming the tensor, never a silently wrong value. The header itself -- names, dtypes, shapes
// and every metadata string -- is covered by "shardkit.header_crc32", the CRC32 of the header's
// canonical JSON (keys sorted, no spaces) without that one key and without the data offsets,
// checked when the file is opened: a flipped digit in a step count is an error too. The offsets
// are left out so that a file another writer re-serialised with its metadata kept (the reference
// writer orders tensors its own way) still loads; a damaged offset breaks the exact tiling of
// the data section, or reads another tensor's bytes against its recorded CRC32. (Files written
// before this rule cover the offsets too, and are accepted as such.) Files from other writers
// have no checksums and load unchecked.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <zlib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::checkpoint {

// One tensor of a safetensors file, on the host.
struct NamedBytes {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::vector<std::byte> bytes;  // row-major, little-endian

  template <class T>
  static NamedBytes of(std::string name, Shape shape, const std::vector<T>& values) {
    NamedBytes out{std::move(name), dtype_of<T>, std::move(shape),
                   std::vector<std::byte>(values.size() * sizeof(T))};
    check(shape_numel(out.shape) == static_cast<std::int64_t>(values.size()), "safetensors entry '",
          out.name, "': ", values.size(), " values do not fill shape ", shape_text(out.shape));
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

// The metadata key prefix under which the writer records each tensor's CRC32.
inline constexpr std::string_view kCrc32Prefix = "shardkit.crc32.";
// The metadata key under which the writer records the header's own CRC32.
inline constexpr std::string_view kHeaderCrc32Key = "shardkit.header_crc32";

// zlib's CRC32 of `bytes` bytes, continuing from `crc` (0 to start).
inline std::uint32_t crc32_of(const void* data, std::size_t bytes, std::uint32_t crc = 0) {
  return static_cast<std::uint32_t>(
      ::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(bytes)));
}

// `out` <- the host bytes of any tensor on the context's device (any dtype, any strides),
// reusing out.bytes' memory when it is large enough (a staging buffer kept between saves is
// then one copy, its pages already mapped).
inline void host_bytes_into(Context& ctx, NamedBytes& out, std::string name, const Tensor& t) {
  out.name = std::move(name);
  out.dtype = t.dtype();
  out.shape = t.shape();
  out.bytes.resize(static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype()));
  if (!out.bytes.empty()) {
    auto host = Storage::borrow(out.bytes.data(), out.bytes.size(), Device::cpu());
    copy(ctx, Tensor(host, t.shape(), t.dtype()), t);
  }
}

inline NamedBytes host_bytes(Context& ctx, std::string name, const Tensor& t) {
  NamedBytes out;
  host_bytes_into(ctx, out, std::move(name), t);
  return out;
}

// Copies a file's tensor into `target` (on the context's device); dtype and shape must match.
inline void copy_to_tensor(Context& ctx, const NamedBytes& from, const Tensor& target) {
  check(from.dtype == target.dtype() && from.shape == target.shape(), "'", from.name, "' is ",
        dtype_name(from.dtype), shape_text(from.shape), " in the file but ",
        dtype_name(target.dtype()), shape_text(target.shape()), " here");
  if (from.bytes.empty()) return;
  auto host =
      Storage::borrow(const_cast<std::byte*>(from.bytes.data()), from.bytes.size(), Device::cpu());
  copy(ctx, target, Tensor(host, from.shape, from.dtype));
}

struct SafetensorsContents {
  std::vector<NamedBytes> tensors;              // in file order
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (strings only)

  const NamedBytes* find(std::string_view name) const {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

namespace detail {

inline constexpr EnumName<DType> kSafetensorsDTypes[] = {
    {DType::f32, "F32"}, {DType::f64, "F64"}, {DType::f16, "F16"}, {DType::bf16, "BF16"},
    {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"}};

inline std::string_view safetensors_dtype(DType dtype) {
  return name_of(dtype, kSafetensorsDTypes);
}

inline DType dtype_from_safetensors(std::string_view name, const std::string& path,
                                    const std::string& tensor) {
  if (const auto dtype = find_name(name, kSafetensorsDTypes)) return *dtype;
  fail<IoError>("'", path, "': tensor '", tensor, "' has dtype '", name,
                "', which shardkit does not hold (", names_list(kSafetensorsDTypes), ")");
}

// Closes on scope exit; write_all/sync report errno with the file's name.
class PosixFile {
 public:
  PosixFile(const std::string& path, int flags)
      : path_(path), fd_(::open(path.c_str(), flags, 0644)) {
    check<IoError>(fd_ >= 0, "cannot open '", path, "' for ",
                   (flags & (O_WRONLY | O_RDWR)) ? "writing" : "reading", ": ",
                   std::strerror(errno));
  }
  ~PosixFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  // Writes all `bytes` at file offset `at` (pwrite: no shared file position).
  void write_at(std::uint64_t at, const void* data, std::size_t bytes) {
    const auto* from = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t wrote = ::pwrite(fd_, from, bytes, static_cast<off_t>(at));
      if (wrote < 0 && errno == EINTR) continue;
      check<IoError>(wrote > 0, "writing '", path_, "' failed: ", std::strerror(errno),
                     " (is the disk full?)");
      from += wrote;
      at += static_cast<std::uint64_t>(wrote);
      bytes -= static_cast<std::size_t>(wrote);
    }
  }
  // Reads all `bytes` at file offset `at`; a short file is an error naming `what`.
  void read_at(std::uint64_t at, void* data, std::size_t bytes, std::string_view what) const {
    auto* to = static_cast<char*>(data);
    while (bytes > 0) {
      const ssize_t got = ::pread(fd_, to, bytes, static_cast<off_t>(at));
      if (got < 0 && errno == EINTR) continue;
      check<IoError>(got >= 0, "reading '", path_, "' failed: ", std::strerror(errno));
      check<IoError>(got > 0, "'", path_, "' ends early inside ", what);
      to += got;
      at += static_cast<std::uint64_t>(got);
      bytes -= static_cast<std::size_t>(got);
    }
  }
  std::uint64_t size() const {
    const off_t end = ::lseek(fd_, 0, SEEK_END);
    check<IoError>(end >= 0, "cannot size '", path_, "': ", std::strerror(errno));
    return static_cast<std::uint64_t>(end);
  }
  void sync_and_close() {
    check<IoError>(::fsync(fd_) == 0, "flushing '", path_,
                   "' to disk failed: ", std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    check<IoError>(::close(fd) == 0, "closing '", path_, "' failed: ", std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_;
};

// Makes a rename into `folder` durable (fsync of the folder). A file system that cannot sync a
// folder (EINVAL, ENOTSUP: some network and FUSE file systems) or one mounted read-only says so
// without losing anything; an I/O error, a full disk or quota is an IoError, as the file's own
// fsync's would be: the rename may not outlive a crash.
inline void sync_folder(const std::filesystem::path& folder) {
  const std::filesystem::path path = folder.empty() ? std::filesystem::path(".") : folder;
  const int dir = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // A folder we may write but not read (EACCES) gives nothing to sync through; running out of
  // descriptors or memory is an error, for the rename would then go unflushed in silence.
  if (dir < 0 && (errno == EACCES || errno == EPERM)) return;
  check<IoError>(dir >= 0, "opening the folder '", path.string(),
                 "' to flush it to disk failed: ", std::strerror(errno),
                 " (a file just renamed into it may not survive a crash)");
  const int result = ::fsync(dir);
  const int error = errno;
  ::close(dir);
  check<IoError>(result == 0 || error == EINVAL || error == ENOTSUP || error == EROFS,
                 "flushing the folder '", path.string(), "' to disk failed: ", std::strerror(error),
                 " (a file just renamed into it may not survive a crash)");
}

}  // namespace detail

// One tensor as a file's header describes it: dtype, shape and the byte range of its data
// (relative to the start of the data section).
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::uint64_t begin = 0;  // data section offsets: [begin, end)
  std::uint64_t end = 0;
  std::optional<std::uint32_t> crc32 =
      std::nullopt;  // as the file records it (none: written elsewhere)
  std::uint64_t bytes() const { return end - begin; }
};

namespace detail {

inline std::string crc32_hex(std::uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

inline bool is_crc32_hex(const std::string& text) {
  return text.size() == 8 && text.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// What the header checksum covers: the tensors' places in the data section (as the current
// writer records it), or those too (as files written before 2026-12 recorded it).
enum class HeaderCrcForm { without_offsets, with_offsets };

// The CRC32 the header records of itself: over its canonical JSON (nlohmann's dump of the parsed
// object: keys sorted, no whitespace) with the header checksum key left out, so it does not
// depend on how a writer spaced or ordered the header.
inline std::uint32_t header_crc32(nlohmann::json header,
                                  HeaderCrcForm form = HeaderCrcForm::without_offsets) {
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__" && entry.is_object())
      entry.erase(std::string(kHeaderCrc32Key));
    else if (name != "__metadata__" && entry.is_object() && form == HeaderCrcForm::without_offsets)
      entry.erase("data_offsets");
  }
  const std::string canonical = header.dump();
  return crc32_of(canonical.data(), canonical.size());
}

}  // namespace detail

// Streams a safetensors file: the header (every tensor's name, dtype and shape) goes out when
// the writer is made; write() puts bytes of one tensor at an offset inside it, in any order;
// commit() checks that every byte was written exactly once, writes the checksums into the
// header (placeholders of the same width until then), flushes, and renames the file into place.
// Destroyed without commit(), the temporary file is removed and the target is untouched.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<TensorInfo> tensors,
                    const std::map<std::string, std::string>& metadata = {})
      : path_(std::move(path)),
        temporary_(path_ + ".tmp." + std::to_string(::getpid())),
        tensors_(std::move(tensors)) {
    for (const auto& [key, value] : metadata) {
      check(key.rfind(kCrc32Prefix, 0) != 0 && key != kHeaderCrc32Key, "safetensors '", path_,
            "': metadata key '", key,
            "' is reserved for the checksums the writer records itself; rename it");
      check_utf8("metadata key", key);
      check_utf8("the value of metadata key '" + key + "'", value);
    }
    header_ = nlohmann::json::object();
    auto& header = header_;
    std::uint64_t offset = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto& t = tensors_[i];
      check(!t.name.empty() && t.name != "__metadata__", "safetensors '", path_,
            "': a tensor name may be neither empty nor '__metadata__'");
      check(!header.contains(t.name), "safetensors '", path_, "': tensor name '", t.name,
            "' appears twice; names must be unique");
      check_utf8("tensor name", t.name);
      // (checked before any product: a negative dimension wrapped every offset after it, and
      // the file was written with a shape its reader refuses)
      std::uint64_t bytes = dtype_size(t.dtype);
      for (const auto dim : t.shape)
        check(dim >= 0 && !__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(dim), &bytes),
              "safetensors '", path_, "': tensor '", t.name, "' has shape ", shape_text(t.shape),
              "; dimensions must be >= 0 and their bytes fit in 64 bits");
      check(!__builtin_add_overflow(offset, bytes, &t.end), "safetensors '", path_,
            "': the tensors' bytes exceed 64 bits at '", t.name, "'");
      t.begin = offset;
      offset = t.end;
      header[t.name] = {{"dtype", std::string(detail::safetensors_dtype(t.dtype))},
                        {"shape", t.shape},
                        {"data_offsets", {t.begin, t.end}}};
      index_.emplace(t.name, i);
    }
    header["__metadata__"] = metadata;
    for (const auto& t : tensors_)
      header["__metadata__"][std::string(kCrc32Prefix) + t.name] = detail::crc32_hex(0);
    header["__metadata__"][std::string(kHeaderCrc32Key)] = detail::crc32_hex(0);
    const std::string text = header_text();
    data_start_ = 8 + text.size();
    unsigned char length_bytes[8];
    for (int i = 0; i < 8; ++i)
      length_bytes[i] = static_cast<unsigned char>(text.size() >> (8 * i));
    chunks_.resize(tensors_.size());
    file_ =
        std::make_unique<detail::PosixFile>(temporary_, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
    try {  // (a constructor that throws runs no destructor: the file would stay behind)
      file_->write_at(0, length_bytes, 8);
      file_->write_at(8, text.data(), text.size());
    } catch (...) {
      file_.reset();
      std::error_code ignored;
      std::filesystem::remove(temporary_, ignored);
      throw;
    }
  }
  ~SafetensorsWriter() {
    if (committed_) return;
    file_.reset();
    std::error_code ignored;
    std::filesystem::remove(temporary_, ignored);  // never leave a half-written file behind
  }
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  const std::string& path() const { return path_; }
  const TensorInfo& info(std::string_view name) const { return tensors_[index_of(name)]; }

  // Bytes [offset, offset + bytes) of tensor `name`'s data.
  void write(std::string_view name, std::uint64_t offset, const void* data, std::size_t bytes) {
    const std::size_t i = index_of(name);
    const TensorInfo& t = tensors_[i];
    check(offset <= t.bytes() && bytes <= t.bytes() - offset, "safetensors '", path_,
          "': writing bytes [", offset, ", ", offset + bytes, ") of tensor '", t.name,
          "', which has ", t.bytes());
    file_->write_at(data_start_ + t.begin + offset, data, bytes);
    if (bytes > 0) chunks_[i].push_back(Chunk{offset, bytes, crc32_of(data, bytes)});
  }
  void write(const NamedBytes& t) {
    const TensorInfo& target = info(t.name);
    check(t.dtype == target.dtype && t.shape == target.shape, "safetensors '", path_, "': tensor '",
          t.name, "' is ", dtype_name(t.dtype), shape_text(t.shape), " but the header says ",
          dtype_name(target.dtype), shape_text(target.shape));
    write(t.name, 0, t.bytes.data(), t.bytes.size());
  }

  // Every tensor must be complete; then flush, rename into place, and sync the folder.
  void commit() {
    check<StateError>(!committed_, "safetensors '", path_, "' was committed already");
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      std::uint64_t written = 0;
      for (const auto& c : chunks_[i]) written += c.bytes;
      check<StateError>(written == tensors_[i].bytes(), "safetensors '", path_, "': tensor '",
                        tensors_[i].name, "' got ", written, " of its ", tensors_[i].bytes(),
                        " bytes; write all of it before commit()");
    }
    // Each tensor's CRC32 from the CRCs of the pieces it arrived in (zlib combines them
    // without rereading), which must tile it exactly.
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto& chunks = chunks_[i];
      std::sort(chunks.begin(), chunks.end(),
                [](const Chunk& a, const Chunk& b) { return a.offset < b.offset; });
      std::uint64_t at = 0;
      std::uint32_t crc = 0;
      for (const auto& c : chunks) {
        check<StateError>(c.offset == at, "safetensors '", path_, "': tensor '", tensors_[i].name,
                          "' got bytes from ", c.offset, " while bytes from ", at,
                          " were missing or written twice; write each byte once");
        crc =
            static_cast<std::uint32_t>(::crc32_combine(crc, c.crc, static_cast<z_off_t>(c.bytes)));
        at += c.bytes;
      }
      header_["__metadata__"][std::string(kCrc32Prefix) + tensors_[i].name] =
          detail::crc32_hex(crc);
    }
    header_["__metadata__"][std::string(kHeaderCrc32Key)] =
        detail::crc32_hex(detail::header_crc32(header_));
    const std::string text = header_text();
    check<StateError>(8 + text.size() == data_start_, "safetensors '", path_,
                      "': the header changed size at commit()");  // (fixed-width checksums)
    file_->write_at(8, text.data(), text.size());
    file_->sync_and_close();
    std::error_code error;
    std::filesystem::rename(temporary_, path_, error);
    check<IoError>(!error, "replacing '", path_, "' with the new file failed: ", error.message());
    committed_ = true;
    // Make the rename itself durable: sync the directory that holds the file.
    detail::sync_folder(std::filesystem::path(path_).parent_path());
  }

 private:
  struct Chunk {
    std::uint64_t offset;
    std::uint64_t bytes;
    std::uint32_t crc;
  };

  std::size_t index_of(std::string_view name) const {
    const auto found = index_.find(std::string(name));
    check(found != index_.end(), "safetensors '", path_, "': no tensor '", name,
          "' in the header this writer was made with");
    return found->second;
  }
  std::string header_text() const {
    std::string text = header_.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    return text;
  }

  // JSON holds UTF-8 text only: anything else was refused by the header's dump, as a JSON
  // library's error that named neither the entry nor the file.
  void check_utf8(const std::string& what, const std::string& text) const {
    try {
      (void)nlohmann::json(text).dump();
    } catch (const nlohmann::json::exception&) {
      fail<InvalidArgument>("safetensors '", path_, "': the ", what, " is not UTF-8 text (",
                            text.size(), " bytes); give it in UTF-8");
    }
  }

  std::string path_;
  std::string temporary_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  nlohmann::json header_;
  std::vector<std::vector<Chunk>> chunks_;  // per tensor: the pieces written so far
  std::uint64_t data_start_ = 0;
  std::unique_ptr<detail::PosixFile> file_;
  bool committed_ = false;
};

// Reads a safetensors file's header, validated (every tensor's range inside the data, ranges
// tiling the data section exactly, sizes matching shapes), and any byte range of any tensor.
// A tensor with a recorded checksum is verified whole the first time any of it is read (once per
// reader; verify_all() checks every tensor up front); the checksum keys do not appear in
// metadata(): they are in each TensorInfo.
class SafetensorsReader {
 public:
  // The reference reader's limit on the header.
  static constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

  explicit SafetensorsReader(std::string path)
      : path_(std::move(path)), file_(path_, O_RDONLY | O_CLOEXEC) {
    const std::uint64_t file_size = file_.size();
    unsigned char length_bytes[8] = {};
    check<IoError>(file_size >= 8, "'", path_,
                   "' is not a safetensors file: it is shorter than its 8-byte header length");
    file_.read_at(0, length_bytes, 8, "the header length");
    std::uint64_t length = 0;
    for (int i = 0; i < 8; ++i) length |= std::uint64_t{length_bytes[i]} << (8 * i);
    check<IoError>(length <= file_size - 8 && length <= kMaxHeaderBytes, "'", path_,
                   "' is not a safetensors file or is truncated: its header claims ", length,
                   " bytes of a ", file_size, "-byte file (at most ", kMaxHeaderBytes, ")");
    std::string text(length, '\0');
    file_.read_at(8, text.data(), text.size(), "the header");
    data_start_ = 8 + length;
    parse(text, file_size - 8 - length);
    verified_ = std::make_unique<std::atomic<bool>[]>(tensors_.size());
  }

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The metadata value `key`, or an IoError saying the file lacks it (`why`: what wrote it).
  const std::string& meta(const std::string& key, std::string_view why) const {
    const auto found = metadata_.find(key);
    check<IoError>(found != metadata_.end(), "'", path_, "' lacks the metadata '", key, "': ", why);
    return found->second;
  }
  // In data (file) order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view name) const {
    const auto found = index_.find(std::string(name));
    return found == index_.end() ? nullptr : &tensors_[found->second];
  }

  // Bytes [offset, offset + bytes) of tensor `t`'s data (t from tensors() or find()), after
  // verifying its checksum.
  void read(const TensorInfo& t, std::uint64_t offset, void* data, std::size_t bytes) const {
    check(offset <= t.bytes() && bytes <= t.bytes() - offset, "'", path_, "': reading bytes [",
          offset, ", ", offset + bytes, ") of tensor '", t.name, "', which has ", t.bytes());
    const std::size_t i = index_of(t);
    const bool whole = offset == 0 && bytes == t.bytes();
    if (!whole) verify(i);
    read_raw(t, offset, data, bytes);
    if (whole && !verified_[i].load(std::memory_order_acquire)) {
      expect_checksum(t, crc32_of(data, bytes));  // (checked on the bytes just read)
      verified_[i].store(true, std::memory_order_release);
    }
  }
  NamedBytes read(const TensorInfo& t) const {
    NamedBytes out{t.name, t.dtype, t.shape, std::vector<std::byte>(t.bytes())};
    read(t, 0, out.bytes.data(), out.bytes.size());
    return out;
  }
  // Checks the checksum of every tensor that has one; returns how many had one.
  std::size_t verify_all() const {
    std::size_t checked = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      verify(i);
      checked += tensors_[i].crc32.has_value();
    }
    return checked;
  }

 private:
  // A JSON number that is a non-negative integer (the reference reads usize: no fractions,
  // no exponents, no signs), or a clear error naming the tensor and the field.
  // A parser callback refusing what the reference reader's schema refuses and a JSON parser
  // keeps the last of: a second "__metadata__", or a field named twice inside one tensor's
  // entry (two "shape"s would make two readers see two tensors). A tensor named twice is the
  // last one, as there.
  nlohmann::json::parser_callback_t refuse_duplicate_fields() const {
    struct Object {
      bool tensor_entry;  // a top-level entry other than __metadata__
      std::set<std::string> keys;
    };
    auto objects = std::make_shared<std::vector<Object>>();
    auto last_key = std::make_shared<std::string>();
    return [this, objects, last_key](int, nlohmann::json::parse_event_t event,
                                     nlohmann::json& parsed) {
      using Event = nlohmann::json::parse_event_t;
      if (event == Event::object_start) {
        objects->push_back({objects->size() == 1 && *last_key != "__metadata__", {}});
      } else if (event == Event::object_end) {
        objects->pop_back();
      } else if (event == Event::key && !objects->empty()) {
        *last_key = parsed.get<std::string>();
        Object& object = objects->back();
        const bool checked = (objects->size() == 1 && *last_key == "__metadata__") ||
                             (objects->size() == 2 && object.tensor_entry);
        check<IoError>(!checked || object.keys.insert(*last_key).second, "'", path_,
                       "': the header names '", *last_key, "' twice",
                       objects->size() == 1 ? "" : " in one tensor's entry",
                       ", which the safetensors format forbids (a damaged or hand-made header)");
      }
      return true;
    };
  }

  std::uint64_t unsigned_field(const nlohmann::json& value, const std::string& tensor,
                               const char* field) const {
    // (-0 parses as a signed integer that prints as 0: said as written)
    const bool negative_zero =
        value.is_number_integer() && !value.is_number_unsigned() && value.get<std::int64_t>() == 0;
    check<IoError>(value.is_number_unsigned(), "'", path_, "': tensor '", tensor, "' has ", field,
                   " entry ", negative_zero ? std::string("-0") : value.dump(),
                   ", which is not a non-negative integer");
    return value.get<std::uint64_t>();
  }

  std::size_t index_of(const TensorInfo& t) const {
    const auto found = index_.find(t.name);
    check(found != index_.end(), "'", path_, "' has no tensor '", t.name, "'");
    return found->second;
  }
  void read_raw(const TensorInfo& t, std::uint64_t offset, void* data, std::size_t bytes) const {
    file_.read_at(data_start_ + t.begin + offset, data, bytes, "tensor '" + t.name + "'");
  }
  void expect_checksum(const TensorInfo& t, std::uint32_t crc) const {
    check<IoError>(!t.crc32 || *t.crc32 == crc, "'", path_, "': tensor '", t.name,
                   "' is corrupt: its data's CRC32 is ", detail::crc32_hex(crc),
                   " but the file records ", detail::crc32_hex(t.crc32.value_or(0)),
                   " (a damaged copy or a failing disk: load another checkpoint; or the file was "
                   "rewritten with changed values by a tool that kept shardkit's checksum keys: "
                   "remove the '",
                   kCrc32Prefix, "*' and '", kHeaderCrc32Key, "' metadata from it)");
  }
  // Reads tensor i whole in bounded chunks and checks its checksum (once per reader).
  void verify(std::size_t i) const {
    const TensorInfo& t = tensors_[i];
    if (!t.crc32 || verified_[i].load(std::memory_order_acquire)) return;
    constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;
    std::vector<unsigned char> buffer(static_cast<std::size_t>(std::min(kChunk, t.bytes())));
    std::uint32_t crc = 0;
    for (std::uint64_t at = 0; at < t.bytes(); at += kChunk) {
      const auto n = static_cast<std::size_t>(std::min(kChunk, t.bytes() - at));
      read_raw(t, at, buffer.data(), n);
      crc = crc32_of(buffer.data(), n, crc);
    }
    expect_checksum(t, crc);
    verified_[i].store(true, std::memory_order_release);
  }

  void parse(const std::string& text, std::uint64_t data_size) {
    // As the reference reader: JSON with no byte-order mark (nlohmann would skip one) and no
    // NUL byte (nlohmann would stop at one), whitespace around it allowed (writers pad with
    // spaces).
    check<IoError>(text.rfind("\xEF\xBB\xBF", 0) != 0, "'", path_,
                   "': the header starts with a UTF-8 byte-order mark, which safetensors forbids");
    check<IoError>(text.find('\0') == std::string::npos, "'", path_,
                   "': the header holds a NUL byte at ", text.find('\0'),
                   " (pad a header with spaces)");
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text, refuse_duplicate_fields());
    } catch (const nlohmann::json::exception& e) {
      fail<IoError>("'", path_, "' has a header that is not valid JSON: ", e.what());
    }
    check<IoError>(header.is_object(), "'", path_, "': the header is not a JSON object");
    std::map<std::string, std::string> checksums;  // tensor -> recorded CRC32 (hex)
    std::optional<std::string> header_checksum;    // the header's own recorded CRC32 (hex)
    for (const auto& [name, entry] : header.items()) {
      try {
        if (name == "__metadata__") {
          // The schema's one optional field: absent or null both mean "no metadata".
          if (entry.is_null()) continue;
          check<IoError>(entry.is_object(), "'", path_,
                         "': __metadata__ is not a map of strings to strings (or null)");
          for (const auto& [key, value] : entry.items()) {
            check<IoError>(value.is_string(), "'", path_, "': __metadata__ '", key, "' is ",
                           value.dump(), ", not a string");
            if (key == kHeaderCrc32Key)
              header_checksum = value.get<std::string>();
            else if (key.rfind(kCrc32Prefix, 0) == 0)
              checksums[key.substr(kCrc32Prefix.size())] = value.get<std::string>();
            else
              metadata_[key] = value.get<std::string>();
          }
          continue;
        }
        check<IoError>(entry.is_object(), "'", path_, "': tensor '", name,
                       "' is not described by an object");
        TensorInfo t;
        t.name = name;
        const auto& dtype = entry.at("dtype");
        check<IoError>(dtype.is_string(), "'", path_, "': tensor '", name, "' has dtype ",
                       dtype.dump(), ", not a string such as \"F32\"");
        t.dtype = detail::dtype_from_safetensors(dtype.get<std::string>(), path_, name);
        const auto& shape = entry.at("shape");
        check<IoError>(shape.is_array(), "'", path_, "': tensor '", name,
                       "' has a shape that is not a list");
        // The element count, then the bytes, each checked before it can wrap: in the reference
        // reader's order, so a shape with a 0 after huge sizes holds no bytes rather than
        // overflowing.
        std::uint64_t count = 1;
        for (const auto& d : shape) {
          const std::uint64_t dim = unsigned_field(d, name, "shape");
          check<IoError>(dim <= static_cast<std::uint64_t>(INT64_MAX), "'", path_, "': tensor '",
                         name, "' has dimension ", dim, ", beyond what shardkit's shapes hold");
          t.shape.push_back(static_cast<std::int64_t>(dim));
          check<IoError>(!__builtin_mul_overflow(count, dim, &count), "'", path_, "': tensor '",
                         name, "' has shape ", shape.dump(),
                         " whose element count overflows 64 bits");
        }
        std::uint64_t bytes = 0;
        check<IoError>(!__builtin_mul_overflow(count, dtype_size(t.dtype), &bytes), "'", path_,
                       "': tensor '", name, "' has shape ", shape.dump(),
                       " whose byte count overflows 64 bits");
        const auto& offsets = entry.at("data_offsets");
        check<IoError>(offsets.is_array() && offsets.size() == 2, "'", path_, "': tensor '", name,
                       "' has data_offsets ", offsets.dump(), "; expected [begin, end]");
        t.begin = unsigned_field(offsets[0], name, "data_offsets");
        t.end = unsigned_field(offsets[1], name, "data_offsets");
        check<IoError>(t.begin <= t.end && t.end <= data_size, "'", path_, "': tensor '", name,
                       "' has data_offsets outside the ", data_size, "-byte data section ([",
                       t.begin, ", ", t.end, "]; truncated file?)");
        check<IoError>(t.bytes() == bytes, "'", path_, "': tensor '", name, "' covers ", t.bytes(),
                       " bytes but its shape ", shape_text(t.shape), " of ", dtype_name(t.dtype),
                       " needs ", bytes);
        tensors_.push_back(std::move(t));
      } catch (const nlohmann::json::exception& e) {  // (a missing field: at() names it)
        fail<IoError>("'", path_, "': the header's entry '", name, "' is malformed: ", e.what());
      }
    }
    // The format forbids overlaps and holes: the ranges must tile the data section exactly.
    // (Zero-size tensors sort before a neighbour at the same offset.)
    std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    std::uint64_t expected = 0;
    for (const auto& t : tensors_) {
      check<IoError>(t.begin == expected, "'", path_, "': tensor '", t.name, "' starts at byte ",
                     t.begin, " of the data, expected ", expected,
                     " (overlapping or holed data section)");
      expected = t.end;
    }
    check<IoError>(expected == data_size, "'", path_, "': the tensors cover ", expected, " of ",
                   data_size, " data bytes");
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
    for (const auto& [name, hex] : checksums) {
      const auto found = index_.find(name);
      check<IoError>(found != index_.end(), "'", path_, "' records a checksum for tensor '", name,
                     "', which it does not hold");
      check<IoError>(detail::is_crc32_hex(hex), "'", path_, "': the checksum of tensor '", name,
                     "' is '", hex, "', not 8 lowercase hex digits");
      tensors_[found->second].crc32 = static_cast<std::uint32_t>(std::stoul(hex, nullptr, 16));
    }
    // Last, so that a damaged header still meets the structural checks above first. The writer
    // records the header checksum beside the tensors' ones, so a file with tensor checksums but
    // no header checksum has a damaged key (a flipped bit in "shardkit.header_crc32" would
    // otherwise turn it into plain metadata and switch the check off).
    check<IoError>(header_checksum.has_value() || checksums.empty(), "'", path_,
                   "' records tensor checksums but no header checksum '", kHeaderCrc32Key,
                   "': the header is corrupt (a damaged copy or a failing disk: load another "
                   "checkpoint)");
    if (header_checksum) {
      check<IoError>(detail::is_crc32_hex(*header_checksum), "'", path_, "': the header checksum '",
                     kHeaderCrc32Key, "' is '", *header_checksum, "', not 8 lowercase hex digits");
      const std::uint32_t crc = detail::header_crc32(header);
      check<IoError>(
          detail::crc32_hex(crc) == *header_checksum ||
              detail::crc32_hex(detail::header_crc32(
                  header, detail::HeaderCrcForm::with_offsets)) == *header_checksum,
          "'", path_, "': the header is corrupt: its CRC32 is ", detail::crc32_hex(crc),
          " but the file records ", *header_checksum,
          " (a changed tensor name, dtype, shape or metadata value: a damaged copy or a failing "
          "disk: load another checkpoint; or a tool that kept shardkit's checksum keys changed "
          "the header: remove the '",
          kCrc32Prefix, "*' and '", kHeaderCrc32Key, "' metadata from it)");
    }
  }

  std::string path_;
  detail::PosixFile file_;
  std::uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::unique_ptr<std::atomic<bool>[]> verified_;  // per tensor, in tensors() order
};

// Writes `tensors` (names unique) and string `metadata` to `path`, atomically.
inline void save_safetensors(const std::string& path, const std::vector<NamedBytes>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  std::vector<TensorInfo> infos;
  for (const auto& t : tensors) {
    check(static_cast<std::int64_t>(t.bytes.size()) ==
              shape_numel(t.shape) * static_cast<std::int64_t>(dtype_size(t.dtype)),
          "save_safetensors '", path, "': tensor '", t.name, "' has ", t.bytes.size(),
          " bytes for shape ", shape_text(t.shape), " of ", dtype_name(t.dtype));
    infos.push_back(TensorInfo{t.name, t.dtype, t.shape});
  }
  SafetensorsWriter writer(path, std::move(infos), metadata);
  for (const auto& t : tensors) writer.write(t);
  writer.commit();
}

inline SafetensorsContents load_safetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  SafetensorsContents out;
  out.metadata = reader.metadata();
  for (const auto& t : reader.tensors()) out.tensors.push_back(reader.read(t));
  return out;
}

}  // namespace shardkit::checkpoint
