// FlatParam: the storage of one flat parameter -- its ShardPlan, this rank's buffer with one
// view per parameter, and under sharded residency this rank's shard. The collectives that keep
// the ranks' copies in step are free functions over it (collectives.hpp); the group that owns it
// at run time, with its gradients and its gather state, is a ParamGroup (param_group.hpp).
//
// The buffer's dtype is the compute dtype: f32, or f16/bf16 under mixed precision (the f32
// master then lives in the sharded optimizer, for the pieces each rank updates).
//
// Residency::replicated (ddp, oss, sdp): every rank keeps the whole flat buffer, counted as
// parameters. Residency::sharded (fsdp): a rank keeps only its even 1/N shard (parameters);
// the whole buffer (communication) exists between materialize() and release(), and the
// parameter views keep naming it while it is released (core/storage.hpp), so touching them then
// fails with the reason given to release(). With a `shard_home` context (FSDP's parameter
// offload) the shard lives in that context's memory -- the host's, or files on a fast disk under
// offload to NVMe -- and goes up into the gathered buffer at each gather; a shard in files can be
// read in ahead of its gather (read_shard_ahead), beside the compute before it.
#pragma once

#include <chrono>
#include <cstddef>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/mapped_file_allocator.hpp"
#include "shardkit/ops/quantize.hpp"
#include "shardkit/parallel/flat_buffer.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

// The parameters of a group of ranks as one flat buffer, partitioned by a ShardPlan over `comm`.
// Under hybrid sharding (comm/hybrid_mesh.hpp) `comm` is this rank's shard group and `replicas`
// the ranks that hold the same range in the other groups.
class FlatParam {
 public:
  FlatParam(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
            shard::PartitionKind partition, Residency residency = Residency::replicated,
            DType dtype = DType::f32, comm::Communicator* replicas = nullptr,
            Context* shard_home = nullptr)
      : ctx_(&ctx),
        shard_home_(shard_home != nullptr ? shard_home : &ctx),
        comm_(&comm),
        replicas_(replicas != nullptr && replicas->size() > 1 ? replicas : nullptr),
        residency_(residency),
        plan_(specs, comm.size(), checked_partition(partition, residency)),
        params_(residency == Residency::replicated
                    ? FlatBuffer(ctx, plan_.layout(), dtype, MemoryCategory::parameters)
                    : FlatBuffer(ctx, plan_.layout(), dtype, MemoryCategory::communication,
                                 "the whole buffer of a sharded flat parameter is not gathered")) {
    check(shard_home == nullptr || residency == Residency::sharded,
          "FlatParam: a shard home is for sharded residency (fsdp)");
    if (residency == Residency::sharded)
      shard_ = zeros(shard_home != nullptr ? *shard_home : ctx, {plan_.numel(comm.rank())}, dtype,
                     MemoryCategory::parameters);
    shard_files_ = files_of(shard_, *shard_home_);
  }

  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  Context& context() const { return *ctx_; }
  comm::Communicator& communicator() const { return *comm_; }
  // Hybrid sharding's other groups (nullptr without hybrid sharding).
  comm::Communicator* replicas() const { return replicas_; }
  DType dtype() const { return params_.dtype(); }
  const shard::ShardPlan& plan() const { return plan_; }
  const FlatBuffer& params() const { return params_; }
  const Tensor& param(std::size_t i) const { return params_[i]; }
  bool sharded() const { return residency_ == Residency::sharded; }
  // This rank's shard of the flat buffer (sharded residency), and the context whose memory holds
  // it (the offload host context under offloaded parameters).
  const Tensor& shard() const { return shard_; }
  Context& shard_context() const { return *shard_home_; }

  // The pieces this rank updates: every trainable parameter when `every_rank` (DDP), else the
  // rank's range of the plan. Views of their parameter elements: piece_params().
  std::vector<shard::ParamPiece> updated_pieces(bool every_rank) const {
    if (!every_rank) return plan_.pieces(comm_->rank());
    std::vector<shard::ParamPiece> all;
    for (auto i : plan_.trainable_in_layout_order()) {
      const auto& slot = plan_.layout()[i];
      all.push_back(shard::ParamPiece{{i, 0, slot.numel}, slot.offset});
    }
    return all;
  }
  // Sharded: views of the shard, which the optimizer updates in place.
  std::vector<Tensor> piece_params(const std::vector<shard::ParamPiece>& pieces) const {
    std::vector<Tensor> views;
    const std::int64_t base = sharded() ? plan_.begin(comm_->rank()) : 0;
    const Tensor& values = sharded() ? shard_ : params_.flat();
    for (const auto& piece : pieces)
      views.push_back(
          values.slice(0, piece.flat_begin - base, piece.flat_begin - base + piece.numel()));
    return views;
  }

