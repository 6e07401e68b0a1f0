// The FSDP / DDP step-time ratio on ResNet-18 (torchvision layout, small-image stem, 32x32
// images): the same training step -- forward, backward, reduction, optimizer -- under DDP and
// under FSDP with one unit per BasicBlock, prefetch depth 0, 1 and 2, without resharding, and
// with DeepSpeed ZeRO++'s compression (qwZ: int8 parameter gathers; qgZ: int8 gradient
// all-to-alls; hpZ: the backward's gathers inside nodes of half the ranks). In one process the
// wire is memory, so the compressed rows show what compression costs in compute; what it saves
// on a network is in bytes (hybrid_traffic). Given a directory (`nvme`), two more rows: FSDP with
// its parameter shards, master and optimizer state offloaded to host memory (offload.params),
// and the same in files there (offload to NVMe: each gather reads its unit's shard from disk but
// for what the step kept in RAM, and each step streams the state) -- on the CPU what the disk
// adds over host memory, the shards' reads between compute included; under the nvme row, rank
// 0's gathers per timed step: the shards' bytes read ahead (beside compute), read by the gather
// itself, and the time the gathers held the host for the disk.
// N ranks are threads of this process (local communicator; on a GPU they share it). Each
// configuration: 2 warm-up steps, then `steps` timed ones; the median step is reported, with
// the ratio to DDP's median in the same run. With `graph` each rank's step runs through a
// StepGraph (core/step_graph.hpp): its 2 eager warm-up steps and the capture are untimed, the
// timed steps are replays -- on a GPU one graph launch per rank and step, the ranks meeting on
// the device (comm/device_rendezvous.hpp); on the CPU the step's code again under the capture's
// rules. A configuration whose step cannot be captured shows the refusal in its row. Written
// once for both backends: fsdp_step.cpp (CPU) and fsdp_step_gpu.cpp (CUDA) are its two mains.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace shardkit::bench::fsdp_step {

struct Config {
  std::string name;
  parallel::Stage stage = parallel::Stage::ddp;
  int prefetch = 1;
  bool reshard = true;
  bool quantized_weights = false, quantized_grads = false;
  bool node_halves = false;  // hpZ over nodes of world / 2 ranks
  enum class Offload { none, host, disk } offload = Offload::none;  // offload.params (and nvme)
};

struct Workload {
  int world = 2;
  std::int64_t batch = 8;  // per rank
  std::int64_t side = 32;
  int steps = 5;
  bool graph = false;     // each step through a StepGraph (captured once, then replayed)
  std::string nvme_path;  // the offload rows' files ("": no offload rows)
  std::string only;       // run the configurations whose name contains this (and ddp)
};

// [ranks] [images per rank] [timed steps], then any of graph, nvme=DIR, only=TEXT (the two
// mains' usage); false, with a message, on an argument it does not know.
inline bool parse_args(int argc, char** argv, Workload& w) {
  if (argc > 1) w.world = std::atoi(argv[1]);
  if (argc > 2) w.batch = std::atoll(argv[2]);
  if (argc > 3) w.steps = std::atoi(argv[3]);
  for (int i = 4; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "graph")
      w.graph = true;
    else if (arg.rfind("nvme=", 0) == 0)
      w.nvme_path = arg.substr(5);
    else if (arg.rfind("only=", 0) == 0)
      w.only = arg.substr(5);
    else {
      std::fprintf(stderr, "%s: unknown argument '%s'; give graph, nvme=DIR or only=TEXT\n",
                   argv[0], arg.c_str());
      return false;
    }
  }
  if (w.world < 1 || w.batch < 1 || w.steps < 1) {  // (atoi: 0 for what is not a number)
    std::fprintf(stderr,
                 "%s: ranks, images per rank and timed steps must be whole numbers >= 1; got "
                 "%d, %lld, %d\n",
                 argv[0], w.world, static_cast<long long>(w.batch), w.steps);
    return false;
  }
  return true;
}

inline std::vector<Config> configs() {
  using parallel::Stage;
  return {{"ddp", Stage::ddp},
          {"fsdp prefetch 0", Stage::fsdp, 0},
          {"fsdp prefetch 1", Stage::fsdp, 1},
          {"fsdp prefetch 2", Stage::fsdp, 2},
          {"fsdp no reshard", Stage::fsdp, 1, false},
          {"fsdp + qwZ", Stage::fsdp, 1, true, true},
          {"fsdp + qgZ", Stage::fsdp, 1, true, false, true},
          {"fsdp + qwZ+qgZ", Stage::fsdp, 1, true, true, true},
          {"fsdp + hpZ", Stage::fsdp, 1, true, false, false, true},
          {"fsdp offload host", Stage::fsdp, 1, true, false, false, false, Config::Offload::host},
          {"fsdp offload nvme", Stage::fsdp, 1, true, false, false, false, Config::Offload::disk}};
}

struct Timing {
  double step = 0;                        // the median step, seconds
  parallel::FlatParam::ShardReads reads;  // rank 0's shards on disk, over the timed steps
};

