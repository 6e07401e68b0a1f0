// OffloadTransport: how an offloaded optimizer's data crosses between the device and the host
// -- the gradients come down before the step in one batch of copies and one wait (unless the
// engine already kept them on the host, brought down bucket by bucket in the backward); the
// updated parameters go up in chunks of whole pieces, each chunk's copies queued before the
// next chunk is updated, and the step waits for the last (DeepSpeed's ZeRO-Offload, PyTorch FSDP's
// CPUOffload). Without offload, or with FSDP's parameter shards offloaded too (they are
// updated in place on the host), nothing goes up and the update is one chunk.
#pragma once

#include <cstdint>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/optim/master_copies.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

// The end of the chunk that starts at piece `begin` when an update goes in chunks: whole
// pieces, at least `chunk_numel` elements of them (fewer at the end). What the offloaded step
// sends up and streams from disk, and what the memory planner bounds RAM by.
inline std::size_t offload_chunk_end(const std::vector<shard::StatePiece>& pieces,
                                     std::size_t begin, std::int64_t chunk_numel) {
  std::int64_t numel = 0;
  std::size_t end = begin;
  while (end < pieces.size() && numel < chunk_numel) numel += pieces[end++].numel();
  return end;
}

// Where an optimizer keeps its master, state and step: on the parameters' context (host ==
// nullptr), or offloaded to a CPU context.
struct OptimizerOffload {
  Context* host = nullptr;  // a CPU context (sk::make_host_context); nullptr: no offload
  // The piece views given are themselves in `host`'s memory (FSDP's offloaded parameter
  // shards): the step then updates them in place, nothing goes back up.
  bool params_on_host = false;
  // The f32 master and the state in files on a fast disk instead of host memory (a context
  // whose allocator is a MappedFileAllocator; state_spill.hpp streams them through RAM at the
  // step). nullptr: in `host`'s memory.
  Context* disk = nullptr;
  // Offloaded updates run in chunks of whole pieces of at least this many elements; each
  // chunk's parameters are queued for the device before the next chunk is updated (and, on
  // disk, the next chunk read while this one is updated).
  std::int64_t chunk_numel = std::int64_t{1} << 22;
  // The gradient views given to step() are in `host`'s memory already (sdp, fsdp: the engine
  // keeps the reduced gradients there, each bucket's part brought down during the backward):
  // nothing comes down at the step, and clipping's norms are formed on the host.
  bool grads_on_host = false;
  // FSDP's parameter shards offloaded to NVMe (with params_on_host): the tensors, in `disk`'s
  // files, that the piece views given are views of. The step streams them through RAM with the
  // master and state (in f32 they are the master); what of them no piece covers (padding) is
  // dropped with the rest. Empty: the piece views are not on disk.
  std::vector<Tensor> disk_shards{};
  bool enabled() const { return host != nullptr; }
  bool params_on_disk() const { return !disk_shards.empty(); }
  // Where the master and state live.
  Context& state_home() const { return disk != nullptr ? *disk : *host; }
};

class OffloadTransport {
 public:
  OffloadTransport(Context& device, const shard::PieceTable& table, int rank,
                   OptimizerOffload offload)
      : device_(&device), table_(&table), rank_(rank), offload_(offload) {
    if (offload.enabled())
      check(offload.host->device().is_cpu(), "ShardedOptimizer: the offload context is on ",
            offload.host->device(), "; offload needs a CPU context (sk::make_host_context(ctx))");
    check(offload.chunk_numel > 0, "ShardedOptimizer: offload chunk_numel must be > 0, got ",
          offload.chunk_numel);
    check(offload.disk == nullptr || offload.enabled(),
          "ShardedOptimizer: state on disk needs a host context as well (OptimizerOffload::host)");
    check(offload.disk_shards.empty() || (offload.disk != nullptr && offload.params_on_host),
          "ShardedOptimizer: parameters on disk need the disk context (OptimizerOffload::disk) "
          "and params_on_host (they are updated in place there)");
    check(!offload.grads_on_host || offload.enabled(),
          "ShardedOptimizer: gradients on the host need a host context (OptimizerOffload::host)");
  }

  bool enabled() const { return offload_.enabled(); }
  const OptimizerOffload& offload() const { return offload_; }
  // Whether updated parameters go up to the device after the update.
  bool sends_up() const { return offload_.enabled() && !offload_.params_on_host; }

  // This step's gradients in host memory: a staging buffer laid out like the state, or the
  // views given when the engine kept them on the host (grads_on_host).
  const std::vector<Tensor>& stage_grads(const std::vector<Tensor>& grads) {
    if (grads.empty()) return grads;
    if (offload_.grads_on_host) {
      // (finish() waited for their copies; this wait orders the host's update after whatever
      // else is queued -- a gather's upload of a shard it is about to update in place, after a
      // no_sync backward that queued no copy -- and costs nothing on an idle device)
      device_->synchronize();
      return grads;
    }
    if (!grad_buffer_.defined() || grad_buffer_.dtype() != grads[0].dtype()) {
      grad_buffer_ = Tensor();
      grad_buffer_ = empty(*offload_.host, {table_->state_numel(rank_)}, grads[0].dtype(),
                           MemoryCategory::gradients);
      host_grads_ = state_views(*table_, rank_, grad_buffer_);
    }
    for (std::size_t k = 0; k < grads.size(); ++k) copy_async(*device_, host_grads_[k], grads[k]);
    device_->synchronize();
    return host_grads_;
  }

  // The end of the chunk of pieces that starts at `begin`: whole pieces of at least
  // chunk_numel elements when sending up or streaming the state from disk, else every piece
  // left.
  std::size_t chunk_end(std::size_t begin) const {
    const auto& pieces = table_->pieces(rank_);
    const bool chunked = sends_up() || offload_.disk != nullptr;
    return chunked ? offload_chunk_end(pieces, begin, offload_.chunk_numel) : pieces.size();
  }
  // Queues pieces [begin, end)'s updated values for the device.
  void send_up(const MasterCopies& copies, std::size_t begin, std::size_t end) {
    for (std::size_t k = begin; k < end; ++k)
      copy_async(*device_, copies.piece_params()[k], copies.outgoing(k));
  }
  // Waits for every chunk sent up.
  void wait() { device_->synchronize(); }

 private:
  Context* device_;
  const shard::PieceTable* table_;
  int rank_;
  OptimizerOffload offload_;
  Tensor grad_buffer_;  // the step's gradients in host memory
  std::vector<Tensor> host_grads_;
};

}  // namespace shardkit::optim