  // Queues this rank's shard into its range of the gathered buffer (stream-ordered before the
  // all-gather; a shard in host memory goes up without blocking). A shard in files (offload to
  // NVMe) is read in first, in large requests -- or was, by a read ahead, which this waits for --
  // and what had to be read is dropped from RAM again once the copy has taken it (a copy from
  // pageable memory returns once it has staged its source; were it to read later, the pages
  // come from the file): so between uses the shards cost disk, not RAM -- the optimizer's step
  // streams them with its state, and the chunk it kept for the next step stays (its pages
  // were in RAM when the reads began). Pages that another reader brought in meanwhile go too
  // (the optimizer's read of its first chunk after a drop: its step loads them again).
  void upload_shard() {
    const int rank = comm_->rank();
    const Tensor range = params_.flat().slice(0, plan_.begin(rank), plan_.end(rank));
    const MappedFileAllocator* files = shard_files();
    if (files == nullptr) return copy_async(*ctx_, range, shard_);
    ctx_->refuse_in_capture("a gather of a parameter shard on disk (offload to NVMe)",
                            "the disk's reads and drops are the host's; train without capture "
                            "under offload.params with nvme_path");
    const auto start = std::chrono::steady_clock::now();
    const auto read_ahead = finish_read_ahead();
    // (What a read ahead did not bring -- reclaimed by the kernel since, or a failed read,
    // which this read then reports -- or all of what is missing without one.)
    const auto missing = files->missing_runs(shard_.data_ptr(), shard_.nbytes());
    if (!missing.empty()) files->load(shard_.data_ptr(), shard_.nbytes(), false);
    for (const auto& run : missing) shard_reads_.at_gather += run.second;
    shard_reads_.wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    copy_async(*ctx_, range, shard_);
    for (const auto& [data, bytes] : read_ahead) files->drop_clean(data, bytes);
    for (const auto& [data, bytes] : missing) files->drop_clean(data, bytes);
  }

  // A shard in files (offload to NVMe): starts reading what of it is not in RAM on a thread of
  // its own and returns, so the disk works beside the compute before the gather (FSDP's hooks
  // read the unit after those gathered ahead; DeepSpeed's ZeRO-Infinity prefetches its
  // parameter partitions from NVMe likewise). The next upload_shard() waits for it and drops
  // what it read; a read nobody used is dropped by drop_read_ahead(). No-op for a shard
  // elsewhere, a read already in flight, or during a capture (whose gathers refuse the disk).
  // Never throws: a read ahead that cannot start (no thread to be had) leaves the gather to
  // read as it would without one.
  void read_shard_ahead() noexcept {
    const MappedFileAllocator* files = shard_files();
    if (files == nullptr || reading_.valid() || ctx_->capturing()) return;
    try {
      auto runs = files->missing_runs(shard_.data_ptr(), shard_.nbytes());
      if (runs.empty()) return;
      reading_ = files->start_loading(runs, false);
      for (const auto& run : runs) shard_reads_.ahead += run.second;
      read_ahead_ = std::move(runs);
    } catch (...) {
      reading_ = {};
      read_ahead_.clear();
    }
  }
  // A read ahead that no gather used (the pass ended before it, a release, another unit's read
  // ahead): waited for, and what it brought into RAM dropped again (clean pages: nothing to
  // write back). Never throws (releases run on error paths too).
  void drop_read_ahead() noexcept {
    try {
      const MappedFileAllocator* files = shard_files();
      for (const auto& [data, bytes] : finish_read_ahead()) files->drop_clean(data, bytes);
    } catch (...) {  // (mapping_of's checks: the shard is the allocator's, they hold)
      read_ahead_.clear();
    }
  }
  // A shard in files, since construction: the bytes read from disk by reads ahead and by
  // gathers that found them missing (none read ahead, or reclaimed since), whole pages; and the
  // seconds gathers held the host for the disk (waiting for a read ahead, or reading).
  struct ShardReads {
    std::size_t ahead = 0;
    std::size_t at_gather = 0;
    double wait_seconds = 0;
  };
  const ShardReads& shard_reads() const { return shard_reads_; }

  // The whole buffer's memory back, its values undefined (to be gathered, or written whole).
  void materialize() { params_.flat().storage()->materialize(); }
  // Frees the whole buffer; `reason` is what a later use of a parameter view says.
  void release(std::string reason) { params_.flat().storage()->release(std::move(reason)); }
  bool gathered() const { return !params_.flat().storage()->released(); }
  // After the caller wrote full values into the gathered buffer: take this rank's range.
  void copy_range_to_shard() {
    const int rank = comm_->rank();
    copy(*ctx_, shard_, params_.flat().slice(0, plan_.begin(rank), plan_.end(rank)));
  }
  void fill_zero() { fill(*ctx_, params_.flat(), 0.0); }

