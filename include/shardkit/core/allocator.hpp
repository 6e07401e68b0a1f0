// The Allocator interface (every allocation is counted in MemoryStats) and the host allocator.
#pragma once

#include <cstddef>
#include <memory>
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
class HostAllocator final : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;

  Device device() const override { return Device::cpu(); }

 protected:
  void* do_allocate(std::size_t bytes) override {
    return ::operator new(bytes, std::align_val_t{kAlignment}, std::nothrow);
  }
  void do_deallocate(void* pointer, std::size_t) noexcept override {
    ::operator delete(pointer, std::align_val_t{kAlignment});
  }
};

}  // namespace shardkit
