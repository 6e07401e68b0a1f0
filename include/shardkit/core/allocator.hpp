// The Allocator interface (every allocation is counted in MemoryStats) and the host allocator.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "shardkit/core/device.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/memory_stats.hpp"

namespace shardkit {

class Allocator {
 public:
  virtual ~Allocator() = default;

  virtual Device device() const = 0;

  // Returns nullptr for 0 bytes (and counts nothing); throws OutOfMemory on failure.
  void* allocate(std::size_t bytes, MemoryCategory category) {
    if (bytes == 0) return nullptr;
    void* pointer = do_allocate(bytes);
    if (pointer == nullptr)
      fail<OutOfMemory>("out of memory on ", device().str(), ": could not allocate ", bytes,
                        " bytes for ", memory_category_name(category), " while ",
                        stats_.current_total(), " bytes were in use (peak ", stats_.peak_total(),
                        "); lower the batch or bucket size, or shard more (a higher ZeRO stage)");
    stats_.on_allocate(category, bytes);
    return pointer;
  }

  // `bytes` and `category` must be those given to allocate().
  void deallocate(void* pointer, std::size_t bytes, MemoryCategory category) noexcept {
    if (pointer == nullptr) return;
    do_deallocate(pointer, bytes);
    stats_.on_free(category, bytes);
  }

  MemoryStats& stats() { return stats_; }
  const MemoryStats& stats() const { return stats_; }

 protected:
  virtual void* do_allocate(std::size_t bytes) = 0;  // nullptr when out of memory
  virtual void do_deallocate(void* pointer, std::size_t bytes) noexcept = 0;

 private:
  MemoryStats stats_;
};

// Host memory aligned to 64 bytes: a cache line, and enough for any SIMD load width.
//
// Large blocks (>= 1 MiB, sizes rounded up to 64 KiB) are cached when freed and handed out
// again for the same rounded size: a training step allocates the same buffers every time
// (activations, FSDP's gathered units, gradient buckets), and returning them to the system
// each time costs a page fault per 4 KiB page when they come back -- about 10% of a ResNet-18
// FSDP step on the CPU. At most `max_cached_bytes` stay cached (beyond that, frees go to the
// system); release_cached() gives them all back. The memory statistics count what is in use,
// not what is cached.
class HostAllocator final : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kCachedFrom = std::size_t{1} << 20;
  static constexpr std::size_t kGranule = std::size_t{64} << 10;

  explicit HostAllocator(std::size_t max_cached_bytes = std::size_t{2} << 30)
      : max_cached_(max_cached_bytes) {}
  ~HostAllocator() override { release_cached(); }
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

  Device device() const override { return Device::cpu(); }

  // Returns every cached block to the system.
  void release_cached() noexcept {
    std::lock_guard lock(mutex_);
    for (auto& [size, pointer] : cache_) ::operator delete (pointer, std::align_val_t{kAlignment});
    cache_.clear();
    cached_ = 0;
  }
  std::size_t cached_bytes() const {
    std::lock_guard lock(mutex_);
    return cached_;
  }

 protected:
  void* do_allocate(std::size_t bytes) override {
    if (bytes >= kCachedFrom) {
      const std::size_t size = rounded(bytes);
      {
        std::lock_guard lock(mutex_);
        const auto found = cache_.find(size);
        if (found != cache_.end()) {
          void* pointer = found->second;
          cache_.erase(found);
          cached_ -= size;
          return pointer;
        }
      }
      return ::operator new (size, std::align_val_t{kAlignment}, std::nothrow);
    }
    return ::operator new (bytes, std::align_val_t{kAlignment}, std::nothrow);
  }
  void do_deallocate(void* pointer, std::size_t bytes) noexcept override {
    if (bytes >= kCachedFrom) {
      const std::size_t size = rounded(bytes);
      std::lock_guard lock(mutex_);
      if (cached_ + size <= max_cached_) {
        try {
          cache_.emplace(size, pointer);
          cached_ += size;
          return;
        } catch (...) {  // no room for the bookkeeping: free it instead
        }
      }
    }
    ::operator delete (pointer, std::align_val_t{kAlignment});
  }

 private:
  static std::size_t rounded(std::size_t bytes) {
    return (bytes + kGranule - 1) / kGranule * kGranule;
  }

  std::size_t max_cached_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cache_;  // rounded size -> free block
  std::size_t cached_ = 0;
};

}  // namespace shardkit
