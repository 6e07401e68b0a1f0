// Storage: one block of memory on one device, owned (freed through its allocator) or borrowed.
#pragma once

#include <cstddef>
#include <memory>

#include "shardkit/core/allocator.hpp"

namespace shardkit {

class Storage {
 public:
  // Allocates `bytes` from `allocator`, counted under `category`.
  Storage(std::shared_ptr<Allocator> allocator, std::size_t bytes, MemoryCategory category)
      : allocator_(std::move(allocator)),
        data_(allocator_->allocate(bytes, category)),
        bytes_(bytes),
        device_(allocator_->device()),
        category_(category) {}

  // Wraps memory the caller owns (e.g. buffers of an existing training loop); never freed here
  // and not counted: the caller's allocator counted it already.
  static std::shared_ptr<Storage> borrow(void* data, std::size_t bytes, Device device) {
    return std::shared_ptr<Storage>(new Storage(data, bytes, device));
  }

  ~Storage() {
    if (allocator_) allocator_->deallocate(data_, bytes_, category_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  MemoryCategory category() const { return category_; }
  bool owns_memory() const { return allocator_ != nullptr; }

 private:
  Storage(void* data, std::size_t bytes, Device device)
      : data_(data), bytes_(bytes), device_(device), category_(MemoryCategory::other) {}

  std::shared_ptr<Allocator> allocator_;  // keeps the allocator (and its stats) alive
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_;
  MemoryCategory category_;
};

}  // namespace shardkit
