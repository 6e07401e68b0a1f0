// What each rank of the SwAV trainer will run and hold, known before the ranks start: the
// parallel options and optimizer a rank builds its sharded module with, the memory plan of its
// states, and the checks that a world of ranks fits the data and the machine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "datasets.hpp"
#include "shardkit/data/stateful_sampler.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "swav_config.hpp"
#include "swav_model.hpp"

namespace swav {

// VISSL's parameter groups: the trainable parameters that get no weight decay -- those of
// batch-norm layers unless regularize_bn, the biases of Linear and Conv layers unless
// regularize_bias.
inline std::vector<std::string> unregularized_params(sk::nn::Module& model, bool regularize_bn,
                                                     bool regularize_bias) {
  std::vector<std::string> out;
  for (const auto& [path, module] : model.named_modules()) {
    const bool bn = dynamic_cast<sk::nn::BatchNorm*>(module) != nullptr;
    const bool has_bias = dynamic_cast<sk::nn::Linear*>(module) != nullptr ||
                          dynamic_cast<sk::nn::Conv2d*>(module) != nullptr;
    for (const auto& [name, p] : module->named_parameters()) {
      if (name.find('.') != std::string::npos || !p.requires_grad()) continue;  // own ones only
      if ((bn && !regularize_bn) || (has_bias && name == "bias" && !regularize_bias))
        out.push_back(path.empty() ? name : path + "." + name);
    }
  }
  return out;
}

// How each rank runs `model` under `c` in a world of `world` ranks: the parallel options (under
// fsdp every residual block of the trunk a unit of its own), the optimizer with VISSL's
// parameter groups, and what each rank will hold, planned before the states exist
// (parallel/memory_plan.hpp): the trainer's set-up, and the check before the ranks start.
struct RankSetup {
  sk::parallel::ParallelOptions parallel;
  sk::optim::OptimizerConfig optimizer;
  sk::parallel::MemoryPlan memory;
};
inline RankSetup rank_setup(SwavModel& model, const SwavConfig& c, int world) {
  RankSetup setup{c.parallel, c.optimizer, {}};
  if (setup.parallel.stage == sk::parallel::Stage::fsdp)
    for (const auto& [path, module] : model.trunk->named_modules())
      if (path.rfind("layer", 0) == 0 && std::count(path.begin(), path.end(), '.') == 1)
        setup.parallel.fsdp.wrap.unit_paths.push_back("trunk." + path);
  setup.optimizer.no_weight_decay = unregularized_params(model, c.regularize_bn, c.regularize_bias);
  sk::parallel::PlannedRun run;
  run.parallel = setup.parallel;
  run.world_size = world;
  run.optimizer = setup.optimizer;
  setup.memory = sk::parallel::plan_module_memory(model, run);
  return setup;
}

// Each rank's share of the training images (the sampler's) holds a batch.
inline void check_batch_fits(const SwavConfig& c, std::int64_t samples_per_rank) {
  if (samples_per_rank < c.batch_size)
    throw ConfigError("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = " + std::to_string(c.batch_size) +
                      " exceeds the " + std::to_string(samples_per_rank) +
                      " training images per rank; use a smaller batch, fewer ranks or more data");
}

// Before the ranks start, what would stop them later or take the machine down, reported
// together: a world of more ranks than training images, each rank's share of the images (the
// sampler's) against its batch, and -- for ranks on the CPU -- the model states of the ranks
// this process runs (`local_ranks`: threads sharing its memory) against the host memory
// available (`available`: available_host_memory(), -1: unknown). The states are planned on a model
// built without parameter memory, as the ranks will hold them (rank_setup); activations come on
// top, so the check is a lower bound: it refuses only what cannot fit. A VISSL config written for 8
// nodes of 8 GPUs would otherwise start 64 threads here, each building its model, and end out of
// memory with no word.
inline void check_ranks_fit(const SwavConfig& c, const Datasets& data, int world, int local_ranks,
                            bool cpu, std::int64_t available = available_host_memory()) {
  ConfigProblems problems;
  problems.attempt([&] {
    if (data.train.count < world)
      throw ConfigError("config.DISTRIBUTED: " + std::to_string(world) + " ranks, but " +
                        std::to_string(data.train.count) +
                        " training images; use fewer ranks (NUM_NODES, NUM_PROC_PER_NODE) or more "
                        "data");
    check_batch_fits(c,
                     sk::data::StatefulDistributedSampler(data.train.count, world, 0, c.batch_size)
                         .samples_per_rank());
  });
  if (cpu && available >= 0)
    problems.attempt([&] {
      sk::Context ctx;
      const auto model = [&] {
        sk::DeferredParameters deferred(ctx);
        return std::make_shared<SwavModel>(ctx, c);
      }();
      const sk::parallel::MemoryPlan plan = rank_setup(*model, c, world).memory;
      const std::int64_t per_rank = plan.parameters + plan.gradients + plan.optimizer_state +
                                    plan.communication + plan.gathered;
      if (per_rank * local_ranks <= available) return;
      char figures[256];
      std::snprintf(figures, sizeof figures,
                    " ranks as threads of this process would hold at least %.2f GB -- each "
                    "rank's parameters, gradients and optimizer state under %s, %.1f MB, before "
                    "its activations -- and this machine has %.2f GB available; ",
                    double(per_rank * local_ranks) / 1e9,
                    std::string(sk::parallel::stage_name(c.parallel.stage)).c_str(),
                    double(per_rank) / 1e6, double(available) / 1e9);
      const std::int64_t fit = available / std::max<std::int64_t>(per_rank, 1);
      throw ConfigError(
          "config.DISTRIBUTED: " + std::to_string(local_ranks) + figures +
          (fit >= 1 ? "run at most " + std::to_string(fit) +
                          " here (NUM_NODES=1, NUM_PROC_PER_NODE=" + std::to_string(fit) + "), "
                    : std::string()) +
          "shard the states (OPTIMIZER.use_zero, MODEL.SHARDED_DDP_SETUP.USE_SDP, "
          "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP), or launch the ranks as processes on several "
          "machines (mpirun)");
    });
  problems.check();
}

}  // namespace swav
