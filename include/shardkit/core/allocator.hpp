// The Allocator interface (every allocation is counted in MemoryStats) and the host allocator.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "shardkit/core/capture_pool.hpp"
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
    void* pointer = pools_.load(std::memory_order_acquire) != 0 ? allocate_with_pools(bytes)
                                                                : do_allocate(bytes);
    if (pointer == nullptr)
      fail<OutOfMemory>("out of memory on ", device(), ": could not allocate ", bytes,
                        " bytes for ", memory_category_name(category), " while ",
                        stats_.current_total(), " bytes were in use (peak ", stats_.peak_total(),
                        "); lower the batch or bucket size, or shard more (a higher ZeRO stage)");
    stats_.on_allocate(category, bytes);
    return pointer;
  }

  // `bytes` and `category` must be those given to allocate().
  void deallocate(void* pointer, std::size_t bytes, MemoryCategory category) noexcept {
    if (pointer == nullptr) return;
    if (pools_.load(std::memory_order_acquire) == 0 || !deallocate_with_pools(pointer, bytes))
      do_deallocate(pointer, bytes);
    stats_.on_free(category, bytes);
  }

  MemoryStats& stats() { return stats_; }
  const MemoryStats& stats() const { return stats_; }

  // Step capture (capture_pool.hpp, step_graph.hpp): until end_capture(), allocations come from
  // `pool` and frees of other memory are held in it. The pool stays registered -- its blocks
  // going back to it -- until retire().
  void begin_capture(const std::shared_ptr<CapturePool>& pool) {
    std::lock_guard lock(pool_mutex_);
    check<StateError>(capturing_ == nullptr, "allocator of ", device(),
                      ": a capture is already under way; captures do not nest");
    if (std::find(registered_.begin(), registered_.end(), pool) == registered_.end())
      registered_.push_back(pool);
    capturing_ = pool;
    pools_.store(static_cast<int>(registered_.size()), std::memory_order_release);
  }
  void end_capture() noexcept {
    std::lock_guard lock(pool_mutex_);
    capturing_ = nullptr;
    // Blocks of retired pools freed during the capture go back now (see release_retired).
    for (std::size_t i = registered_.size(); i-- > 0;)
      if (registered_[i]->retired_) release_retired(registered_[i]);
  }
  // The pool's graph is gone: its free blocks and held memory go back to the device, the blocks
  // still in use as their tensors are freed.
  void retire(const std::shared_ptr<CapturePool>& pool) noexcept {
    std::lock_guard lock(pool_mutex_);
    if (capturing_ == pool) capturing_ = nullptr;
    pool->retired_ = true;
    release_retired(pool);
  }

 protected:
  virtual void* do_allocate(std::size_t bytes) = 0;  // nullptr when out of memory
  virtual void do_deallocate(void* pointer, std::size_t bytes) noexcept = 0;
  // A capture pool's block: memory that is no operation of the captured stream (a CUDA
  // allocator's stream-ordered allocation would become a node of the graph). Default: as any.
  virtual void* do_allocate_reserved(std::size_t bytes) { return do_allocate(bytes); }
  virtual void do_deallocate_reserved(void* pointer, std::size_t bytes) noexcept {
    do_deallocate(pointer, bytes);
  }

 private:
  void* allocate_with_pools(std::size_t bytes) {
    std::lock_guard lock(pool_mutex_);
    if (capturing_ == nullptr) return do_allocate(bytes);
    if (void* pointer = capturing_->take(bytes)) return pointer;
    void* pointer = do_allocate_reserved(bytes);
    if (pointer != nullptr) capturing_->add(pointer, bytes);
    return pointer;
  }
  // Whether a pool took `pointer` (its block, or memory held for the capture under way).
  bool deallocate_with_pools(void* pointer, std::size_t bytes) noexcept {
    std::lock_guard lock(pool_mutex_);
    for (const auto& pool : registered_) {
      if (!pool->give_back(pointer)) continue;
      if (pool->retired_) release_retired(std::shared_ptr<CapturePool>(pool));
      return true;
    }
    if (capturing_ == nullptr) return false;
    try {
      capturing_->hold(pointer, bytes);
    } catch (...) {  // no room to note it: the graph may read freed memory -- but never lose it
      return false;
    }
    return true;
  }
  // A retired pool's free blocks and held memory back to the device, and the pool forgotten
  // once no block is in use. Not while a capture is under way: a device free there could
  // synchronise inside the captured stream (end_capture comes back for them).
  void release_retired(std::shared_ptr<CapturePool> pool) noexcept {
    if (capturing_ != nullptr) return;
    for (auto& [bytes, pointer] : pool->free_) {
      pool->blocks_.erase(pointer);
      pool->reserved_ -= bytes;
      do_deallocate_reserved(pointer, bytes);
    }
    pool->free_.clear();
    for (auto& [pointer, bytes] : pool->held_) do_deallocate(pointer, bytes);
    pool->held_.clear();
    pool->held_bytes_ = 0;
    if (!pool->blocks_.empty()) return;
    std::erase_if(registered_, [&](const auto& p) { return p == pool; });
    pools_.store(static_cast<int>(registered_.size()), std::memory_order_release);
  }

  MemoryStats stats_;
  std::mutex pool_mutex_;
  std::vector<std::shared_ptr<CapturePool>> registered_;  // pools whose blocks may come back
  std::shared_ptr<CapturePool> capturing_;                // the pool of the capture under way
  std::atomic<int> pools_{0};                             // registered_.size(), read unlocked
};

