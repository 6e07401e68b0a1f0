// Buffer: what a collective reads or writes -- a pointer, an element count, a dtype and the
// device the memory lives on. Sized, so every call can check that its buffers are big enough.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "shardkit/core/device.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::comm {

struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;  // elements
  DType dtype = DType::f32;
  Device device = Device::cpu();

  Buffer() = default;
  Buffer(void* data_, std::size_t count_, DType dtype_, Device device_ = Device::cpu())
      : data(data_), count(count_), dtype(dtype_), device(device_) {
    check(data != nullptr || count == 0, "comm::Buffer of ", count,
          " elements has a null pointer; pass the memory or a count of 0");
  }

  // A contiguous tensor's elements (implicit: comm.all_reduce(grads) reads naturally). Send
  // buffers are only read; the tensor must outlive the call's Work.
  Buffer(const Tensor& tensor)  // NOLINT(google-explicit-constructor)
      : Buffer(tensor.numel() ? tensor.data_ptr() : nullptr,
               static_cast<std::size_t>(tensor.numel()), tensor.dtype(), tensor.device()) {
    check(tensor.is_contiguous(), "comm::Buffer of non-contiguous ", tensor,
          "; collectives move contiguous memory: pass sk::contiguous(ctx, t)");
  }

  // Host memory of one of the element types (const spans are for send buffers: only read).
  template <class T>
  Buffer(std::span<T> values)  // NOLINT(google-explicit-constructor)
      : Buffer(const_cast<std::remove_const_t<T>*>(values.data()), values.size(),
               dtype_of<std::remove_const_t<T>>) {}
  template <class T>
  Buffer(std::vector<T>& values)  // NOLINT(google-explicit-constructor)
      : Buffer(std::span<T>(values)) {}

  std::size_t element_size() const { return dtype_size(dtype); }
  std::size_t nbytes() const { return count * element_size(); }
  char* bytes() const { return static_cast<char*>(data); }
  bool empty() const { return count == 0; }

  // Elements [first, first + n): a view of the same memory.
  Buffer slice(std::size_t first, std::size_t n) const {
    check(first <= count && n <= count - first, "comm::Buffer slice [", first, ", ", first + n,
          ") is outside a buffer of ", count, " ", dtype_name(dtype), " elements");
    Buffer out = *this;
    out.data = n == 0 && data == nullptr ? nullptr : bytes() + first * element_size();
    out.count = n;
    return out;
  }
  Buffer first(std::size_t n) const { return slice(0, n); }
};

// True when the byte ranges of a and b intersect (empty buffers overlap nothing).
inline bool overlaps(const Buffer& a, const Buffer& b) {
  if (a.empty() || b.empty() || a.device != b.device) return false;
  return a.bytes() < b.bytes() + b.nbytes() && b.bytes() < a.bytes() + a.nbytes();
}

}  // namespace shardkit::comm
