// Storage: one block of memory on one device, owned (freed through its allocator) or borrowed.
// An owned storage can give its memory back while tensors still view it (release) and get it
// again later (materialize): how FSDP frees a unit's gathered parameters after its forward while
// the autograd graph still refers to them, and re-gathers them for the backward. Touching a
// released storage's data throws, naming why it was released. A storage can start out released,
// never having held memory: an fsdp unit's whole buffer before its first gather, and a deferred
// one -- a parameter built under DeferredParameters (deferred_init.hpp), which keeps how it was
// initialised (InitRecipe) instead of its values.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/init_recipe.hpp"

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

  // Sized and counted nowhere until materialize(): data() throws `reason` before that (as if
  // allocated and released: FSDP's buffer of a unit, whole only while gathered).
  struct Released {};
  Storage(Released, std::shared_ptr<Allocator> allocator, std::size_t bytes,
          MemoryCategory category, std::string reason)
      : allocator_(std::move(allocator)),
        bytes_(bytes),
        device_(allocator_->device()),
        category_(category),
        released_(true),
        release_reason_(std::move(reason)) {}

  // The same for a parameter built under DeferredParameters, which records its InitRecipe.
  struct Deferred {};
  Storage(Deferred, std::shared_ptr<Allocator> allocator, std::size_t bytes,
          MemoryCategory category, std::string reason)
      : Storage(Released{}, std::move(allocator), bytes, category, std::move(reason)) {
    init_recipe_ = std::make_unique<InitRecipe>();
  }

  // Wraps memory the caller owns (e.g. buffers of an existing training loop); never freed here
  // and not counted: the caller's allocator counted it already.
  static std::shared_ptr<Storage> borrow(void* data, std::size_t bytes, Device device) {
    return std::shared_ptr<Storage>(new Storage(data, bytes, device));
  }

  ~Storage() {
    if (allocator_ && !released_) allocator_->deallocate(data_, bytes_, category_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const {
    if (released_) [[unlikely]]
      fail<StateError>("use of memory that was released: ", release_reason_);
    return data_;
  }
  // Frees the memory (the allocator's counters drop now); `reason` is what data() will say if
  // anything touches it before materialize() -- name the owner and the fix.
  void release(std::string reason) {
    check<StateError>(owns_memory(),
                      "release() of borrowed memory: only owned storage can be "
                      "freed early");
    if (released_) {  // (the latest reason holds: an owner naming itself after a generic one)
      release_reason_ = std::move(reason);
      return;
    }
    allocator_->deallocate(data_, bytes_, category_);
    data_ = nullptr;
    released_ = true;
    release_reason_ = std::move(reason);
  }
  // Allocates the same number of bytes again (contents undefined) for the views to use.
  void materialize() {
    if (!released_) return;
    data_ = allocator_->allocate(bytes_, category_);
    released_ = false;
    release_reason_.clear();
    init_recipe_.reset();  // (no longer deferred: the caller has read the recipe)
  }
  bool released() const { return released_; }
  // Built without memory and not materialized since (the recipe may still be unrecorded).
  bool deferred() const { return init_recipe_ != nullptr; }
  // (Other storages have none: an empty recipe.)
  InitRecipe init_recipe() const { return init_recipe_ ? *init_recipe_ : InitRecipe{}; }
  void record_init(const InitRecipe& recipe) {
    check<StateError>(init_recipe_ != nullptr,
                      "record_init on a storage that was not built deferred");
    *init_recipe_ = recipe;
  }
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
  bool released_ = false;
  std::string release_reason_;
  // Deferred storages only, until materialize() (the others stay small: every op makes one):
  // how the whole of it was initialised.
  std::unique_ptr<InitRecipe> init_recipe_;
};

}  // namespace shardkit
