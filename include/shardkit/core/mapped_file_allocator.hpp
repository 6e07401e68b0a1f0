// MappedFileAllocator: host memory backed by files on a fast disk (NVMe) -- what lets the
// optimizer's state outgrow RAM (DeepSpeed's ZeRO-Infinity, offload_optimizer device "nvme").
// Each allocation is an unnamed file in the given directory (O_TMPFILE: gone with the process,
// crash or not), its space reserved at once (posix_fallocate: a full disk fails the allocation
// by name, not a later write), mapped shared into the address space: the kernel pages it in on
// use and writes it back, and what touches it sees ordinary memory (the fused CPU functors,
// checkpoints).
//
// The page cache would still hold everything touched. A user that streams through its memory in
// chunks (optim/state_spill.hpp) loads the range that comes next (on a thread of its own, beside
// the work on the current chunk) and spills the range it is done with (written back and dropped
// from RAM), so RAM holds a few chunks, not the whole.
//
// Counted like any allocator (MemoryStats): its ledger is the disk's. Linux only.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/error.hpp"

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace shardkit {

class MappedFileAllocator : public Allocator {
 public:
  // `directory`: where the files go (a fast local disk; must exist and be writable).
  explicit MappedFileAllocator(std::string directory) : directory_(std::move(directory)) {
#if defined(__linux__)
    struct stat info {};
    const bool found = ::stat(directory_.c_str(), &info) == 0;
    check(found && S_ISDIR(info.st_mode), "offload to disk: '", directory_,
          "' is not a directory (", found ? "it is a file" : std::strerror(errno),
          "); give an existing directory on a fast local disk (nvme_path)");
    check(::access(directory_.c_str(), W_OK) == 0, "offload to disk: '", directory_,
          "' is not writable by this process; give a directory it can write (nvme_path)");
    page_ = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
#else
    fail("offload to disk (MappedFileAllocator) needs Linux; offload to host memory instead");
#endif
  }
  ~MappedFileAllocator() override = default;

  Device device() const override { return Device::cpu(); }
  const std::string& directory() const { return directory_; }

  // Brings [data, data + bytes) of an allocation into RAM, mapped for writing (or for reading
  // only: `for_writing` false, its pages then stay clean and are not written back), and returns
  // once it is there: a streaming user calls it on a thread of its own, beside its work on the
  // range before (optim/state_spill.hpp). MADV_POPULATE_WRITE / _READ (Linux 5.14) read the
  // range in large requests and map every page at once; touching the range instead faults each
  // 4-KiB page in turn, twice when written (read in, then marked dirty), which made offload to
  // NVMe run at a third of the disk's pace (docs/performance.md). A kernel without them starts
  // the read-ahead instead (MADV_WILLNEED) and returns.
  void load(const void* data, std::size_t bytes, bool for_writing = true) const {
#if defined(__linux__)
    const auto [begin, end] = pages_around(data, bytes);
    if (begin >= end) return;
    check_not_failed(failure_at(begin));
    void* const at = reinterpret_cast<void*>(begin);
    if (populate_.load(std::memory_order_relaxed)) {
      int error = 0;
      do {  // (EINTR: a fatal signal is pending; EAGAIN: a transient shortage -- both retried)
        error = ::madvise(at, end - begin, for_writing ? kPopulateWrite : kPopulateRead) == 0
                    ? 0
                    : errno;
      } while (error == EINTR || error == EAGAIN);
      if (error == 0) return;
      // The file could not be read (the access would have raised SIGBUS): the state is lost.
      check<IoError>(!read_failed(error), "offload to disk: reading ", end - begin,
                     " bytes back from a file in '", directory_, "' failed (", std::strerror(error),
                     "); the disk is failing");
      // Anything else is not the disk's fault. A kernel older than 5.14 or a sandbox that forbids
      // the advice (EINVAL, EPERM): from now on the pages are faulted in as before. A shortage
      // of memory (ENOMEM, likely where RAM is tight -- why state is offloaded to disk): this
      // range only, so that a later failing read still raises IoError rather than SIGBUS.
      if (error == EINVAL || error == EPERM) populate_.store(false, std::memory_order_relaxed);
    }
    ::madvise(at, end - begin, MADV_WILLNEED);
#else
    (void)data;
    (void)bytes;
    (void)for_writing;
#endif
  }

  // load() of each of `ranges` in turn, on a thread of its own: the future is ready once they
  // are in RAM (or holds load()'s IoError). The allocator and the ranges' allocations must
  // outlive it. What streaming users start beside their work on the range before.
  std::future<void> start_loading(std::vector<std::pair<const void*, std::size_t>> ranges,
                                  bool for_writing) const {
    return std::async(std::launch::async, [this, ranges = std::move(ranges), for_writing] {
      for (const auto& [data, bytes] : ranges) load(data, bytes, for_writing);
    });
  }

  // Whether load() returns with the range in RAM (MADV_POPULATE_* works here: not known to be
  // refused yet); otherwise it only starts the read-ahead.
  bool loads_whole() const { return populate_.load(std::memory_order_relaxed); }

  // Writes [data, data + bytes) back to its file and drops it from RAM (the pages it touches: a
  // page it shares with a neighbouring range is dropped too, and read again when that range is
  // used -- its data is never lost, a shared mapping's dirty pages go to the file). `wait`:
  // return only once it is on disk and out of RAM; otherwise unmap the pages and only start
  // their write-back (a later spill with wait finishes it and drops them from the page cache).
  void spill(const void* data, std::size_t bytes, bool wait) const {
#if defined(__linux__)
    const FileRange r = usable_range(data, bytes);
    if (r.empty()) return;
    // Unmap the pages from this process first (their dirty state goes to the page cache): at
    // once, with one TLB flush for the range, and so the write-back finds them unmapped. A
    // write-back of pages still mapped write-protects them one at a time -- on a process whose
    // threads run on other cores, a TLB flush on each of them per page: it took a third of a
    // small model's training time here -- and the next write to each page faults.
    ::madvise(reinterpret_cast<void*>(r.begin), r.end - r.begin, MADV_DONTNEED);
    if (!wait) {
      ::sync_file_range(r.mapping.fd, r.offset(), r.length(), SYNC_FILE_RANGE_WRITE);
      return;
    }
    sync_range(r, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    ::posix_fadvise(r.mapping.fd, r.offset(), r.length(), POSIX_FADV_DONTNEED);
#endif
  }

  // Raises a write-back of [data, data + bytes)'s file that failed since the last check (the
  // kernel's own flusher writes dirty pages back after a while), marking the file failed as
  // spill() does; waits for a write-back of the range in flight, starts none, and leaves the
  // pages mapped and in RAM. What a range kept in RAM from step to step (a state of one chunk:
  // optim/state_spill.hpp) is checked with, where no spill of it ever waits.
  void check_write_back(const void* data, std::size_t bytes) const {
#if defined(__linux__)
    const FileRange r = usable_range(data, bytes);
    if (!r.empty()) sync_range(r, SYNC_FILE_RANGE_WAIT_BEFORE);
#else
    (void)data;
    (void)bytes;
#endif
  }

  // Drops [data, data + bytes) from RAM where its pages are clean -- read, not written, since
  // they came in (a gather's read of a parameter shard): unmapped from this process and out of
  // the page cache. A dirty page stays until its write-back (nothing is lost); nothing waits,
  // and no write-back error of the file is taken here (the next spill() that waits reports it).
  void drop_clean(const void* data, std::size_t bytes) const {
#if defined(__linux__)
    const auto [begin, end] = pages_around(data, bytes);
    if (begin >= end) return;
    const Mapping& m = mapping_of(reinterpret_cast<const void*>(begin));
    if (m.failed != 0) return;  // (kept: its pages may be the only copy; spill() reports it)
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
    ::posix_fadvise(m.fd, static_cast<off_t>(begin - m.base), static_cast<off_t>(end - begin),
                    POSIX_FADV_DONTNEED);
#else
    (void)data;
    (void)bytes;
#endif
  }

  // Fault injection for tests: the next spill() that waits, or check_write_back(), fails with
  // `error` (EIO, say) as if the file's write-back had -- a disk failure no test machine can
  // produce on demand.
  void inject_write_back_error(int error) const { injected_write_back_error_.store(error); }

  // The page size: what load(), spill() and the residency figures round ranges out to.
  std::size_t page_bytes() const { return page_; }

  // Bytes of the whole pages around [data, data + bytes) not in RAM now: what a load() of it
  // must read from the file.
  std::size_t missing_bytes(const void* data, std::size_t bytes) const {
    const auto [begin, end] = pages_around(data, bytes);
    return begin >= end ? 0 : end - begin - resident_bytes(data, bytes);
  }

  // Bytes of [data, data + bytes) in RAM now (whole pages; mincore): what spill() bounds.
  std::size_t resident_bytes(const void* data, std::size_t bytes) const {
    std::size_t pages = 0;
    for (unsigned char c : in_core(data, bytes)) pages += c & 1u;
    return pages * page_;
  }

  // The runs of whole pages around [data, data + bytes) not in RAM now: what a load() of the
  // range reads, and what a user that only passes through the range (a gather's upload of a
  // parameter shard) spills again after it, leaving RAM as it found it.
  std::vector<std::pair<const void*, std::size_t>> missing_runs(const void* data,
                                                                std::size_t bytes) const {
    const auto pages = in_core(data, bytes);
    const auto begin = pages_around(data, bytes).first;
    std::vector<std::pair<const void*, std::size_t>> runs;
    for (std::size_t i = 0; i < pages.size();) {
      if ((pages[i] & 1u) != 0) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < pages.size() && (pages[j] & 1u) == 0) ++j;
      runs.emplace_back(reinterpret_cast<const void*>(begin + i * page_), (j - i) * page_);
      i = j;
    }
    return runs;
  }

 protected:
  void* do_allocate(std::size_t bytes) override {
#if defined(__linux__)
    int fd = ::open(directory_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {  // (a file system without O_TMPFILE: a named file, unlinked at once -- a
                   // crash between the two would leave it behind)
      std::string name = directory_ + "/shardkit-state-XXXXXX";
      fd = ::mkostemp(name.data(), O_CLOEXEC);
      if (fd >= 0) ::unlink(name.c_str());
    }
    check(fd >= 0, "offload to disk: cannot create a file in '", directory_, "' (",
          std::strerror(errno), "); give a writable directory on a local disk (nvme_path)");
    // The disk space is reserved now: a sparse file would take its blocks at the first write
    // through the mapping, and a full disk would then kill the process (SIGBUS) instead of
    // failing here by name.
    int error = 0;
    do {  // (EINTR: a signal arrived while tmpfs reserved -- not a full disk; tried again)
      error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    } while (error == EINTR);
    if (error == EOPNOTSUPP || error == EINVAL)  // (a file system that cannot reserve)
      error = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (error != 0) {
      ::close(fd);
      fail<OutOfMemory>("offload to disk: cannot reserve ", bytes, " bytes in '", directory_, "' (",
                        std::strerror(error),
                        "); free space there or give a directory on a larger disk (nvme_path)");
    }
    void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      error = errno;
      ::close(fd);
      fail<OutOfMemory>("offload to disk: cannot map a file of ", bytes, " bytes from '",
                        directory_, "' (", std::strerror(error),
                        "); the address space or the map count (vm.max_map_count) is exhausted");
    }
    try {
      std::lock_guard lock(mutex_);
      mappings_[reinterpret_cast<std::uintptr_t>(data)] = Mapping{fd, bytes};
    } catch (...) {
      ::munmap(data, bytes);
      ::close(fd);
      throw;
    }
    return data;
#else
    (void)bytes;
    return nullptr;
#endif
  }

  void do_deallocate(void* data, std::size_t bytes) noexcept override {
#if defined(__linux__)
    int fd = -1;
    {  // (forgotten before the unmap: the address may be handed out again at once)
      std::lock_guard lock(mutex_);
      const auto it = mappings_.find(reinterpret_cast<std::uintptr_t>(data));
      if (it != mappings_.end()) {
        fd = it->second.fd;
        mappings_.erase(it);
      }
    }
    ::munmap(data, bytes);
    if (fd >= 0) ::close(fd);  // (the unnamed file goes with its last descriptor)
#else
    (void)data;
    (void)bytes;
#endif
  }

 private:
  struct Mapping {
    int fd = -1;
    std::size_t bytes = 0;
    std::uintptr_t base = 0;
    // errno of the file's first failed write-back (sticky: see spill()); set under mutex_ by
    // the const spill(), as the allocator's own bookkeeping
    mutable int failed = 0;
  };

  // The whole pages around [data, data + bytes) in their file (empty: no page), whose
  // write-back must not have failed before; its mapping as it was then (a copy).
  struct FileRange {
    Mapping mapping;
    std::uintptr_t begin = 0, end = 0;
    bool empty() const { return begin >= end; }
    off_t offset() const { return static_cast<off_t>(begin - mapping.base); }
    off_t length() const { return static_cast<off_t>(end - begin); }
  };
  FileRange usable_range(const void* data, std::size_t bytes) const {
    const auto [begin, end] = pages_around(data, bytes);
    if (begin >= end) return {};
    const Mapping m = mapping_of(reinterpret_cast<const void*>(begin));
    check_not_failed(m.failed);
    return {m, begin, end};
  }

#if defined(__linux__)
  // sync_file_range over a file's range with `flags`; its error -- or one injected -- is the
  // file's for good. Linux reports a file's failed write-back once, and may leave the pages
  // that failed clean: dropped later, they would read back as what the disk held before --
  // training on silently. So the file is marked: every later spill() and load() of it fails
  // too, and nothing of it is dropped from the page cache.
  void sync_range(const FileRange& r, unsigned flags) const {
    int error = injected_write_back_error_.exchange(0);
    if (error == 0 && ::sync_file_range(r.mapping.fd, r.offset(), r.length(), flags) != 0)
      error = errno;
    if (error == 0) return;
    mark_failed(r.mapping.base, error);
    fail<IoError>("offload to disk: writing back ", r.length(), " bytes to a file in '", directory_,
                  "' failed (", std::strerror(error),
                  "); the state in that file is lost -- resume from the last checkpoint");
  }
#endif

  void mark_failed(std::uintptr_t base, int error) const {
    std::lock_guard lock(mutex_);
    const auto it = mappings_.find(base);
    if (it != mappings_.end() && it->second.failed == 0) it->second.failed = error;
  }
  // The failure marked on the file that holds `address` (0: none, or not one of its files).
  int failure_at(std::uintptr_t address) const {
    std::lock_guard lock(mutex_);
    auto it = mappings_.upper_bound(address);
    if (it == mappings_.begin()) return 0;
    --it;
    return address < it->first + it->second.bytes ? it->second.failed : 0;
  }
  void check_not_failed(int failed) const {
    if (failed == 0) return;
    fail<IoError>("offload to disk: a write-back to a file in '", directory_, "' failed earlier (",
                  std::strerror(failed),
                  "); the kernel may since have dropped pages that never reached the disk, so the "
                  "state in that file is lost -- resume from the last checkpoint");
  }

  // Whether MADV_POPULATE_* failed because the file's data could not be read.
  static bool read_failed(int error) {
#if defined(EHWPOISON)
    if (error == EHWPOISON) return true;
#endif
    return error == EFAULT;
  }

  // The mapping that holds `address` (with its base filled in).
  Mapping mapping_of(const void* address) const {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    std::lock_guard lock(mutex_);
    auto it = mappings_.upper_bound(at);
    check(it != mappings_.begin(), "MappedFileAllocator: address not in any of its files");
    --it;
    check(at < it->first + it->second.bytes,
          "MappedFileAllocator: address not in any of its files");
    Mapping m = it->second;
    m.base = it->first;
    return m;
  }
  // Per whole page around [data, data + bytes): whether it is in RAM (bit 0; mincore).
  std::vector<unsigned char> in_core(const void* data, std::size_t bytes) const {
#if defined(__linux__)
    const auto [begin, end] = pages_around(data, bytes);
    if (begin >= end) return {};
    std::vector<unsigned char> pages((end - begin) / page_);
    check(::mincore(reinterpret_cast<void*>(begin), end - begin, pages.data()) == 0,
          "mincore failed: ", std::strerror(errno));
    return pages;
#else
    (void)data;
    (void)bytes;
    return {};
#endif
  }
  // [data, data + bytes) rounded out to whole pages (inside the mapping: it is whole pages).
  std::pair<std::uintptr_t, std::uintptr_t> pages_around(const void* data,
                                                         std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    return {at / page_ * page_, (at + bytes + page_ - 1) / page_ * page_};
  }

#if defined(MADV_POPULATE_WRITE)
  static constexpr int kPopulateRead = MADV_POPULATE_READ;
  static constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else  // (C library headers older than the kernel: the values are Linux's ABI)
  static constexpr int kPopulateRead = 22;
  static constexpr int kPopulateWrite = 23;
#endif

  std::string directory_;
  std::size_t page_ = 4096;
  mutable std::atomic<bool> populate_{true};  // MADV_POPULATE_* known to the kernel
  mutable std::mutex mutex_;
  mutable std::atomic<int> injected_write_back_error_{0};
  std::map<std::uintptr_t, Mapping> mappings_;  // by base address
};

}  // namespace shardkit
