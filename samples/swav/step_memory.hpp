// What a rank's training step holds beyond its model states -- activations, the loss's queue
// scores and Sinkhorn's buffers, the kernels' scratch -- measured before the ranks start, on
// this machine: the trainer's own step at a few small batches on one rank, fitted as a line in
// the batch (sk::parallel::profile_activations). check_ranks_fit (rank_setup.hpp) scales it to
// the config's batch and refuses a world whose steps would not fit, where the ranks would
// otherwise be killed for memory in their first step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "datasets.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "swav_config.hpp"
#include "trainer.hpp"

namespace swav {

// The trainer's first step at `batch` images on one CPU rank of `threads` CPU threads (a rank's
// share: oneDNN's scratch grows with them): the bytes it held at its peak beyond what it keeps
// (SwavTrainer::step_transient_bytes). What the memory plan counts apart, or a world of one rank
// would not show, is left out: the stage is ddp (fsdp's gathered units, offload and the
// communication buffers are the plan's), SyncBatchNorm is off. So is MACHINE.CUDA_GRAPH, whose
// capture pool keeps its blocks by exact size beside the allocator's on the CPU: not counted.
// The queue is in use from this first step, as it is at the run's peak once it starts.
inline std::int64_t step_transient_bytes(const SwavConfig& c, const Datasets& data,
                                         std::int64_t batch, int threads) {
  SwavConfig probe = c;
  probe.batch_size = batch;
  probe.parallel = {};
  probe.parallel.precision = c.parallel.precision;
  probe.sync_bn_group = 0;
  probe.cuda_graph = "false";
  probe.loss.queue_start_iter = 0;
  std::int64_t bytes = 0;
  sk::comm::RunRanksOptions one_rank;
  one_rank.cpu_threads_per_rank = threads;
  sk::comm::run_ranks(
      1,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        SwavTrainer trainer(probe, ctx, comm, data, nullptr);
        bytes = trainer.step_transient_bytes();
      },
      one_rank);
  return bytes;
}

// The step's bytes as a line in the batch, for a rank of `threads` CPU threads (a rank's share
// of the cores: sk::comm::cpu_threads_per_rank for ranks as threads, sk::default_cpu_threads
// for a launched process): measured at 2 and 4 images, and at 8 where the config's batch is 8 or
// more (the line through the last two; profile_activations); an empty profile where the
// training set holds fewer than 4 images. That is 14 images' forward and backward on one rank:
// on the 2-core Xeon about 20 s for VISSL's ResNet-50 with 2 x 224 + 6 x 96 crops on 2 threads,
// 7 s for its ResNet-18 on 1, under 0.1 s for the quick config. A step that does not fit in
// memory even there is refused as the config's problem.
inline sk::parallel::ActivationProfile measure_step_memory(const SwavConfig& c,
                                                           const Datasets& data, int threads) {
  const std::int64_t most =
      std::min<std::int64_t>(std::clamp<std::int64_t>(c.batch_size, 4, 8), data.train.count);
  if (most < 4) return {};
  try {
    return sk::parallel::profile_activations(
        [&](std::int64_t batch) { return step_transient_bytes(c, data, batch, threads); }, 2, most);
  } catch (const std::exception& e) {  // sk::OutOfMemory, std::bad_alloc: the config's problem
    if (dynamic_cast<const sk::OutOfMemory*>(&e) == nullptr &&
        dynamic_cast<const std::bad_alloc*>(&e) == nullptr)
      throw;
    throw ConfigError("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = " + std::to_string(c.batch_size) +
                      ": one rank's step of a few images, measured before the ranks start, ran "
                      "out of memory (" +
                      e.what() + "); use a smaller model or crops, or a machine with more memory");
  }
}

}  // namespace swav