  // Per-tensor scales (ops/quantize.hpp): slot p is parameter p, the last slot the padding
  // (amax 0: its codes and values 0). `rows` holds every rank's chunk table of its range, rank
  // after rank, on the device (made and uploaded at the first call, outside any capture:
  // a warm-up step's gather); rank r's rows are [row_at[r], row_at[r + 1]), counted from
  // plan().begin(r).
  struct SlotChunks {
    Tensor rows;
    std::vector<std::int64_t> row_at;
    std::int64_t slots = 0;
    // Rank r's rows.
    Tensor of(int r) const {
      const auto i = static_cast<std::size_t>(r);
      return rows.slice(0, row_at[i], row_at[i + 1]);
    }
  };
  const SlotChunks& slot_chunks() {
    if (slot_chunks_.rows.defined()) return slot_chunks_;
    const auto& layout = plan_.layout();
    const auto padding = static_cast<std::int64_t>(layout.size());
    std::vector<ops::SlotRange> ranges;
    std::int64_t at = 0;
    for (std::size_t p = 0; p < layout.size(); ++p) {
      const auto& slot = layout[p];
      if (slot.offset > at) ranges.push_back({at, slot.offset, padding});
      ranges.push_back({slot.offset, slot.offset + slot.numel, static_cast<std::int64_t>(p)});
      at = slot.offset + slot.numel;
    }
    if (layout.padded_numel() > at) ranges.push_back({at, layout.padded_numel(), padding});
    std::vector<std::int64_t> rows;
    slot_chunks_.row_at.assign(1, 0);
    for (int r = 0; r < plan_.world_size(); ++r) {
      const auto mine = ops::slot_chunks(ranges, plan_.begin(r), plan_.end(r));
      rows.insert(rows.end(), mine.begin(), mine.end());
      slot_chunks_.row_at.push_back(static_cast<std::int64_t>(rows.size() / 3));
    }
    slot_chunks_.rows = from_vector(*ctx_, rows, {static_cast<std::int64_t>(rows.size() / 3), 3});
    slot_chunks_.slots = padding + 1;
    return slot_chunks_;
  }

 private:
  static shard::PartitionKind checked_partition(shard::PartitionKind partition,
                                                Residency residency) {
    check(residency == Residency::replicated || partition == shard::PartitionKind::flat,
          "sharded parameters (fsdp) use the even flat split; got the ",
          shard::partition_kind_name(partition), " partition");
    return partition;
  }

  // The file allocator holding the shard (offload to NVMe), else nullptr (also for an empty
  // shard: nothing to read). Found once: the gathers and every unit's hooks ask.
  const MappedFileAllocator* shard_files() const { return shard_files_; }
  static const MappedFileAllocator* files_of(const Tensor& shard, const Context& home) {
    if (!shard.defined() || shard.numel() == 0) return nullptr;
    return dynamic_cast<const MappedFileAllocator*>(&home.allocator());
  }
  // Waits for a read ahead in flight; the runs it was reading (none without one), for the
  // caller to drop. A failed read is not reported here: a read loses nothing, and the gather
  // that needs the shard finds its pages missing and reads them itself, on the host's thread,
  // where a failing disk then raises its IoError.
  std::vector<std::pair<const void*, std::size_t>> finish_read_ahead() noexcept {
    if (!reading_.valid()) return {};
    auto runs = std::move(read_ahead_);
    read_ahead_.clear();
    try {
      reading_.get();
    } catch (...) {  // (see above)
    }
    return runs;
  }

  Context* ctx_;
  Context* shard_home_;
  comm::Communicator* comm_;
  comm::Communicator* replicas_;  // hybrid sharding's other groups (nullptr: none)
  Residency residency_;
  shard::ShardPlan plan_;
  FlatBuffer params_;
  Tensor shard_;            // sharded residency: this rank's range, the master copy
  SlotChunks slot_chunks_;  // per-tensor-scaled gathers' chunk tables (made at first use)
  const MappedFileAllocator* shard_files_ = nullptr;  // shard_files()
  // A shard in files: the read ahead in flight (on a thread of its own) and the runs of pages
  // it reads, which the gather that uses it drops again.
  std::future<void> reading_;
  std::vector<std::pair<const void*, std::size_t>> read_ahead_;
  ShardReads shard_reads_;
};

}  // namespace shardkit::parallel
