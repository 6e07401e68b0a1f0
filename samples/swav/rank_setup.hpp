// What each rank of the SwAV trainer will run and hold, known before the ranks start: the
// parallel options and optimizer a rank builds its sharded module with, the memory plan of its
// states, and the checks that a world of ranks fits the data and the machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "datasets.hpp"
#include "host_memory.hpp"
#include "shardkit/data/stateful_sampler.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "swav_config.hpp"
#include "swav_model.hpp"

namespace swav {

// VISSL's parameter groups: the trainable parameters that get no weight decay -- those of
// batch-norm layers unless regularize_bn (and their biases unless regularize_bias too), the
// biases of Linear and Conv layers unless regularize_bias.
inline std::vector<std::string> unregularized_params(sk::nn::Module& model, bool regularize_bn,
                                                     bool regularize_bias) {
  std::vector<std::string> out;
  for (const auto& [path, module] : model.named_modules()) {
    const bool bn = dynamic_cast<sk::nn::BatchNorm*>(module) != nullptr;
    const bool has_bias = dynamic_cast<sk::nn::Linear*>(module) != nullptr ||
                          dynamic_cast<sk::nn::Conv2d*>(module) != nullptr;
    for (const auto& [name, p] : module->named_parameters()) {
      if (name.find('.') != std::string::npos || !p.requires_grad()) continue;  // own ones only
      const bool bias = name == "bias";
      if ((bn && !regularize_bn) || ((bn || has_bias) && bias && !regularize_bias))
        out.push_back(path.empty() ? name : path + "." + name);
    }
  }
  return out;
}

// The FSDP units of `model` below the root: every residual block of the trunk, and with VISSL's
// AUTO_WRAP_THRESHOLD > 0 each convolution inside a block that holds at least that many
// parameters, a unit nested in its block's (VISSL's big-convolution policy, which it applies to
// each block of regnet_fsdp; here to ResNet blocks too). Nesting changes when parameters are
// gathered and freed -- the peak a unit needs -- never the values.
inline std::vector<std::string> fsdp_unit_paths(SwavModel& model, std::int64_t threshold) {
  std::vector<std::string> paths;
  for (const std::string& block : model.trunk->block_paths()) paths.push_back("trunk." + block);
  for (const std::string& conv : model.trunk->large_block_convolutions(threshold))
    paths.push_back("trunk." + conv);
  return paths;
}

// How each rank runs `model` under `c` in a world of `world` ranks: the parallel options (under
// fsdp the units of fsdp_unit_paths), the optimizer with VISSL's
// parameter groups (one, every parameter decayed, under construct_single_param_group_only), and
// what each rank will hold, planned before the states exist (parallel/memory_plan.hpp): the
// trainer's set-up, and the check before the ranks start.
struct RankSetup {
  sk::parallel::ParallelOptions parallel;
  sk::optim::OptimizerConfig optimizer;
  sk::parallel::MemoryPlan memory;
};
// (`rank`: the shard rank to plan; -1 the most loaded)
inline RankSetup rank_setup(SwavModel& model, const SwavConfig& c, int world, int rank = -1) {
  RankSetup setup{c.parallel, c.optimizer, {}};
  if (setup.parallel.stage == sk::parallel::Stage::fsdp)
    setup.parallel.fsdp.wrap.unit_paths = fsdp_unit_paths(model, c.fsdp_wrap_threshold);
  if (!c.single_param_group)
    setup.optimizer.no_weight_decay =
        unregularized_params(model, c.regularize_bn, c.regularize_bias);
  sk::parallel::PlannedRun run;
  run.parallel = setup.parallel;
  run.world_size = world;
  run.optimizer = setup.optimizer;
  run.rank = rank;
  setup.memory = sk::parallel::plan_module_memory(model, run);
  return setup;
}

// Whether a rank builds its model without parameter memory (sk::DeferredParameters): under
// fsdp, where the wrap makes each rank's shards only, from rank 0's recorded initialisation --
// a rank never holds the whole model -- with the eager build's values bit for bit.
inline bool builds_deferred(const SwavConfig& c) {
  return c.parallel.stage == sk::parallel::Stage::fsdp;
}

// Each rank's share of the training images (the sampler's) holds a batch.
inline void check_batch_fits(const SwavConfig& c, std::int64_t samples_per_rank) {
  if (samples_per_rank < c.batch_size)
    throw ConfigError("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = " + std::to_string(c.batch_size) +
                      " exceeds the " + std::to_string(samples_per_rank) +
                      " training images per rank; use a smaller batch, fewer ranks or more data");
}

// What the ranks on this machine will hold of the host's memory: the model states of ranks on
// the CPU, summed over the ranks' own plans (under oss and sdp the shards differ in size), each
// CPU rank's step beyond them (measured: step_memory.hpp), and the two kNN figures' floats
// (four bytes a value; trainer.hpp's evaluate), each held on its own: the raw pixels' -- the
// memory bank's once per process, each rank's share of the test images' -- and then the
// network's -- each rank's share of the bank's features and every test image's.
struct HostMemoryNeed {
  std::int64_t states_per_rank_max = 0;  // the most loaded rank's model states
  std::int64_t local_states = 0;         // the local ranks' model states (0 on a GPU)
  // The raw-pixel kNN's floats on this machine (0 untested): the memory bank's once per process
  // (its ranks as threads share it), each rank's share of the test images (the queries are split
  // over the ranks)
  std::int64_t knn_local = 0;
  std::int64_t knn_row = 0;      // of those, an image's floats (bytes)
  std::int64_t knn_copies = 0;   // the bank's copies on this machine (its processes)
  std::int64_t knn_queries = 0;  // the local ranks' shares of the test images (bytes)
  // The network kNN's on this machine at an evaluation (0 untested: network_knn_on_machine);
  // and an image's features over the feature sets (bytes), read at the evaluation's side of a
  // bank image and of a test image
  std::int64_t network_knn_local = 0;
  std::int64_t network_bank_row = 0, network_test_row = 0;
  // A CPU rank's step beyond its states at the config's batch, and the line it is read from
  // (0 and empty where not measured: a GPU run, no measurement given, the images or the states
  // not fitting)
  std::int64_t step_per_rank = 0;
  sk::parallel::ActivationProfile step;
};

// A rank's model states in host memory when it runs on the CPU, at the larger of two peaks:
// while the ranks wrap their models (all at once: the module's own f32 parameters beside the
// flat buffers, unless built deferred as under fsdp) and while they step (parameters,
// gradients and optimizer state, communication buffers and gathered units) -- with what
// offload moves to the "host", which on the CPU is the same memory.
inline std::int64_t cpu_rank_states(const sk::parallel::MemoryPlan& p, const SwavConfig& c) {
  return std::max(p.model_states() + p.communication + p.gathered,
                  p.wrap_peak(builds_deferred(c))) +
         p.host_total();
}

// Under fsdp every state is sharded already, and a rank's share shrinks as the world grows: the
// fix for states that do not fit is a world whose most loaded rank's states (planned at that
// world) fit a machine like this one, spread over as many machines as it takes.
inline std::string larger_world(SwavModel& model, const SwavConfig& c, int world,
                                std::int64_t available) {
  const auto per_rank = [&](int w) { return cpu_rank_states(rank_setup(model, c, w).memory, c); };
  const auto gb = [](double bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f", bytes / 1e9);
    return std::string(text);
  };
  // From the share's estimate up (the shares are near equal), checked by planning the world.
  const std::int64_t now = per_rank(world);
  int w = static_cast<int>(std::min<double>(
      1 << 20, std::max(double(world), std::ceil(double(now) * world / double(available)))));
  std::int64_t held = per_rank(w);
  for (int tries = 0; held > available && tries < 32 && w < (1 << 20); ++tries) {
    w += std::max(1, w / 16);
    held = per_rank(w);
  }
  if (held > available)
    return "the states are sharded already (fsdp), and even at a world of " + std::to_string(w) +
           " ranks a rank would hold " + gb(double(held)) +
           " GB of them: use machines with more memory";
  const std::int64_t per_machine = std::max<std::int64_t>(1, available / held);
  const std::int64_t machines = (w + per_machine - 1) / per_machine;
  return "the states are sharded already (fsdp) and a rank's share shrinks as the world grows: "
         "at a world of " +
         std::to_string(w) + " ranks a rank holds " + gb(double(held)) + " GB of them, so run " +
         std::to_string(w) + " ranks on " + std::to_string(machines) +
         " machines of this memory, " + std::to_string(std::min<std::int64_t>(per_machine, w)) +
         " a machine (DISTRIBUTED.NUM_NODES, NUM_PROC_PER_NODE; under mpirun or torchrun)";
}

// What a rank holds for the network's kNN figure with a memory bank of `bank` images (trainer.hpp's
// features and sharded_knn_accuracy): its share of the bank's features (a padded share while
// it makes them), every test image's (each batch all-gathered into a buffer of the padded
// shares), and the lists of k neighbours that it makes for every query and exchanges -- at the
// exchange of the indices its own lists (a similarity and an index, 12 bytes an entry), the
// similarities received (4) and four copies of the indices (32: the bytes sent, as a vector and
// as a tensor, and received, as a tensor and as a vector): 48 bytes an entry.
inline std::int64_t network_knn_per_rank(const HostMemoryNeed& need, const SwavConfig& c,
                                         const Datasets& data, std::int64_t bank, int world) {
  const std::int64_t queries = data.test.count;
  return query_share(bank, world) * need.network_bank_row +
         world * query_share(queries, world) * need.network_test_row +
         queries * c.knn_topk * std::int64_t{48};
}

// What rank 0 holds beyond that at the last evaluation when it exports the features
// (NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS): the tensors it writes -- the whole bank's features and
// every test image's, over the sets -- and the whole bank of the set it is gathering. (Counted on
// every machine: a machine does not know whether it holds rank 0.)
inline std::int64_t network_knn_export(const HostMemoryNeed& need, const SwavConfig& c,
                                       const Datasets& data, std::int64_t bank) {
  if (c.export_dir.empty()) return 0;
  return 2 * bank * need.network_bank_row + data.test.count * need.network_test_row;
}

// What the ranks on this machine hold for the network's kNN figure with a bank of `bank` images:
// each local rank's, and rank 0's export.
inline std::int64_t network_knn_on_machine(const HostMemoryNeed& need, const SwavConfig& c,
                                           const Datasets& data, std::int64_t bank, int world,
                                           int local_ranks) {
  return network_knn_per_rank(need, c, data, bank, world) * local_ranks +
         network_knn_export(need, c, data, bank);
}

// An image's features over the kNN's feature sets (bytes) in the evaluation's images of `set`:
// DATA.TEST.TRANSFORMS' side (the large crops' by default), each trunk layer's [C, H, W] there
// (nn::Trunk::child_output_shape) pooled as the set says.
inline std::int64_t network_knn_row(SwavModel& model, const SwavConfig& c,
                                    const sk::data::ImageDataset& set) {
  if (set.count == 0) return 0;
  const sk::data::ImageView image = set.image(0);
  const std::int64_t side = c.eval_images.side(image.rows, image.cols, c.crops.size_crops[0]);
  std::int64_t floats = 0;
  for (const FeaturePool& pool : c.knn_features) {
    const auto [channels, h, w] =
        model.trunk->child_output_shape(pool.module(model.trunk->stage_names()), side, side);
    floats += pool.features(channels, h, w);
  }
  return floats * 4;
}

// The ranks of `world` whose states this machine holds: `local_ranks` of them (threads of this
// process when they are the world; processes launched side by side otherwise, their plans
// averaged over the world's ranks). `model`: built without parameter memory.
inline HostMemoryNeed host_memory_need(SwavModel& model, const SwavConfig& c, const Datasets& data,
                                       int world, int local_ranks, bool cpu, bool launched) {
  HostMemoryNeed need;
  if (c.test_model) {
    need.knn_row = raw_pixel_dim(data, c.crops.size_crops[0]) * 4;
    need.knn_copies = launched ? local_ranks : 1;
    need.knn_queries = query_share(data.test.count, world) * local_ranks * need.knn_row;
    need.knn_local = data.bank_size * need.knn_copies * need.knn_row + need.knn_queries;
    need.network_bank_row = network_knn_row(model, c, data.train);
    need.network_test_row = network_knn_row(model, c, data.test);
    need.network_knn_local =
        network_knn_on_machine(need, c, data, data.bank_size, world, local_ranks);
  }
  if (!cpu) return need;
  long double sum = 0;
  for (int r = 0; r < world; ++r) {
    const std::int64_t states = cpu_rank_states(rank_setup(model, c, world, r).memory, c);
    need.states_per_rank_max = std::max(need.states_per_rank_max, states);
    sum += states;
  }
  need.local_states = static_cast<std::int64_t>(sum * local_ranks / world);
  return need;
}

// A rank's step beyond its model states, as a line in the batch (step_memory.hpp measures it).
using StepMeasure = std::function<sk::parallel::ActivationProfile()>;

// Before the ranks start, what would stop them later or take the machine down, reported
// together: a world of more ranks than training images, each rank's share of the images (the
// sampler's) against its batch, and the host memory the ranks on this machine will hold
// (host_memory_need) against what it has (`available`: available_host_memory(), -1: unknown) --
// their model states first, then, on the CPU, with each rank's step at its batch
// (`measure_step`, called only when the states fit; none given: the states alone, a lower
// bound), then with each kNN figure's floats (which a rank holds outside its steps). Each
// refusal says how many ranks (re-planned at that world size: a sharded rank holds more in a
// smaller world), which batch or which memory bank would fit. A VISSL config written for 8
// nodes of 8 GPUs would otherwise start 64 threads here, each building its model, and end out
// of memory with no word. `launched`: the ranks are processes (mpirun, torchrun),
// `local_ranks` of them on this machine.
// Returns what the ranks will hold (empty where `available` is unknown).
inline HostMemoryNeed check_ranks_fit(const SwavConfig& c, const Datasets& data, int world,
                                      int local_ranks, bool cpu, bool launched,
                                      std::int64_t available = available_host_memory(),
                                      const StepMeasure& measure_step = {}) {
  HostMemoryNeed need;
  ConfigProblems problems;
  const bool shape_fits = problems.attempt([&] {
    if (data.train.count < world)
      throw ConfigError("config.DISTRIBUTED: " + std::to_string(world) + " ranks, but " +
                        std::to_string(data.train.count) +
                        " training images; use fewer ranks (NUM_NODES, NUM_PROC_PER_NODE) or more "
                        "data");
    check_batch_fits(c,
                     sk::data::StatefulDistributedSampler(data.train.count, world, 0, c.batch_size)
                         .samples_per_rank());
  });
  if (available >= 0)
    problems.attempt([&] {
      sk::Context ctx;
      const auto model = [&] {
        sk::DeferredParameters deferred(ctx);
        return std::make_shared<SwavModel>(ctx, c);
      }();
      need = host_memory_need(*model, c, data, world, local_ranks, cpu, launched);
      const std::string ranks =
          std::to_string(local_ranks) +
          (launched ? " ranks launched on this machine" : " ranks as threads of this process");
      char figures[512];
      // "run at most k here", k the most ranks whose most loaded one, planned at that world,
      // fits that many times in `room` with `step` bytes of its step beside it.
      const auto fewer_ranks = [&](std::int64_t step, std::int64_t room) {
        if (launched) return std::string("start fewer processes on this machine, ");
        for (int k = local_ranks - 1; k >= 1; --k)
          if ((cpu_rank_states(rank_setup(*model, c, k).memory, c) + step) * k <= room)
            return "run at most " + std::to_string(k) +
                   " here (NUM_NODES=1, NUM_PROC_PER_NODE=" + std::to_string(k) + "), ";
        return std::string();
      };
      if (need.local_states > available) {
        std::snprintf(figures, sizeof figures,
                      " would hold at least %.2f GB of model states -- under %s up to %.1f MB a "
                      "rank as they build their modules or step, before activations -- and this "
                      "machine has %.2f GB available; ",
                      double(need.local_states) / 1e9,
                      std::string(sk::parallel::stage_name(c.parallel.stage)).c_str(),
                      double(need.states_per_rank_max) / 1e6, double(available) / 1e9);
        std::string fix =
            "shard the states (OPTIMIZER.use_zero, MODEL.SHARDED_DDP_SETUP.USE_SDP, "
            "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP), or spread the ranks over several "
            "machines";
        if (c.parallel.stage == sk::parallel::Stage::fsdp && available > 0)
          fix = larger_world(*model, c, world, available);
        throw ConfigError("config.DISTRIBUTED: " + ranks + figures + fewer_ranks(0, available) +
                          fix);
      }
      // Each rank's step on top of its states (measured only once the images and the states
      // fit: the measurement builds the model and steps it). This is an estimate, not a bound:
      // the ranks may take nine tenths of what is available, the rest is left to the process's
      // own memory and the system.
      if (cpu && measure_step && shape_fits) {
        need.step = measure_step();
        need.step_per_rank = need.step.at(c.batch_size);
        const sk::parallel::ActivationProfile& step = need.step;
        const std::int64_t per_rank = need.step_per_rank;
        const std::int64_t room = available - available / 10;
        if (need.local_states + per_rank * local_ranks > room) {
          std::int64_t batch_fits = c.batch_size - 1;
          while (batch_fits >= 1 && need.local_states + step.at(batch_fits) * local_ranks > room)
            --batch_fits;
          std::snprintf(figures, sizeof figures,
                        " would hold about %.2f GB in their steps -- %.2f GB of model states "
                        "and, a rank, %.1f MB of activations and scratch at %lld images "
                        "(measured here on a step of a few: %.1f MB + %.1f MB an image) -- and "
                        "this machine has %.2f GB available, %.2f GB for the ranks; ",
                        double(need.local_states + per_rank * local_ranks) / 1e9,
                        double(need.local_states) / 1e9, double(per_rank) / 1e6,
                        static_cast<long long>(c.batch_size), step.fixed_bytes / 1e6,
                        step.bytes_per_sample / 1e6, double(available) / 1e9, double(room) / 1e9);
          throw ConfigError(
              "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = " + std::to_string(c.batch_size) + ": " +
              ranks + figures +
              (batch_fits >= 1 ? "use a batch of at most " + std::to_string(batch_fits) + ", "
                               : std::string()) +
              fewer_ranks(per_rank, room) +
              (c.checkpoint_splits == 0
                   ? "checkpoint the activations "
                     "(MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING), "
                   : std::string()) +
              "or spread the ranks over several machines");
        }
      }
      if (need.local_states + need.knn_local > available) {
        const std::int64_t bank_fits =
            (available - need.local_states - need.knn_queries) / need.knn_copies / need.knn_row;
        std::snprintf(figures, sizeof figures,
                      " would hold, for the raw-pixel kNN, the memory bank's %lld images (%s) and "
                      "their shares of the %lld test images, as %lld floats an image: %.2f GB "
                      "with the model states, and this machine has %.2f GB available; ",
                      static_cast<long long>(data.bank_size),
                      launched ? "a copy a process" : "one copy, shared",
                      static_cast<long long>(data.test.count),
                      static_cast<long long>(need.knn_row / 4),
                      double(need.local_states + need.knn_local) / 1e9, double(available) / 1e9);
        throw ConfigError(
            "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT = " + std::to_string(c.memory_bank_limit) +
            ": " + ranks + figures +
            (bank_fits >= 1 ? "set MEMORY_BANK_LIMIT to at most " + std::to_string(bank_fits)
                            : std::string("set DATA.TEST.DATA_LIMIT and "
                                          "MEMORY_BANK_LIMIT lower")) +
            ", or TEST_MODEL to False");
      }
      if (need.local_states + need.network_knn_local > available) {
        // The largest bank whose features fit beside the states (none where the test images'
        // alone do not).
        std::int64_t bank_fits = data.bank_size - 1;
        while (bank_fits >= 1 &&
               need.local_states +
                       network_knn_on_machine(need, c, data, bank_fits, world, local_ranks) >
                   available)
          --bank_fits;
        std::snprintf(
            figures, sizeof figures,
            " would hold, for the network's kNN, each its share of the memory bank's "
            "%lld images and all the %lld test images, as %lld and %lld floats an "
            "image (the feature sets of MODEL.FEATURE_EVAL_SETTINGS."
            "LINEAR_EVAL_FEAT_POOL_OPS_MAP), with their lists of %d neighbours: %.2f GB "
            "with the model states, and this machine has %.2f GB available; ",
            static_cast<long long>(data.bank_size), static_cast<long long>(data.test.count),
            static_cast<long long>(need.network_bank_row / 4),
            static_cast<long long>(need.network_test_row / 4), c.knn_topk,
            double(need.local_states + need.network_knn_local) / 1e9, double(available) / 1e9);
        throw ConfigError(
            "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT = " + std::to_string(c.memory_bank_limit) +
            ": " + ranks + figures +
            (bank_fits >= 1 ? "set MEMORY_BANK_LIMIT to at most " + std::to_string(bank_fits) +
                                  ", pool the features smaller"
                            : std::string("pool the features smaller, set DATA.TEST.DATA_LIMIT "
                                          "and MEMORY_BANK_LIMIT lower")) +
            ", run fewer ranks here, or set TEST_MODEL to False");
      }
    });
  problems.check();
  return need;
}

}  // namespace swav
