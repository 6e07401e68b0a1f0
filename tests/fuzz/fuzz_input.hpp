// What the fuzz targets share: the input as a file (the readers take paths), and the rule that
// separates a finding from a refusal.
//
// A target hands libFuzzer's bytes to a reader as an in-memory file (memfd_create: no disk, no
// leftovers) named /proc/self/fd/N. A reader may refuse the input only with one of shardkit's
// typed errors (shardkit::Error and its kinds); anything else that escapes, a crash, or a
// sanitizer report is a finding.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace fuzz {

class MemoryFile {
 public:
  MemoryFile(const void* data, std::size_t size) : fd_(::memfd_create("fuzz-input", MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();  // the harness itself failed: not the reader's finding
    const auto* from = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t wrote = ::write(fd_, from, size);
      if (wrote <= 0) std::abort();
      from += wrote;
      size -= static_cast<std::size_t>(wrote);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;

  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

}  // namespace fuzz
