// StateSpill: an offloaded optimizer's master and state kept on disk
// (core/mapped_file_allocator.hpp: DeepSpeed ZeRO-Infinity's offload to NVMe), streamed through RAM
// chunk by chunk at the step. Before a chunk is updated the next one's pages start coming in
// (read-ahead beside the update); after it, its write-back starts, and the chunk before it is
// finished on disk and dropped from RAM. So RAM holds about three chunks of the state at any time
// instead of all of it; what the update computes does not change (the same memory, the same
// functors).
//
// Reads between steps (a checkpoint, consolidation, LARC's norms of the masters) fault the
// pages in as ordinary memory; the kernel may drop those clean pages again whenever RAM is short,
// and the next step's chunks spill them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "shardkit/core/mapped_file_allocator.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::optim {

class StateSpill {
 public:
  // `per_piece`: for each buffer on `disk`, its view of every piece, in pieces order.
  StateSpill(const MappedFileAllocator& disk, std::vector<std::vector<Tensor>> per_piece)
      : disk_(&disk), per_piece_(std::move(per_piece)) {}

  // Pieces [begin, end) are updated next: start reading them.
  void prefetch(std::size_t begin, std::size_t end) const {
    for (const auto& [data, bytes] : ranges(begin, end)) disk_->prefetch(data, bytes);
  }
  // Pieces [begin, end) were updated: start their write-back; finish the chunk before them on
  // disk and drop it from RAM.
  void done(std::size_t begin, std::size_t end) {
    for (const auto& [data, bytes] : ranges(begin, end)) disk_->spill(data, bytes, false);
    if (previous_.second > previous_.first) drop(previous_.first, previous_.second);
    previous_ = {begin, end};
  }
  // The step's last chunk done: finish it too, and drop whatever else of the state came back
  // into RAM meanwhile (the kernel's read-around of faults near a chunk's edges, about 7% of
  // ResNet-50's master here: cheap to drop where nothing is resident).
  void finish() {
    previous_ = {0, 0};
    drop_all();
  }
  // Everything on disk and out of RAM (after the buffers were first written).
  void drop_all() {
    if (pieces() > 0) drop(0, pieces());
  }
  // The state's bytes in RAM now.
  std::size_t resident_bytes() const {
    std::size_t total = 0;
    for (const auto& [data, bytes] : ranges(0, pieces()))
      total += disk_->resident_bytes(data, bytes);
    return total;
  }

 private:
  std::size_t pieces() const { return per_piece_.empty() ? 0 : per_piece_[0].size(); }

  void drop(std::size_t begin, std::size_t end) const {
    for (const auto& [data, bytes] : ranges(begin, end)) disk_->spill(data, bytes, true);
  }

  // Per buffer, the bytes pieces [begin, end) span.
  std::vector<std::pair<const void*, std::size_t>> ranges(std::size_t begin,
                                                          std::size_t end) const {
    std::vector<std::pair<const void*, std::size_t>> out;
    for (const auto& views : per_piece_) {
      std::uintptr_t lo = UINTPTR_MAX, hi = 0;
      for (std::size_t k = begin; k < end; ++k) {
        if (views[k].numel() == 0) continue;
        const auto at = reinterpret_cast<std::uintptr_t>(views[k].data_ptr());
        lo = std::min(lo, at);
        hi = std::max(hi, at + views[k].nbytes());
      }
      if (lo < hi) out.emplace_back(reinterpret_cast<const void*>(lo), hi - lo);
    }
    return out;
  }

  const MappedFileAllocator* disk_;
  std::vector<std::vector<Tensor>> per_piece_;
  std::pair<std::size_t, std::size_t> previous_{0, 0};
};

}  // namespace shardkit::optim
