// What building and wrapping a model under FSDP costs each rank, eager against deferred
// (core/deferred_init.hpp: the model built under DeferredParameters, each rank making only its
// shards from rank 0's recipes at the wrap). ResNet-50 (torchvision's initialisation, 25.6 M
// parameters, f32) under fsdp with one unit per bottleneck block (16 units; the stem, the fc and
// the batch-norm statistics in the root unit), SGD with momentum, N ranks as threads of this
// process (local communicator). Per rank: the peak of its memory from the start of the build to the
// end of the wrap, what it holds after the wrap, what it sent during the wrap (bus bytes, the
// communicator's counters), and the wall time of build + wrap; medians of R rounds.
//
// The floor of the peak is what the wrapped model keeps (its shards: 4 Psi / N plus padding,
// the root's buffers). An eager build first holds the whole model (4 Psi) on every rank, then
// fills each unit whole (the largest unit's 4 bytes per element, shown beside the figures) and
// broadcasts it; a deferred one makes each rank's shards in place and sends rank 0's recipes
// (64 bytes a parameter) instead of the values.
//
// Usage: deferred_wrap [world size, default 8] [rounds, default 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/deferred_init.hpp"
#include "shardkit/nn/resnet.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "timing.hpp"

namespace sk = shardkit;

namespace {

using shardkit::bench::median;

struct Wrap {
  double peak = 0;     // rank 0: bytes, build + wrap
  double steady = 0;   // rank 0: bytes held after the wrap
  double seconds = 0;  // the slowest rank's build + wrap
  double sent = 0;     // rank 0: bus bytes the wrap sent
  double largest_unit = 0, params = 0;
};

Wrap measure(int world, bool deferred) {
  Wrap out;
  std::vector<double> seconds(static_cast<std::size_t>(world));
  sk::comm::RunRanksOptions ranks;
  ranks.seed = 50;
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        comm.barrier();
        ctx.memory_stats().reset_peak();
        const auto start = std::chrono::steady_clock::now();
        sk::nn::ResNetOptions o;
        o.init = sk::nn::ResNetInit::torchvision;
        std::shared_ptr<sk::nn::ResNet> net;
        {
          std::optional<sk::DeferredParameters> scope;
          if (deferred) scope.emplace(ctx);
          net = sk::nn::resnet50(ctx, o);
        }
        const double params = static_cast<double>(net->parameter_count());
        sk::parallel::ParallelOptions options;
        options.stage = sk::parallel::Stage::fsdp;
        const int blocks[] = {3, 4, 6, 3};
        for (int layer = 1; layer <= 4; ++layer)
          for (int b = 0; b < blocks[layer - 1]; ++b)
            options.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." +
                                                   std::to_string(b));
        sk::optim::OptimizerConfig sgd;
        sgd.sgd.momentum = 0.9f;
        comm.reset_stats();
        sk::parallel::ShardedModule model(ctx, comm, net, sgd, options);
        seconds[static_cast<std::size_t>(comm.rank())] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (comm.rank() != 0) return;
        const auto m = ctx.memory_stats().snapshot();
        out.peak = static_cast<double>(m.peak_total);
        out.steady = static_cast<double>(m.current_total);
        out.sent = static_cast<double>(comm.stats().total_bus_bytes());
        out.params = params;
        for (std::size_t u = 0; u < model.engine().unit_count(); ++u)
          out.largest_unit = std::max(
              out.largest_unit,
              4.0 * static_cast<double>(model.engine().group(u).flat().params().flat().numel()));
      },
      ranks);
  out.seconds = *std::max_element(seconds.begin(), seconds.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::max(1, std::atoi(argv[1])) : 8;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  std::printf("ResNet-50 under fsdp, 16 block units, N = %d local ranks, %d rounds (medians)\n",
              world, rounds);
  std::printf(
      "| build | peak per rank (MB) | held after the wrap (MB) | peak - held (MB) | "
      "sent by the wrap (MB) | build + wrap (s) |\n|---|---|---|---|---|---|\n");
  Wrap last;
  for (const bool deferred : {false, true}) {
    std::vector<double> peak, steady, sent, seconds;
    for (int r = 0; r < rounds; ++r) {
      // (alternating would not change a memory figure; the times come from the same rounds)
      last = measure(world, deferred);
      peak.push_back(last.peak);
      steady.push_back(last.steady);
      sent.push_back(last.sent);
      seconds.push_back(last.seconds);
    }
    std::printf("| %s | %.1f | %.1f | %.1f | %.3f | %.2f |\n", deferred ? "deferred" : "eager",
                median(peak) / 1e6, median(steady) / 1e6, (median(peak) - median(steady)) / 1e6,
                median(sent) / 1e6, median(seconds));
  }
  std::printf(
      "whole model 4 Psi: %.1f MB; largest unit, whole: %.1f MB (what the eager wrap fills "
      "at once)\n",
      4.0 * last.params / 1e6, last.largest_unit / 1e6);
  return 0;
}
