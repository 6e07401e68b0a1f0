// Counts a program's heap allocations while it asks: a test or benchmark that includes this
// header replaces the global operator new of its executable (so exactly one translation unit of
// a program may include it). Allocations made with oneDNN in their call stack are counted apart
// (its execution of a primitive builds an argument map per call, which is not ours to remove).
// Used by tests/autograd/test_host_allocations.cpp and benchmarks/autograd/bench_op_overhead.cpp.
#pragma once

#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

namespace shardkit::testing {

struct HeapAllocations {
  long ours = 0;    // every operator new call but oneDNN's
  long onednn = 0;  // calls with libdnnl in their call stack
};

namespace detail {

inline std::atomic<bool> counting_heap{false};
inline std::atomic<long> heap_ours{0}, heap_onednn{0};
inline thread_local bool inside_count = false;  // (backtrace and dladdr may allocate themselves)

inline bool made_by_onednn() {
  void* frames[24];
  const int depth = backtrace(frames, 24);
  for (int i = 0; i < depth; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) != 0 && info.dli_fname != nullptr &&
        std::strstr(info.dli_fname, "libdnnl") != nullptr)
      return true;
  }
  return false;
}

// SK_HEAP_TRACE=1 in the environment: each counted allocation of ours prints its call stack to
// stderr (addresses; `addr2line -f -C -e EXECUTABLE` names them), to find what allocates.
inline bool tracing_heap() {
  static const bool on = [] {
    const char* value = std::getenv("SK_HEAP_TRACE");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return on;
}

inline void* counted_new(std::size_t bytes, std::size_t alignment) {
  if (counting_heap.load(std::memory_order_relaxed) && !inside_count) {
    inside_count = true;
    const bool onednn = made_by_onednn();
    (onednn ? heap_onednn : heap_ours).fetch_add(1, std::memory_order_relaxed);
    if (!onednn && tracing_heap()) {
      void* frames[24];
      const int depth = backtrace(frames, 24);
      backtrace_symbols_fd(frames, depth, 2);
      static constexpr char kEnd[] = "--\n";
      [[maybe_unused]] const auto written = ::write(2, kEnd, sizeof kEnd - 1);
    }
    inside_count = false;
  }
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes ? bytes : 1)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace detail

// The heap allocations of one run of `step()`, on every thread.
template <class Step>
HeapAllocations heap_allocations_of(Step&& step) {
  detail::heap_ours = 0;
  detail::heap_onednn = 0;
  detail::counting_heap = true;
  try {
    step();
  } catch (...) {
    detail::counting_heap = false;
    throw;
  }
  detail::counting_heap = false;
  return {detail::heap_ours.load(), detail::heap_onednn.load()};
}

}  // namespace shardkit::testing

// (operator delete stays the library's, which frees with free(): what malloc and aligned_alloc
// return.) Not under AddressSanitizer, whose operator delete reports a block from malloc as a
// mismatch, and where the counting tests stand down anyway (the small-object pool is bypassed).
#if defined(__SANITIZE_ADDRESS__)
#define SK_HEAP_COUNTER_REPLACES_NEW 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SK_HEAP_COUNTER_REPLACES_NEW 0
#endif
#endif
#ifndef SK_HEAP_COUNTER_REPLACES_NEW
#define SK_HEAP_COUNTER_REPLACES_NEW 1
#endif
#if SK_HEAP_COUNTER_REPLACES_NEW
void* operator new(std::size_t bytes) {
  return shardkit::testing::detail::counted_new(bytes, alignof(std::max_align_t));
}
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return shardkit::testing::detail::counted_new(bytes, static_cast<std::size_t>(alignment));
}
#endif
