// The SwAV trainer, configured like VISSL:
//
//   swav config=samples/swav/configs/quick_cpu.yaml [config.KEY.PATH=VALUE ...]
//
// Self-supervised SwAV on Fashion-MNIST (a ResNet trunk on shardkit's autograd layer, every
// ZeRO stage through ShardedModule, LARC-SGD, mixed precision, activation checkpointing, the
// stateful sampler, step-folder checkpoints with AUTO_RESUME), evaluated by weighted kNN beside
// the raw-pixel kNN. Ranks are threads of this process (DISTRIBUTED.NUM_PROC_PER_NODE); under
// mpirun or with torchrun's variables each process is one rank. docs/swav.md has the details.
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "shardkit/comm/comm.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "trainer.hpp"

namespace sk = shardkit;

namespace {

swav::SwavConfig configure(int argc, char** argv, swav::ConfigTree& tree, int world) {
  // config=FILE arguments merge in order (a later file overrides an earlier one), then the
  // config.KEY=VALUE overrides.
  std::vector<std::string> files, overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("config=", 0) == 0)
      files.push_back(arg.substr(7));
    else
      overrides.push_back(arg);
  }
  for (const auto& file : files) tree.merge_file(file);
  for (const auto& o : overrides) tree.apply_override(o);
  return swav::read_swav_config(tree, world);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf(
        "usage: swav config=FILE [config=FILE ...] [config.KEY.PATH=VALUE ...]\n"
        "  e.g. swav config=samples/swav/configs/quick_cpu.yaml config.OPTIMIZER.num_epochs=2\n"
        "  VISSL's keys and overrides; docs/swav.md lists them and the defaults.\n");
    return 0;
  }
  try {
    const auto launch = sk::comm::detect_launch();
    const bool launched = launch.kind != sk::comm::LaunchKind::single;
    // The world size first (the config's inference depends on it), then the full config.
    swav::ConfigTree probe(swav::kDefaultsYaml);
    const auto first = configure(argc, argv, probe, 1);
    const int world = launched ? launch.size : first.ranks;
    swav::ConfigTree tree(swav::kDefaultsYaml);
    const auto config = configure(argc, argv, tree, world);
    if (config.device == "gpu")
      sk::fail<sk::NotAvailable>(
          "config.MACHINE.DEVICE = gpu: this build of the SwAV trainer runs on the CPU only so far "
          "(its GPU path is not built yet); use cpu or auto");
    const bool lead = !launched || launch.rank == 0;
    if (lead)
      std::printf(
          "SwAV on Fashion-MNIST: ResNet-%d (%lld base channels), %d x %s, %d ranks (%s), "
          "stage %s, %s, %d epochs\n",
          config.depth, static_cast<long long>(config.base_channels), config.crops.total_crops(),
          "crops", world, launched ? "processes" : "threads",
          std::string(sk::parallel::stage_name(config.stage)).c_str(),
          std::string(sk::dtype_name(config.precision.param_dtype)).c_str(), config.num_epochs);
    const auto data = swav::load_datasets(config);
    swav::RunReport report;
    std::mutex lock;
    auto body = [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      swav::SwavTrainer<sk::ops::Cpu> trainer(config, ctx, comm, data, stdout);
      auto r = trainer.run();
      std::lock_guard guard(lock);
      if (comm.rank() == 0) report = std::move(r);
    };
    if (launched) {
      sk::Context ctx({.seed = config.seed});
      auto comm = sk::comm::make_communicator(ctx);
      body(ctx, *comm);
    } else {
      sk::comm::run_ranks(world, body);
    }
    if (!lead) return 0;
    std::printf(
        "done: %lld iterations in %.1f s (%.1f img/s, data wait %.1f%%); kNN top-1 %.2f%% "
        "(initial network %s, raw pixels %.2f%%); fingerprint %016llx\n",
        static_cast<long long>(report.iterations), report.train_seconds, report.images_per_second,
        100 * report.data_wait_seconds / std::max(report.train_seconds, 1e-9), 100 * report.knn,
        report.knn_init < 0 ? "n/a (resumed)"
                            : (std::to_string(100 * report.knn_init).substr(0, 5) + "%").c_str(),
        100 * report.raw_knn, static_cast<unsigned long long>(report.fingerprint));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "swav: %s\n", e.what());
    return 1;
  }
}
