// The Allocator interface (every allocation is counted in MemoryStats) and the host allocator.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/core/capture_pool.hpp"
#include "shardkit/core/device.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/memory_stats.hpp"

// AddressSanitizer builds (GCC's macro, Clang's feature test): the host allocator poisons the
// free parts of its segments.
#if defined(__SANITIZE_ADDRESS__)
#define SK_ALLOCATOR_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SK_ALLOCATOR_ASAN 1
#endif
#endif
#if defined(SK_ALLOCATOR_ASAN)
#include <sanitizer/asan_interface.h>
#endif

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
  // Freed memory this allocator keeps for reuse rather than giving it back: held by the process
  // beside what the statistics count as in use. The host allocators' cache (0 elsewhere: a CUDA
  // device's stream-ordered pool is the driver's, shared by every context on the device).
  virtual std::size_t cached_bytes() const { return 0; }
  // Gives back to the device what its stream-ordered pool keeps unused, once the allocator's
  // stream has finished with it (a CUDA device's; nothing elsewhere). Before a step is captured:
  // the capture's blocks are cudaMalloc's, which cannot reuse what the pool keeps, so the
  // eager steps' cached working set would sit beside the graph's copy of it.
  virtual void trim_device_pool() {}

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
    // Blocks of retired pools freed during the capture go back now (see release_retired). A
    // release may forget a lender below `i` too, shifting the rest down: `i` then revisits a
    // pool already released (a no-op), and none is skipped.
    for (std::size_t i = registered_.size(); i-- > 0;)
      if (i < registered_.size() && registered_[i]->retired_) release_retired(registered_[i]);
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
    if (pointer == nullptr) return nullptr;
    try {
      capturing_->add(pointer, bytes);
    } catch (...) {  // (the pool's table could not grow: the block would be neither held nor freed)
      do_deallocate_reserved(pointer, bytes);
      return nullptr;  // (out of memory, as allocate reports it)
    }
    return pointer;
  }
  // Whether a pool took `pointer` (its block, or memory held for the capture under way).
  bool deallocate_with_pools(void* pointer, std::size_t bytes) noexcept {
    std::lock_guard lock(pool_mutex_);
    for (const auto& pool : registered_) {
      if (!pool->owns(pointer)) continue;
      if (capturing_ != nullptr && pool != capturing_) {
        // Another graph's block, which the graph under capture may have read: lent to it.
        try {
          capturing_->borrow(pointer, pool);
          return true;
        } catch (...) {  // no room to note it: back to its pool, as before borrowing
        }
      }
      pool->give_back(pointer);
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
    // What it borrowed goes back to the lenders (and with a retired lender, to the device).
    for (auto& [pointer, lender] : std::exchange(pool->borrowed_, {})) {
      lender->give_back(pointer);
      if (lender->retired_) release_retired(lender);
    }
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
// and free per op (a fifth of a tiny op's host time).
//
// Blocks below `large_from` bytes (and of at least `cached_from`) are cached when freed by their
// size rounded up (to 64 bytes below 4 KiB, 4 KiB below 1 MiB, 64 KiB above) and handed out
// again for the same rounded size. Each rounded size keeps its free blocks in a vector that
// keeps its capacity (and its entry, release_cached() included: a few words per size the
// process has used), so a step that frees and allocates the same sizes inserts nothing.
//
// Larger blocks are carved out of segments of at least `segment_bytes` (PyTorch's CUDA caching
// allocator's scheme): a request takes the smallest free block that holds it (4 KiB granules),
// split when more is left over, and a freed block merges with its free neighbours in its
// segment. A cache by exact size would hold each size's blocks apart: a training step's sizes
// differ between its forward and its backward, and a multi-crop ResNet step at 224 pixels left
// 1.5-3x its peak in use cached that way, where these segments hold 1.1-1.2x
// (benchmarks/core/bench_host_allocator replays such a step; docs/design.md, "The host
// allocator's segments").
//
// Of what could go back to the system -- the cached small blocks and the wholly free segments
// -- at most `max_cached` bytes are kept: beyond that a small block goes back when freed, and so
// does a segment once it is wholly free (the free blocks of a segment still in use stay where
// they are). When the system has no memory for a new segment, the cache is given back and a
// segment of just the request's size is tried. release_cached() gives back every cached small
// block and every wholly free segment. The memory statistics count what is in use,
// cached_bytes() what is kept besides. Subclasses provide the raw memory and call
// release_cached() in their destructor.
class CachingHostAllocator : public Allocator {
 public:
  CachingHostAllocator(const CachingHostAllocator&) = delete;
  CachingHostAllocator& operator=(const CachingHostAllocator&) = delete;

  Device device() const override { return Device::cpu(); }

  // Returns every cached small block and every wholly free segment to the system.
  void release_cached() noexcept {
    std::lock_guard lock(mutex_);
    release_cached_locked();
  }
  // The cached small blocks and the segments' free blocks.
  std::size_t cached_bytes() const override {
    std::lock_guard lock(mutex_);
    return small_cached_ + segment_free_;
  }
  // The segments' bytes (in use and free), for tests and reports.
  std::size_t segment_bytes_held() const {
    std::lock_guard lock(mutex_);
    std::size_t total = 0;
    for (const auto& [address, size] : segments_) total += size;
    return total;
  }

 protected:
  CachingHostAllocator(std::size_t cached_from, std::size_t max_cached,
                       std::size_t large_from = SIZE_MAX, std::size_t segment_bytes = 0)
      : cached_from_(cached_from),
        max_cached_(max_cached),
        large_from_(large_from),
        segment_bytes_(segment_bytes) {}

  virtual void* raw_allocate(std::size_t bytes) noexcept = 0;  // nullptr when out of memory
  virtual void raw_free(void* pointer) noexcept = 0;

  void* do_allocate(std::size_t bytes) override {
    if (bytes >= large_from_) return allocate_large(bytes);
    if (bytes < cached_from_) return raw_allocate(bytes);
    const std::size_t size = rounded(bytes);
    {
      std::lock_guard lock(mutex_);
      const auto found = cache_.find(size);
      if (found != cache_.end() && !found->second.empty()) {
        void* pointer = found->second.back();
        found->second.pop_back();
        small_cached_ -= size;
        return pointer;
      }
    }
    return raw_allocate(size);
  }
  void do_deallocate(void* pointer, std::size_t bytes) noexcept override {
    if (bytes >= large_from_) return free_large(static_cast<char*>(pointer));
    if (bytes >= cached_from_) {
      const std::size_t size = rounded(bytes);
      std::lock_guard lock(mutex_);
      if (small_cached_ + whole_free_ + size <= max_cached_) {
        try {
          cache_[size].push_back(pointer);
          small_cached_ += size;
          return;
        } catch (...) {  // no room for the bookkeeping: free it instead
        }
      }
    }
    raw_free(pointer);
  }

 private:
  static constexpr std::size_t kPage = 4096;

  static std::size_t rounded(std::size_t bytes) {
    const std::size_t granule = bytes >= (std::size_t{1} << 20) ? std::size_t{64} << 10
                                : bytes >= 4096                 ? 4096
                                                                : 64;
    return (bytes + granule - 1) / granule * granule;
  }

  // A block of a segment: its bytes, the segment it is part of, and whether it is free.
  struct Block {
    std::size_t size;
    char* segment;
    bool free;
  };

  void* allocate_large(std::size_t bytes) {
    if (bytes > SIZE_MAX - kPage) return nullptr;  // (no such memory; the rounding would wrap)
    const std::size_t size = (bytes + kPage - 1) / kPage * kPage;
    std::lock_guard lock(mutex_);
    auto fit = free_blocks_.lower_bound({size, nullptr});  // the smallest that holds it
    if (fit == free_blocks_.end()) {
      fit = add_segment(size);
      if (fit == free_blocks_.end()) return nullptr;
    }
    char* address = fit->second;
    Block& block = blocks_.at(address);
    if (segment_is_free(address, block.size)) whole_free_ -= block.size;
    unlist_free(fit);
    block.free = false;
    segment_free_ -= block.size;
    const std::size_t left = block.size - size;
    if (left >= kPage) {  // the rest stays free, a block of its own
      try {
        const auto rest = add_block(address + size, Block{left, block.segment, true});
        try {
          list_free(left, address + size);
        } catch (...) {
          remove_block(rest);
          throw;
        }
        block.size = size;
        segment_free_ += left;
      } catch (...) {  // no room for the bookkeeping: the block is handed out whole
      }
    }
    unpoison(address, bytes);  // (the rest of its last page stays poisoned)
    return address;
  }

  // A new segment for a request of `size` bytes, listed as one free block: at least
  // segment_bytes, or just the request's size where that much is not to be had once the cache
  // has been given back. Returns free_blocks_.end() when the system has no memory for it.
  std::set<std::pair<std::size_t, char*>>::iterator add_segment(std::size_t size) {
    std::size_t bytes = std::max(size, segment_bytes_);
    char* base = static_cast<char*>(raw_allocate(bytes));
    if (base == nullptr) {
      release_cached_locked();
      base = static_cast<char*>(raw_allocate(bytes));
      if (base == nullptr && bytes > size) {
        bytes = size;
        base = static_cast<char*>(raw_allocate(bytes));
      }
      if (base == nullptr) return free_blocks_.end();
    }
    try {
      segments_.emplace(base, bytes);
      add_block(base, Block{bytes, base, true});
      const auto listed = list_free(bytes, base);
      segment_free_ += bytes;
      whole_free_ += bytes;
      poison(base, bytes);
      return listed;
    } catch (...) {  // no room for the bookkeeping
      segments_.erase(base);
      blocks_.erase(base);
      raw_free(base);
      return free_blocks_.end();
    }
  }

  void free_large(char* address) noexcept {
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(address);
    // (not ours, or freed twice: cannot happen through Storage; left alone rather than counted)
    if (it == blocks_.end() || it->second.free) return;
    poison(address, it->second.size);
    it->second.free = true;
    segment_free_ += it->second.size;
    // Merge with the free neighbours of the same segment (blocks_ is ordered by address).
    const auto next = std::next(it);
    if (next != blocks_.end() && next->second.free && next->second.segment == it->second.segment &&
        next->first == address + it->second.size) {
      unlist_free(free_blocks_.find({next->second.size, next->first}));
      it->second.size += next->second.size;
      remove_block(next);
    }
    if (it != blocks_.begin()) {
      const auto previous = std::prev(it);
      if (previous->second.free && previous->second.segment == it->second.segment &&
          previous->first + previous->second.size == address) {
        unlist_free(free_blocks_.find({previous->second.size, previous->first}));
        previous->second.size += it->second.size;
        remove_block(it);
        it = previous;
      }
    }
    try {
      list_free(it->second.size, it->first);
    } catch (...) {  // (a new node: only under memory exhaustion) the block stays unlisted
    }
    if (segment_is_free(it->first, it->second.size)) {
      whole_free_ += it->second.size;
      // Past the bound, what can go back does: this segment.
      if (small_cached_ + whole_free_ > max_cached_) release_segment(it->first, it->second.size);
    }
  }

  // Whether the free block at `address` of `size` bytes is a whole segment.
  bool segment_is_free(char* address, std::size_t size) const {
    const auto found = segments_.find(address);
    return found != segments_.end() && found->second == size;
  }
  // A wholly free segment back to the system.
  void release_segment(char* address, std::size_t size) noexcept {
    unlist_free(free_blocks_.find({size, address}));
    remove_block(blocks_.find(address));
    segments_.erase(address);
    segment_free_ -= size;
    whole_free_ -= size;
    unpoison(address, size);
    raw_free(address);
  }
  // The two indexes' entries come and go as blocks split and merge; the nodes of those that
  // leave are kept (C++17 node handles) and take the next ones that come, so a step that splits
  // and merges the same blocks every time allocates nothing for its bookkeeping.
  using BlockIndex = std::map<char*, Block>;
  using FreeIndex = std::set<std::pair<std::size_t, char*>>;
  template <class Node>
  static void keep(std::vector<Node>& spares, Node&& node) noexcept {
    if (node.empty()) return;
    try {
      spares.push_back(std::move(node));
    } catch (...) {  // (no room for another spare: the node is freed with its handle)
    }
  }
  FreeIndex::iterator list_free(std::size_t size, char* address) {  // (throws without memory)
    if (spare_free_.empty()) return free_blocks_.emplace(size, address).first;
    auto node = std::move(spare_free_.back());
    spare_free_.pop_back();
    node.value() = {size, address};
    return free_blocks_.insert(std::move(node)).position;
  }
  void unlist_free(FreeIndex::iterator it) noexcept {
    if (it != free_blocks_.end()) keep(spare_free_, free_blocks_.extract(it));
  }
  BlockIndex::iterator add_block(char* address, Block block) {  // (throws without memory)
    if (spare_blocks_.empty()) return blocks_.emplace(address, block).first;
    auto node = std::move(spare_blocks_.back());
    spare_blocks_.pop_back();
    node.key() = address;
    node.mapped() = block;
    return blocks_.insert(std::move(node)).position;
  }
  void remove_block(BlockIndex::iterator it) noexcept {
    if (it != blocks_.end()) keep(spare_blocks_, blocks_.extract(it));
  }

  void release_cached_locked() noexcept {
    spare_blocks_.clear();
    spare_free_.clear();
    for (auto& [size, blocks] : cache_) {
      for (void* pointer : blocks) raw_free(pointer);
      small_cached_ -= size * blocks.size();
      blocks.clear();
    }
    for (auto it = free_blocks_.begin(); it != free_blocks_.end();) {
      const auto [size, address] = *it;
      ++it;
      if (segment_is_free(address, size)) release_segment(address, size);
    }
  }

  // Under AddressSanitizer a segment's free blocks are poisoned, and a block's bytes past the
  // request: a read or write of a freed block, or past the end of one into its last page or a
  // free neighbour, is reported (one into a neighbour in use is not, as with malloc's arenas).
  static void poison([[maybe_unused]] char* address, [[maybe_unused]] std::size_t bytes) {
#if defined(SK_ALLOCATOR_ASAN)
    ASAN_POISON_MEMORY_REGION(address, bytes);
#endif
  }
  static void unpoison([[maybe_unused]] char* address, [[maybe_unused]] std::size_t bytes) {
#if defined(SK_ALLOCATOR_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(address, bytes);
#endif
  }

  std::size_t cached_from_;
  std::size_t max_cached_;
  std::size_t large_from_;
  std::size_t segment_bytes_;
  mutable std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;  // rounded size -> free blocks
  BlockIndex blocks_;                                          // segments' blocks by address
  FreeIndex free_blocks_;                                      // (size, address): best fit
  std::vector<BlockIndex::node_type> spare_blocks_;            // nodes to reuse (list_free ...)
  std::vector<FreeIndex::node_type> spare_free_;
  std::unordered_map<char*, std::size_t> segments_;  // segment -> its bytes
  std::size_t small_cached_ = 0;                     // the small blocks cached
  std::size_t segment_free_ = 0;                     // the segments' free blocks
  std::size_t whole_free_ = 0;  // of those, the wholly free segments (what could go back)
};

// Host memory aligned to 64 bytes (a cache line, and enough for any SIMD load width); blocks
// are cached when freed (CachingHostAllocator).
class HostAllocator final : public CachingHostAllocator {
 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kCachedFrom = 1;
  // Blocks from 64 KiB on are carved out of segments of at least 64 MiB (a segment of glibc's
  // size for mmap, 32 MiB and more, is its own mapping: given back whole, not kept in a heap;
  // its untouched pages are not resident).
  static constexpr std::size_t kLargeFrom = std::size_t{64} << 10;
  static constexpr std::size_t kSegmentBytes = std::size_t{64} << 20;

  explicit HostAllocator(std::size_t max_cached_bytes = std::size_t{2} << 30)
      : CachingHostAllocator(kCachedFrom, max_cached_bytes, kLargeFrom, kSegmentBytes) {}
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
