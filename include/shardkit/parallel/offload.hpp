// CPU offload for the engines: what DeepSpeed's ZeRO-Offload, PyTorch FSDP's CPUOffload and
// FairScale's move_grads_to_cpu / move_params_to_cpu do, on shardkit's engines.
//
//   optimizer  the f32 master, the optimizer state and the step move to host memory (pinned
//              on a GPU machine) and run on the host's threads with the same fused functors
//              (optim::OptimizerOffload): the reduced gradients come down -- under sdp and fsdp
//              bucket by bucket during the backward, kept on the host (the device keeps no
//              reduced gradient); under ddp and oss before the step -- and the updated
//              parameters go back up, chunk by chunk, overlapping the update. Any stage.
//              Device memory keeps the parameters the stage keeps, ddp's and oss's
//              gradients, and no optimizer state.
//   params     fsdp only (PyTorch's offload_params): each unit's parameter shard lives in host
//              memory too, and goes up into the gathered buffer at each gather. Device memory
//              then keeps the units in use and no other model state of theirs (qgZ's
//              residuals aside). Implies `optimizer`.
//   nvme_path  the f32 master and the optimizer state in files in that directory on a fast
//              disk instead of host memory (DeepSpeed ZeRO-Infinity's offload_optimizer device
//              "nvme"): mapped into the address space (core/mapped_file_allocator.hpp) and
//              streamed through RAM chunk by chunk at each step (optim/state_spill.hpp), so host
//              memory holds a few chunks of them. With `params`, fsdp's parameter shards live
//              there too (offload_param device "nvme"): each gather reads its unit's shard and
//              drops it from RAM again, the step streams them with the state. Implies
//              `optimizer`.
//
// The host side has a context of its own (make_host_context): its memory statistics are the
// host's share, the engine's context's stay the device's. On the CPU path the two are ledgers
// of the same RAM, and an offloaded run computes the same bits as one without offload.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shardkit/core/context.hpp"
#include "shardkit/core/mapped_file_allocator.hpp"
#include "shardkit/parallel/stage.hpp"

namespace shardkit::parallel {

struct OffloadOptions {
  bool optimizer = false;   // master, optimizer state and step on the host
  bool params = false;      // fsdp: parameter shards on the host between uses (and `optimizer`)
  std::string nvme_path{};  // master and optimizer state in files there (and `optimizer`);
                            // with `params`, the shards too
  // The offloaded step updates chunks of whole pieces of at least this many elements: while
  // one chunk is updated, the one before goes up (its parameters) and, under nvme_path, the
  // one after is read in, so RAM holds about three chunks of the state there.
  std::int64_t chunk_numel = std::int64_t{1} << 22;
  bool enabled() const { return optimizer || params || !nvme_path.empty(); }
  bool on_disk() const { return !nvme_path.empty(); }
};

inline void validate(const OffloadOptions& o, Stage stage) {
  check(o.chunk_numel > 0, "offload.chunk_numel is ", o.chunk_numel,
        "; give a positive number of elements per chunk of the offloaded step (default 4 Mi)");
  check(!o.params || stage == Stage::fsdp, "offload.params keeps parameter shards on the host, ",
        "and under ", stage_name(stage),
        " every rank holds the whole parameters for its compute; use Stage::fsdp with "
        "offload.params, or offload.optimizer alone");
}

// The engine's host context when offload is on (nullptr otherwise).
inline std::unique_ptr<Context> offload_context(const Context& device, const OffloadOptions& o) {
  return o.enabled() ? make_host_context(device) : nullptr;
}

// The engine's disk context under offload to NVMe (nullptr otherwise): a host context whose
// memory is files in nvme_path.
inline std::unique_ptr<Context> disk_context(const Context& device, const OffloadOptions& o) {
  return o.on_disk() ? make_host_context(device, std::make_shared<MappedFileAllocator>(o.nvme_path))
                     : nullptr;
}

}  // namespace shardkit::parallel