// Median step time in seconds over `w.steps` steps (rank 0's clock; every rank steps alike).
// `synchronize(ctx)` waits for the device before the clock is read.
template <class Synchronize>
Timing median_step(const Config& config, const Workload& w, comm::RunRanksOptions options,
                   Synchronize&& synchronize) {
  std::vector<double> times;
  Timing timing;
  comm::run_ranks(
      w.world,
      [&](Context& ctx, comm::Communicator& comm) {
        nn::ResNetOptions o;
        o.num_classes = 10;
        o.small_image_stem = true;
        auto net = nn::resnet18(ctx, o);
        optim::OptimizerConfig optimizer;
        optimizer.kind = optim::OptimizerKind::sgd;
        optimizer.sgd.momentum = 0.9f;
        parallel::ParallelOptions s;
        s.stage = config.stage;
        s.fsdp.prefetch = config.prefetch;
        s.fsdp.reshard_after_forward = config.reshard;
        s.fsdp.quantized_weights = config.quantized_weights;
        s.fsdp.quantized_grads = config.quantized_grads;
        s.fsdp.reshard_group_size = config.node_halves ? w.world / 2 : 0;
        s.offload.params = config.offload != Config::Offload::none;
        if (config.offload == Config::Offload::disk) s.offload.nvme_path = w.nvme_path;
        for (int layer = 1; layer <= 4; ++layer)
          for (int b = 0; b < 2; ++b)
            s.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." +
                                             std::to_string(b));
        parallel::ShardedModule model(ctx, comm, net, optimizer, s);
        auto x = empty(ctx, {w.batch, 3, w.side, w.side}, DType::f32, MemoryCategory::activations);
        normal_(ctx, x, 0.0, 1.0);
        std::vector<std::int64_t> classes;
        for (std::int64_t i = 0; i < w.batch; ++i) classes.push_back((i * 7 + comm.rank()) % 10);
        const auto labels = from_vector(ctx, classes, {w.batch});
        model.set_lr(0.01f);  // outside the step: one capture serves every rate
        auto train_step = [&] {
          model.zero_grad();
          auto loss = autograd::cross_entropy(ctx, model(ctx, autograd::Variable(x)), labels);
          autograd::backward(ctx, loss);
          model.step();
        };
        std::optional<StepGraph> graph;
        if (w.graph) graph.emplace(ctx, "fsdp_step " + config.name);
        const int untimed = w.graph ? 3 : 2;  // a graph's warm-up steps and its capture
        for (int step = 0; step < w.steps + untimed; ++step) {
          if (step == untimed && comm.rank() == 0) timing.reads = model.engine().shard_reads();
          comm.barrier();
          synchronize(ctx);
          const auto start = std::chrono::steady_clock::now();
          if (graph)
            graph->run("batch", train_step);
          else
            train_step();
          synchronize(ctx);
          const double seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (comm.rank() == 0 && step >= untimed) times.push_back(seconds);
        }
        if (comm.rank() != 0) return;
        const auto reads = model.engine().shard_reads();
        timing.reads = {reads.ahead - timing.reads.ahead, reads.at_gather - timing.reads.at_gather,
                        reads.wait_seconds - timing.reads.wait_seconds};
      },
      options);
  std::sort(times.begin(), times.end());
  timing.step = times[times.size() / 2];
  return timing;
}

template <class Synchronize>
void run_all(const char* device, const Workload& w, comm::RunRanksOptions options,
             Synchronize&& synchronize) {
  std::printf(
      "ResNet-18 (small-image stem), %lld images of %lldx%lld per rank, %d ranks as threads on "
      "the %s; SGD with momentum; FSDP units: the 8 BasicBlocks + the root. Median of %d "
      "steps%s.\n\n",
      static_cast<long long>(w.batch), static_cast<long long>(w.side),
      static_cast<long long>(w.side), w.world, device, w.steps,
      w.graph ? ", each a replay of the step captured once (StepGraph)" : "");
  std::printf("%-17s %12s %12s\n", "configuration", "step ms", "/ ddp");
  double ddp = 0;
  for (const auto& config : configs()) {
    // (a node of half the ranks: 2 or more, dividing the world)
    if (config.node_halves && (w.world < 4 || w.world % 2 != 0)) continue;
    if (config.offload != Config::Offload::none && w.nvme_path.empty()) continue;
    if (config.stage != parallel::Stage::ddp && config.name.find(w.only) == std::string::npos)
      continue;
    Timing timing;
    try {
      timing = median_step(config, w, options, synchronize);
    } catch (const CaptureRefused& e) {
      std::printf("%-17s refused: %s\n", config.name.c_str(), e.what());
      continue;
    }
    const double t = timing.step;
    if (config.stage == parallel::Stage::ddp) ddp = t;
    if (ddp > 0)
      std::printf("%-17s %12.2f %12.3f\n", config.name.c_str(), 1e3 * t, t / ddp);
    else  // (DDP's own step was refused: no ratio rather than an infinite one)
      std::printf("%-17s %12.2f %12s\n", config.name.c_str(), 1e3 * t, "no ddp");
    if (config.offload == Config::Offload::disk) {
      const double per_step = 1.0 / w.steps;
      std::printf(
          "  rank 0's gathers, per step: %.2f MB of shards read ahead, %.2f MB read by the "
          "gather, %.2f ms holding the host for the disk\n",
          1e-6 * per_step * static_cast<double>(timing.reads.ahead),
          1e-6 * per_step * static_cast<double>(timing.reads.at_gather),
          1e3 * per_step * timing.reads.wait_seconds);
    }
    std::fflush(stdout);
  }
}

}  // namespace shardkit::bench::fsdp_step
