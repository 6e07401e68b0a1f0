// HostScratch: zeroed host arrays for the length of one kernel call, taken from buffers the
// calling thread keeps from call to call -- per-channel sums, scales and shifts that batch norm
// computes on every call were a std::vector each, heap allocations per op. A kernel makes one
// HostScratch and asks it for its arrays; kernels it calls make their own, which take the next
// buffers, and each frame gives its buffers back when it ends. Pointers stay valid for the
// frame's life: each array is a buffer of its own.
#pragma once

#include <algorithm>
#include <cstddef>
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
    Stack& s = stack();
    if (s.buffers.size() == s.depth) s.buffers.emplace_back();
    std::vector<double>& buffer = s.buffers[s.depth++];
    if (buffer.size() < count) buffer.resize(count);
    std::fill_n(buffer.data(), count, 0.0);
    return buffer.data();
  }

 private:
  struct Stack {
    std::vector<std::vector<double>> buffers;  // (moving a buffer keeps its elements in place)
    std::size_t depth = 0;
  };
  static Stack& stack() {
    thread_local Stack s;
    return s;
  }
  std::size_t first_;
};

}  // namespace shardkit
