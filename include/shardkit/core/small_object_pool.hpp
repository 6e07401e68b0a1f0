// make_pooled<T>(args...): std::make_shared<T>(args...) whose block (the object and its
// reference counts) comes from a free list of the calling thread and goes back to the free list
// of the thread that drops the last reference. Every autograd op makes three such objects -- its
// node, its output's VariableImpl and the output's Storage (the bookkeeping; the tensor's memory
// comes from the context's allocator) -- and the next op, or the next step, takes the blocks the
// previous ones gave back: no heap allocation per op once a step has run.
//
// Blocks are sized in 16-byte classes up to 2 KiB (larger objects go to operator new); each
// thread keeps at most kKeptPerClass blocks of a class and hands the rest back to the heap, so a
// thread that frees what another allocated keeps a bounded amount: at most 4096 blocks of each
// class (in practice the most a step had alive at once; at worst about 0.5 GiB over the 129
// classes), given back to the heap when the thread ends. Under AddressSanitizer
// the pool is bypassed, so that a use after free of a node or a storage is still reported.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <utility>

namespace shardkit {
namespace detail {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kPoolSmallObjects = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kPoolSmallObjects = false;
#else
inline constexpr bool kPoolSmallObjects = true;
#endif
#else
inline constexpr bool kPoolSmallObjects = true;
#endif

class SmallObjectPool {
 public:
  static constexpr std::size_t kGranule = 16;  // operator new's alignment on x86-64
  static constexpr std::size_t kLargest = 2048;
  static constexpr std::size_t kKeptPerClass = 4096;

  static void* allocate(std::size_t bytes) {
    if (!kPoolSmallObjects || bytes > kLargest) return ::operator new(bytes);
    const std::size_t c = size_class(bytes);
    // (a whole class even from the heap: another thread's list may take the block when freed)
    if (closed_) return ::operator new(c* kGranule);
    SmallObjectPool& pool = local();
    if (FreeBlock* block = pool.heads_[c]) {
      pool.heads_[c] = block->next;
      --pool.counts_[c];
      return block;
    }
    return ::operator new(c* kGranule);
  }

  static void deallocate(void* block, std::size_t bytes) noexcept {
    if (!kPoolSmallObjects || bytes > kLargest || closed_) return ::operator delete(block);
    SmallObjectPool& pool = local();
    const std::size_t c = size_class(bytes);
    if (pool.counts_[c] >= kKeptPerClass) return ::operator delete(block);
    pool.heads_[c] = ::new (block) FreeBlock{pool.heads_[c]};
    ++pool.counts_[c];
  }

  // Blocks of `bytes` kept by the calling thread (tests).
  static std::size_t kept(std::size_t bytes) {
    return bytes > kLargest || closed_ ? 0 : local().counts_[size_class(bytes)];
  }

  SmallObjectPool(const SmallObjectPool&) = delete;
  SmallObjectPool& operator=(const SmallObjectPool&) = delete;

 private:
  struct FreeBlock {
    FreeBlock* next;
  };
  static constexpr std::size_t kClasses = kLargest / kGranule + 1;

  SmallObjectPool() = default;
  ~SmallObjectPool() {
    closed_ = true;  // objects freed later in this thread's exit go straight to the heap
    for (FreeBlock* head : heads_)
      while (head != nullptr) ::operator delete(std::exchange(head, head->next));
  }
  static std::size_t size_class(std::size_t bytes) { return (bytes + kGranule - 1) / kGranule; }
  static SmallObjectPool& local() {
    thread_local SmallObjectPool pool;
    return pool;
  }

  // (trivially destructible, so it can still be read while the thread's objects are destroyed)
  static inline thread_local bool closed_ = false;
  FreeBlock* heads_[kClasses] = {};
  std::size_t counts_[kClasses] = {};
};

// The allocator std::allocate_shared rebinds to its control block's type.
template <class T>
struct PoolAllocator {
  using value_type = T;
  static_assert(alignof(T) <= SmallObjectPool::kGranule, "pooled objects are 16-byte aligned");

  PoolAllocator() noexcept = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) { return static_cast<T*>(SmallObjectPool::allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { SmallObjectPool::deallocate(p, n * sizeof(T)); }

  template <class U>
  friend bool operator==(const PoolAllocator&, const PoolAllocator<U>&) noexcept {
    return true;
  }
};

}  // namespace detail

template <class T, class... Args>
std::shared_ptr<T> make_pooled(Args&&... args) {
  return std::allocate_shared<T>(detail::PoolAllocator<T>(), std::forward<Args>(args)...);
}

}  // namespace shardkit