// Host memory with a cache of freed blocks: a training step allocates the same buffers every
// time (activations, FSDP's gathered units, gradient buckets, an offloaded step's staging), and
// giving them back to the system each time costs a page fault per 4 KiB page when they return
// (about 10% of a ResNet-18 FSDP step on the CPU) -- or, for pinned memory, a cudaMallocHost of
// a millisecond or more -- and for the small tensors of a host-bound step, an aligned malloc
// and free per op (a fifth of a tiny op's host time). Blocks of at least `cached_from` bytes
// are cached when freed, by their size rounded up (to 64 bytes below 4 KiB, 4 KiB below 1 MiB,
// 64 KiB above), and handed out again for the same rounded size; at most `max_cached` bytes
// stay cached (beyond that, frees go to the system), and release_cached() gives them all back.
// Each rounded size keeps its free blocks in a vector that keeps its capacity (and its entry,
// release_cached() included: a few words per size the process has used), so a step that frees
// and allocates the same sizes inserts nothing anywhere. The memory statistics count what
// is in use, not what is cached. Subclasses provide the raw memory and call release_cached() in
// their destructor.
class CachingHostAllocator : public Allocator {
 public:
  CachingHostAllocator(const CachingHostAllocator&) = delete;
  CachingHostAllocator& operator=(const CachingHostAllocator&) = delete;

  Device device() const override { return Device::cpu(); }

  // Returns every cached block to the system.
  void release_cached() noexcept {
    std::lock_guard lock(mutex_);
    for (auto& [size, blocks] : cache_) {
      for (void* pointer : blocks) raw_free(pointer);
      blocks.clear();
    }
    cached_ = 0;
  }
  std::size_t cached_bytes() const {
    std::lock_guard lock(mutex_);
    return cached_;
  }

 protected:
  CachingHostAllocator(std::size_t cached_from, std::size_t max_cached)
      : cached_from_(cached_from), max_cached_(max_cached) {}

  virtual void* raw_allocate(std::size_t bytes) noexcept = 0;  // nullptr when out of memory
  virtual void raw_free(void* pointer) noexcept = 0;

  void* do_allocate(std::size_t bytes) override {
    if (bytes < cached_from_) return raw_allocate(bytes);
    const std::size_t size = rounded(bytes);
    {
      std::lock_guard lock(mutex_);
      const auto found = cache_.find(size);
      if (found != cache_.end() && !found->second.empty()) {
        void* pointer = found->second.back();
        found->second.pop_back();
        cached_ -= size;
        return pointer;
      }
    }
    return raw_allocate(size);
  }
  void do_deallocate(void* pointer, std::size_t bytes) noexcept override {
    if (bytes >= cached_from_) {
      const std::size_t size = rounded(bytes);
      std::lock_guard lock(mutex_);
      if (cached_ + size <= max_cached_) {
        try {
          cache_[size].push_back(pointer);
          cached_ += size;
          return;
        } catch (...) {  // no room for the bookkeeping: free it instead
        }
      }
    }
    raw_free(pointer);
  }

 private:
  static std::size_t rounded(std::size_t bytes) {
    const std::size_t granule = bytes >= (std::size_t{1} << 20) ? std::size_t{64} << 10
                                : bytes >= 4096                 ? 4096
                                                                : 64;
    return (bytes + granule - 1) / granule * granule;
  }

  std::size_t cached_from_;
  std::size_t max_cached_;
  mutable std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;  // rounded size -> free blocks
  std::size_t cached_ = 0;
};

// Host memory aligned to 64 bytes (a cache line, and enough for any SIMD load width); blocks
// are cached when freed (CachingHostAllocator).
class HostAllocator final : public CachingHostAllocator {
 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kCachedFrom = 1;

  explicit HostAllocator(std::size_t max_cached_bytes = std::size_t{2} << 30)
      : CachingHostAllocator(kCachedFrom, max_cached_bytes) {}
  ~HostAllocator() override { release_cached(); }

 protected:
  void* raw_allocate(std::size_t bytes) noexcept override {
    return ::operator new (bytes, std::align_val_t{kAlignment}, std::nothrow);
  }
  void raw_free(void* pointer) noexcept override {
    ::operator delete (pointer, std::align_val_t{kAlignment});
  }
};

}  // namespace shardkit
