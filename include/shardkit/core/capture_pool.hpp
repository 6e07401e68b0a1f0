// CapturePool: the memory of one captured step (core/step_graph.hpp). A CUDA graph replays its
// kernels with the addresses they were captured with, so
//   - every block the step allocates while it is captured stays reserved for the graph: freed
//     inside the step, it goes back to the pool (a later allocation of the same size in the same
//     step takes it, as the eager step's caching allocator would); freed after the capture (a
//     gradient the next step replaces), it goes back to the pool too, never to the device;
//   - memory allocated before the capture and freed inside it (the previous step's gradients)
//     may still be read by the graph: it is held, not freed, until the pool is retired; a
//     block of another graph's pool freed inside it (a tensor that graph made, replaced by
//     this step) is borrowed: it stays in use in its own pool until this pool is retired, so
//     neither graph's going frees what the other may read.
// Exact sizes only: a block serves an allocation of its own size, so what is freed when the
// pool is retired is what was allocated. The Allocator (allocator.hpp) routes to the pool; the
// memory statistics count what tensors hold, as ever (reserved_bytes() says what the graph
// keeps besides).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace shardkit {

class CapturePool {
 public:
  CapturePool() = default;
  CapturePool(const CapturePool&) = delete;
  CapturePool& operator=(const CapturePool&) = delete;

  // Bytes of the pool's blocks (in use or free) and of the memory it holds for the graph.
  std::size_t reserved_bytes() const { return reserved_; }
  std::size_t held_bytes() const { return held_bytes_; }
  std::size_t blocks() const { return blocks_.size(); }

 private:
  friend class Allocator;

  struct Block {
    std::size_t bytes;
    bool in_use;
  };

  // A free block of exactly `bytes`, now in use; or nullptr.
  void* take(std::size_t bytes) {
    const auto found = free_.find(bytes);
    if (found == free_.end()) return nullptr;
    void* pointer = found->second;
    free_.erase(found);
    blocks_.at(pointer).in_use = true;
    return pointer;
  }
  void add(void* pointer, std::size_t bytes) {
    blocks_.emplace(pointer, Block{bytes, true});
    reserved_ += bytes;
  }
  bool owns(void* pointer) const { return blocks_.count(pointer) != 0; }
  // `pointer`, one of the pool's blocks, is free now.
  void give_back(void* pointer) {
    Block& block = blocks_.at(pointer);
    block.in_use = false;
    free_.emplace(block.bytes, pointer);
  }
  void hold(void* pointer, std::size_t bytes) {
    held_.emplace_back(pointer, bytes);
    held_bytes_ += bytes;
  }
  // `pointer`, a block of `lender` freed while this pool's step was captured: still in use
  // there until this pool is retired.
  void borrow(void* pointer, std::shared_ptr<CapturePool> lender) {
    borrowed_.emplace_back(pointer, std::move(lender));
  }

  std::unordered_map<void*, Block> blocks_;
  std::multimap<std::size_t, void*> free_;           // bytes -> free block
  std::vector<std::pair<void*, std::size_t>> held_;  // freed during the capture, kept
  // Other pools' blocks freed during the capture, and their pools (a pool borrows only while
  // it is captured, from pools made before it: no cycle of owners). Counted in the lender's
  // reserved_bytes().
  std::vector<std::pair<void*, std::shared_ptr<CapturePool>>> borrowed_;
  std::size_t reserved_ = 0;
  std::size_t held_bytes_ = 0;
  bool retired_ = false;  // its graph is gone: blocks go back to the device as they free
};

}  // namespace shardkit
