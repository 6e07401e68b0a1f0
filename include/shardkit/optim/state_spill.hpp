// StateSpill: an offloaded optimizer's master and state kept on disk
// (core/mapped_file_allocator.hpp: DeepSpeed ZeRO-Infinity's offload to NVMe), streamed through RAM
// chunk by chunk at the step. While a chunk is updated the next one is read in on a thread of
// this spill's own (MappedFileAllocator::load: large reads, every page mapped at once, none left
// for the update to fault); after it, its pages are unmapped and their write-back starts, and
// the chunk before it is finished on disk and dropped from RAM. So RAM holds about three chunks of
// the state at any time instead of all of it; what the update computes does not change (the same
// memory, the same functors).
//
// The step's last chunk stays in RAM (neither written back nor unmapped): the optimizer walks its
// chunks in the opposite order at the next step, which starts with it, so it is neither written
// back and dropped at the step's end nor read again at the next step's start (a state of one chunk
// is then read from disk only after a drop). The chunk that a step starts with can also be read
// ahead of it (read_ahead: the engine's zero_grad() starts it), beside the forward and backward; a
// kept chunk is only made sure of there (its pages mapped again where the kernel reclaimed them).
// RAM thus holds the next step's first chunk from the end of a step, or from zero_grad(), to the
// next step.
//
// Reads between steps (a checkpoint, consolidation) fault the pages in as ordinary memory; the
// kernel may drop those clean pages again whenever RAM is short, and the next step's chunks
// spill them. LARC's norms, where they need the whole master before the first chunk, read it
// whole first (read_whole).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <future>
#include <utility>
#include <vector>

#include "shardkit/core/mapped_file_allocator.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::optim {

class StateSpill {
 public:
  // `per_piece`: for each buffer on `disk`, its view of every piece, in pieces order. `rest`:
  // ranges on `disk` that no piece spans (a parameter shard's padding), which only the drops
  // between steps take out of RAM (a step does not touch them).
  StateSpill(const MappedFileAllocator& disk, std::vector<std::vector<Tensor>> per_piece,
             std::vector<std::pair<const void*, std::size_t>> rest = {})
      : disk_(&disk), per_piece_(std::move(per_piece)), rest_(std::move(rest)) {}

