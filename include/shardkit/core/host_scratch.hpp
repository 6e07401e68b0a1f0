// HostScratch: host arrays for the length of one kernel call, taken from buffers the calling
// thread keeps from call to call -- per-channel sums, scales and shifts that batch norm computes
// on every call, and the CPU convolution's im2col columns, were a std::vector each, heap
// allocations per op. A kernel makes one HostScratch and asks it for its arrays; kernels it calls
// make their own, which take the next buffers, and each frame gives its buffers back when it
// ends. Pointers stay valid for the frame's life: each array is a buffer of its own. A thread
// keeps its largest arrays (a convolution's columns: its patch times its output plane).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

namespace shardkit {

class HostScratch {
 public:
  HostScratch() : first_(stack().depth) {}
  ~HostScratch() { stack().depth = first_; }
  HostScratch(const HostScratch&) = delete;
  HostScratch& operator=(const HostScratch&) = delete;

  // `count` doubles set to zero.
  double* doubles(std::size_t count) {
    double* values = uninitialised<double>(count);
    std::fill_n(values, count, 0.0);
    return values;
  }

  // `count` values of T, not initialised: for arrays the caller writes whole before it reads
  // them (the CPU convolution's im2col columns).
  template <class T>
  T* uninitialised(std::size_t count) {
    static_assert(std::is_trivial_v<T> && alignof(T) <= kAlignment);
    // (as new T[count] refuses a count whose bytes wrap, rather than hand back a short buffer)
    if (count > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw std::bad_array_new_length();
    Stack& s = stack();
    if (s.buffers.size() == s.depth) s.buffers.emplace_back();
    Buffer& buffer = s.buffers[s.depth++];
    const std::size_t bytes = std::max<std::size_t>(count * sizeof(T), 1);
    if (buffer.bytes < bytes) {
      buffer.data.reset();  // (the old one first: a growing buffer is not held twice)
      buffer.bytes = 0;     // (and none if the allocation throws)
      buffer.data.reset(::operator new (bytes, std::align_val_t{kAlignment}));
      buffer.bytes = bytes;
    }
    // (storage from an allocation function: the T objects begin their lifetime implicitly)
    return static_cast<T*>(buffer.data.get());
  }

 private:
  static constexpr std::size_t kAlignment = 64;  // a cache line: whole vector loads
  struct Free {
    void operator()(void* p) const { ::operator delete (p, std::align_val_t{kAlignment}); }
  };
  struct Buffer {
    std::unique_ptr<void, Free> data;  // (moving a buffer keeps its storage in place)
    std::size_t bytes = 0;
  };
  struct Stack {
    std::vector<Buffer> buffers;
    std::size_t depth = 0;
  };
  static Stack& stack() {
    thread_local Stack s;
    return s;
  }
  std::size_t first_;
};

}  // namespace shardkit