  // Waits until the pieces read before are in RAM (the chunk about to be updated), then starts
  // reading pieces [begin, end) beside its update; an empty range only waits. A range that
  // read_ahead() started, or that the step before kept, was loaded for writing already: a
  // file's span of it still in RAM costs a look (mincore), what left RAM meanwhile comes back in
  // large requests instead of a fault a page (reclaimed by the kernel, or dropped by a gather of
  // FSDP's shards on disk that began before the read ahead had brought them in).
  void prefetch(std::size_t begin, std::size_t end) {
    if (ahead_ == std::pair{begin, end} && begin < end) {
      ahead_ = {0, 0};
      kept_ = false;
      wait_for_read();
      start_reading(begin, end, true);
      return;
    }
    forget_kept();
    wait_for_read();
    start_reading(begin, end);
  }
  // Starts reading pieces [begin, end) before the step -- the next step's first chunk, beside
  // the forward and backward -- so that the step's prefetch of that range finds it coming.
  // The chunk the step before kept is made sure of, cheaply: what of it is still in RAM costs a
  // look, what the kernel reclaimed comes back now instead of a fault a page.
  void read_ahead(std::size_t begin, std::size_t end) {
    const bool same = ahead_ == std::pair{begin, end} && begin < end;
    if (same && !kept_) return;  // (already on its way)
    if (!same) forget_kept();
    wait_for_read();
    start_reading(begin, end, same);
    ahead_ = {begin, end};
    kept_ = false;
  }
  // The read in flight finished (its error, if any, thrown here; a range read ahead is then
  // read again by the step that needs it).
  void wait_for_read() {
    if (!reading_.valid()) return;
    try {
      reading_.get();
    } catch (...) {
      ahead_ = {0, 0};
      kept_ = false;
      throw;
    }
  }
  // Buffer `buffer` read whole into RAM, for reading, before returning: what reads it before the
  // first chunk (LARC's norms of the master) then reads it at the disk's pace, not a fault a
  // page. Its clean pages are dropped with the chunks.
  void read_whole(std::size_t buffer) {
    wait_for_read();
    for (const auto& [data, bytes] : ranges_of(per_piece_.at(buffer), 0, pieces())) {
      bytes_read_ += disk_->missing_bytes(data, bytes);
      disk_->load(data, bytes, false);
    }
  }
  // Pieces [begin, end) were updated: start their write-back, unless they are the step's last
  // chunk (`last`: kept in RAM for the next step, which updates them first; written back after
  // that update, or by a drop); finish the chunk before them on disk and drop it from RAM.
  void done(std::size_t begin, std::size_t end, bool last) {
    if (!last)
      for (const auto& [data, bytes] : ranges(begin, end)) disk_->spill(data, bytes, false);
    if (previous_.second > previous_.first) drop(previous_.first, previous_.second, {begin, end});
    previous_ = {begin, end};
  }
  // The step's last chunk done: it stays in RAM as the next step's first chunk; whatever else
  // of the state came back into RAM meanwhile is dropped (the kernel's read-around of faults
  // near a chunk's edges, about 7% of ResNet-50's master here: cheap to drop where nothing is
  // resident).
  void finish() {
    wait_for_read();
    const auto [begin, end] = previous_;
    previous_ = {0, 0};
    ahead_ = {0, 0};
    kept_ = false;
    if (begin >= end) return drop_all();
    drop_rest();  // (what the kernel read around the chunks' spans)
    drop(0, begin, {begin, end});
    drop(end, pieces(), {begin, end});
    ahead_ = {begin, end};
    kept_ = true;
    // The kept chunk is written back after the next step's update of it, where a drop waits
    // for it -- but a state of one chunk is never dropped by a step: the kernel's flusher
    // writes it back, and a failure there, unchecked, could leave its pages clean and then
    // evicted (the state read back as the disk's old bytes). Checked here, once a step.
    for (const auto& [data, bytes] : ranges(begin, end)) disk_->check_write_back(data, bytes);
  }
  // Everything on disk and out of RAM but the next step's first chunk, where one is kept or read
  // ahead (what wrote or read the state between steps -- a post-step hook, a save -- leaves
  // RAM as the step did).
  void drop_all_but_next() {
    wait_for_read();
    drop_rest();
    const auto next = ahead_;
    if (next.first >= next.second) return drop_all();
    drop(0, next.first, next);
    drop(next.second, pieces(), next);
  }
  // Everything on disk and out of RAM (after the buffers were first written), a chunk read
  // ahead or kept included.
  void drop_all() {
    wait_for_read();
    ahead_ = {0, 0};
    kept_ = false;
    drop_rest();
    if (pieces() > 0) drop(0, pieces());
  }
  // A step that failed part-way: waits for the read in flight (its error, if any, is dropped:
  // the step's own is on its way) and forgets the chunk before, so the next step starts clean.
  void abandon() noexcept {
    if (reading_.valid()) reading_.wait();
    reading_ = {};
    previous_ = {0, 0};
    ahead_ = {0, 0};
    kept_ = false;
  }
  // The bytes pieces [begin, end) of one buffer span (none when they are all empty).
  static std::vector<std::pair<const void*, std::size_t>> ranges_of(
      const std::vector<Tensor>& views, std::size_t begin, std::size_t end) {
    std::uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (std::size_t k = begin; k < end; ++k) {
      if (views[k].numel() == 0) continue;
      const auto at = reinterpret_cast<std::uintptr_t>(views[k].data_ptr());
      lo = std::min(lo, at);
      hi = std::max(hi, at + views[k].nbytes());
    }
    if (lo >= hi) return {};
    return {{reinterpret_cast<const void*>(lo), hi - lo}};
  }
  // The state's bytes in RAM now.
  std::size_t resident_bytes() const {
    std::size_t total = 0;
    for (const auto& [data, bytes] : ranges(0, pieces()))
      total += disk_->resident_bytes(data, bytes);
    for (const auto& [data, bytes] : rest_) total += disk_->resident_bytes(data, bytes);
    return total;
  }
  // The bytes of the state that were not in RAM when a read of them started, since the spill
  // was made (whole pages): what the steps and their reads ahead asked of the disk. Not all
  // the disk read: the kernel's own read-ahead brings part of a chunk in with the one before
  // it (up to the device's read_ahead_kb a file), and those pages are then found in RAM.
  std::size_t bytes_read() const { return bytes_read_; }

 private:
  // A kept chunk that the next step will not start with (a read ahead of another range, a
  // step that starts elsewhere) is dropped, so that RAM holds no more than it would without it.
  void forget_kept() {
    if (!kept_) return;
    kept_ = false;
    drop(ahead_.first, ahead_.second);
    ahead_ = {0, 0};
  }

  // `loaded`: the range was loaded for writing before (kept, or read ahead), so a file's span of
  // it wholly in RAM is still mapped writable and is left alone -- walking its page tables again
  // cost 1.5% of the custom loop's time. Otherwise every span is loaded: pages in RAM but mapped
  // for reading only (a whole read of the master, the kernel's read-around) are mapped writable
  // at once instead of a fault a page at the update's first write.
  void start_reading(std::size_t begin, std::size_t end, bool loaded = false) {
    std::vector<std::pair<const void*, std::size_t>> loading;
    for (const auto& range : ranges(begin, end)) {
      const auto missing = disk_->missing_bytes(range.first, range.second);
      bytes_read_ += missing;
      if (missing > 0 || !loaded) loading.push_back(range);
    }
    if (loading.empty()) return;
    reading_ = disk_->start_loading(std::move(loading), true);
  }

  std::size_t pieces() const { return per_piece_.empty() ? 0 : per_piece_[0].size(); }

  void drop_rest() const {
    for (const auto& [data, bytes] : rest_) disk_->spill(data, bytes, true);
  }

  void drop(std::size_t begin, std::size_t end) const {
    for (const auto& [data, bytes] : ranges(begin, end)) disk_->spill(data, bytes, true);
  }
  // Pieces [begin, end) out of RAM, short of the pages that pieces `keep` (a chunk beside
  // them, staying in RAM) touch in each file: a page two chunks share stays with the one kept.
  void drop(std::size_t begin, std::size_t end, std::pair<std::size_t, std::size_t> keep) const {
    const auto page = static_cast<std::uintptr_t>(disk_->page_bytes());
    for (const auto& views : per_piece_) {
      const auto kept = ranges_of(views, keep.first, keep.second);
      for (const auto& [data, bytes] : ranges_of(views, begin, end)) {
        auto from = reinterpret_cast<std::uintptr_t>(data), to = from + bytes;
        if (!kept.empty()) {
          const auto at = reinterpret_cast<std::uintptr_t>(kept[0].first);
          const auto first = at / page * page,
                     last = (at + kept[0].second + page - 1) / page * page;
          if (from < first)
            to = std::min(to, first);
          else
            from = std::max(from, last);
        }
        if (from < to) disk_->spill(reinterpret_cast<const void*>(from), to - from, true);
      }
    }
  }

  // Per buffer, the bytes pieces [begin, end) span.
  std::vector<std::pair<const void*, std::size_t>> ranges(std::size_t begin,
                                                          std::size_t end) const {
    std::vector<std::pair<const void*, std::size_t>> out;
    for (const auto& views : per_piece_) {
      const auto range = ranges_of(views, begin, end);
      out.insert(out.end(), range.begin(), range.end());
    }
    return out;
  }

  const MappedFileAllocator* disk_;
  std::vector<std::vector<Tensor>> per_piece_;
  std::vector<std::pair<const void*, std::size_t>> rest_;  // on disk, in no piece's span
  std::pair<std::size_t, std::size_t> previous_{0, 0};
  // What read_ahead() started, or the step before kept in RAM (kept_), until a step uses it.
  std::pair<std::size_t, std::size_t> ahead_{0, 0};
  bool kept_ = false;
  std::size_t bytes_read_ = 0;
  std::future<void> reading_;  // the next chunk's read, on a thread of its own
};

}  // namespace shardkit::optim
