// The SwAV trainer, configured like VISSL:
//
//   swav config=samples/swav/configs/quick_cpu.yaml [config.KEY.PATH=VALUE ...]
//
// Self-supervised SwAV on Fashion-MNIST (a ResNet or RegNet trunk on shardkit's autograd layer,
// every ZeRO stage through ShardedModule, LARC-SGD, mixed precision, activation checkpointing,
// SyncBatchNorm, the stateful sampler, step-folder checkpoints with AUTO_RESUME), evaluated by
// weighted kNN beside the raw-pixel kNN. Ranks are threads of this process
// (DISTRIBUTED.NUM_PROC_PER_NODE); under mpirun or with torchrun's variables each process is one
// rank. The GPU is used when the build has CUDA and the machine has one (MACHINE.DEVICE auto),
// or when asked (gpu). docs/swav.md has the details.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "command_line.hpp"
#include "launched_checks.hpp"
#include "ranks.hpp"
#include "shardkit/comm/recorder_dump.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "step_memory.hpp"

namespace sk = shardkit;

namespace {

// VISSL's command line (command_line.hpp): the config files merge in order (a later one
// overrides an earlier one), then the config.KEY=VALUE overrides.
void merge_arguments(int argc, char** argv, swav::ConfigTree& tree) {
  const auto line = swav::read_command_line(std::vector<std::string>(argv + 1, argv + argc),
                                            swav::config_roots(SWAV_SOURCE_DIR "/configs"));
  for (const auto& problem : line.problems) tree.add_problem(problem);
  for (const auto& file : line.files) tree.merge_file(file);
  for (const auto& o : line.overrides) tree.apply_override(o);
  for (const auto& setting : line.hydra) tree.ignore(setting);
}

// The run's kNN figures as a small table: a row per evaluation (the initial network, the
// epochs, the end), a column per feature set (the first is the headline), raw pixels last.
void print_knn_table(const swav::RunReport& report) {
  if (report.knn_table.empty()) return;
  std::size_t width = 8, label = 16;
  for (const auto& name : report.knn_features) width = std::max(width, name.size());
  for (const auto& row : report.knn_table) label = std::max(label, row.when.size());
  const int l = static_cast<int>(label);
  const int w = static_cast<int>(width);
  std::printf("\nkNN top-1 on the test images\n  %-*s", l, "");
  for (const auto& name : report.knn_features) std::printf("  %*s", w, name.c_str());
  for (const auto& row : report.knn_table) {
    std::printf("\n  %-*s", l, row.when.c_str());
    for (double a : row.accuracy) std::printf("  %*.2f%%", w - 1, 100 * a);
  }
  std::printf("\n  %-*s  %*.2f%%\n", l, "raw pixels", w - 1, 100 * report.raw_knn);
}

// The run's curves (plot_metrics.py beside the trainer's sources) as a PNG next to its metrics
// file, when Python has matplotlib; the PNG's path is printed.
void plot_metrics(const swav::SwavConfig& config) {
  const std::string script = SWAV_SOURCE_DIR "/plot_metrics.py";
  const std::string& metrics = config.metrics_path;
  if (!std::filesystem::exists(script) || !std::filesystem::exists(metrics)) return;
  if (metrics.find('\'') != std::string::npos) return;  // (not quotable below)
  const std::string png = std::filesystem::path(metrics).replace_extension(".png").string();
  const std::string command =
      "python3 '" + script + "' '" + png + "' '" + metrics + "' >/dev/null 2>&1";
  if (std::system(command.c_str()) == 0)
    std::printf("plot: %s\n", png.c_str());
  else
    std::printf(
        "plot: not drawn (plot_metrics.py needs python3 with matplotlib: apt-get install "
        "python3-matplotlib)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (std::any_of(argv + 1, argv + argc, [](const char* a) {
        return std::string(a) == "--help" || std::string(a) == "-h";
      })) {
    std::printf(
        "usage: swav config=FILE [+config/GROUP=NAME ...] [config.KEY.PATH=VALUE ...]\n"
        "  e.g. swav config=samples/swav/configs/quick_cpu.yaml config.OPTIMIZER.num_epochs=2\n"
        "  or, from a VISSL checkout, swav config=pretrain/swav/swav_8node_resnet\n"
        "  +config/pretrain/swav/models=resnet18 config.DATA.TRAIN.DATA_PATHS=[/data/train]\n"
        "  VISSL's keys and overrides: samples/swav/swav_defaults.hpp holds every key with its\n"
        "  default, docs/swav.md the semantics.\n");
    return 0;
  }
  try {
    // `kill -USR1 <pid>` prints what each rank's communicator did last (a hung job says where).
    sk::comm::install_recorder_dump(SIGUSR1);
    const auto launch = sk::comm::detect_launch();
    const bool launched = launch.kind != sk::comm::LaunchKind::single;
    swav::ConfigTree tree(swav::kDefaultsYaml);
    merge_arguments(argc, argv, tree);
    // The world size first: the config's inference (queue rounding, learning-rate scaling,
    // SyncBatchNorm groups) depends on it.
    // (a refused rank count counts as 1 here: read_swav_config reports it with the rest)
    int world = 1;
    if (launched)
      world = launch.size;
    else
      try {
        world = swav::configured_ranks(tree);
      } catch (const swav::ConfigError&) {
      }
    // The config is read against this machine and its data, so that one run names every
    // problem: MACHINE.DEVICE: gpu needs a CUDA build and a GPU (auto takes the GPU when both
    // are there), the data's files and folders must be found.
    const bool cuda_build = SK_WITH_CUDA;
    const swav::Machine machine{.cuda_build = cuda_build,
                                .gpu = cuda_build && sk::cuda_available(),
                                .probe_data = swav::probe_split};
    auto config = swav::read_swav_config(tree, world, &machine);
    const bool gpu = config.device != "cpu" && machine.gpu;
    const bool lead = !launched || launch.rank == 0;
    if (lead)
      std::printf(
          "SwAV: %s%s, %d x crops, %d ranks (%s, "
          "%s, CPU threads per rank: %d, SHARDKIT_NUM_THREADS or the cores split between local "
          "ranks), "
          "stage %s, %s%s, %d epochs\n",
          trunk_name(config).c_str(),
          config.trunk != "resnet"
              ? ""
              : (" (" + std::to_string(config.base_channels) + " base channels)").c_str(),
          config.crops.total_crops(), world, launched ? "processes" : "threads",
          gpu ? "GPU" : "CPU",
          launched ? sk::default_cpu_threads() : sk::comm::cpu_threads_per_rank(world),
          std::string(sk::parallel::stage_name(config.parallel.stage)).c_str(),
          std::string(sk::dtype_name(config.parallel.precision.param_dtype)).c_str(),
          config.sync_bn_group > 0
              ? (", SyncBatchNorm over " + std::to_string(config.sync_bn_group) + " ranks").c_str()
              : "",
          config.num_epochs);
    if (lead && !tree.ignored().empty()) {
      std::string keys;
      for (const auto& key : tree.ignored()) keys += (keys.empty() ? "" : ", ") + key;
      std::printf("config: VISSL keys without effect in this trainer, ignored: %s\n", keys.c_str());
    }
    const auto load_start = std::chrono::steady_clock::now();
    // Processes launched side by side on this machine each read the data and hold their ranks.
    const int local_processes = launched ? sk::launcher_local_processes() : 1;
    const auto data = swav::load_datasets(config, local_processes);  // sets the input channels
    if (lead)
      std::printf(
          "data: %s; read in %.1f s\n", data.description.c_str(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
    // A CPU rank's step is measured on this machine (one rank's first step at a few batches)
    // before the ranks start, once their states and shapes fit. (GPU ranks' steps are in device
    // memory: not measured.)
    const int local_ranks = launched ? local_processes : world;
    const std::int64_t available = swav::available_host_memory();
    const auto check = [&](const swav::StepMeasure& measure) {
      return swav::check_ranks_fit(config, data, world, local_ranks, !gpu, launched, available,
                                   measure);
    };
    std::unique_ptr<sk::Context> process_ctx;
    std::unique_ptr<sk::comm::Communicator> process_comm;
    swav::HostMemoryNeed need;
    if (!launched) {
      need = check([&] {
        return swav::measure_step_memory(config, data, sk::comm::cpu_threads_per_rank(world));
      });
    } else if (!gpu) {
      // CPU processes launched side by side (mpirun): each checks the states, shapes and kNN on
      // its machine, and rank 0, where they fit (and its memory is known), measures the step on
      // a process's threads -- measured by every process at once, the steps would compete for
      // the cores and the memory they are measured in -- before the processes meet: the others
      // wait for it in MPI's start, which the communicator's timeout does not bound, not in a
      // collective. Then the processes agree on each outcome (launched_checks.hpp), and each
      // checks its machine with rank 0's figures; a refusal or failure of one stops all.
      std::exception_ptr first_check, measuring;
      std::vector<double> step(3, 0.0);
      try {
        check({});
      } catch (...) {
        first_check = std::current_exception();
      }
      if (launch.rank == 0 && !first_check && available >= 0) {
        try {
          const auto p = swav::measure_step_memory(config, data, sk::default_cpu_threads());
          step = {p.fixed_bytes, p.bytes_per_sample, p.floor_bytes};
        } catch (...) {
          measuring = std::current_exception();
        }
      }
      process_ctx = std::make_unique<sk::Context>(sk::ContextOptions{.seed = config.seed});
      process_comm = sk::comm::make_communicator(*process_ctx);
      swav::agreed(*process_ctx, *process_comm, [&] {
        if (first_check) std::rethrow_exception(first_check);
        return 0;
      });
      step = swav::from_rank0(*process_ctx, *process_comm, step, measuring);
      const sk::parallel::ActivationProfile line{step[0], step[1], step[2]};
      // (all zeros where rank 0 did not measure: then no step is counted, as with no measure)
      need =
          swav::agreed(*process_ctx, *process_comm, [&] { return check([line] { return line; }); });
    } else {
      // (launched GPU processes: each refuses alone, and the launcher ends the job)
      need = check({});
    }
    if (lead && need.step_per_rank > 0) {
      // (the kNN's figures are held outside the steps, beside the states: the larger of the two)
      char knn[160] = "";
      const std::int64_t knn_bytes = std::max(need.knn_local, need.network_knn_local);
      if (knn_bytes > 0)
        std::snprintf(knn, sizeof knn, "; at a kNN evaluation about %.2f GB with the states",
                      double(need.local_states + knn_bytes) / 1e9);
      std::printf(
          "host memory: about %.1f MB a rank as it steps -- model states %.1f MB (the most loaded "
          "rank), activations and scratch %.1f MB at %lld images (measured here: %.1f MB + %.1f "
          "MB an image) -- %d ranks on this machine, about %.2f of %.2f GB available%s\n",
          double(need.states_per_rank_max + need.step_per_rank) / 1e6,
          double(need.states_per_rank_max) / 1e6, double(need.step_per_rank) / 1e6,
          static_cast<long long>(config.batch_size), need.step.fixed_bytes / 1e6,
          need.step.bytes_per_sample / 1e6, local_ranks,
          double(need.local_states + need.step_per_rank * local_ranks) / 1e9,
          double(available) / 1e9, knn);
    }
    swav::RunReport report;
#if SK_WITH_CUDA
    if (gpu) report = swav::train_ranks_gpu(config, data, launch, world);
#endif
    if (process_comm) {
      report = swav::train_rank(config, data, *process_ctx, *process_comm);
      // (MPI finalised now, as the ranks end, not after rank 0's report and plot)
      process_comm.reset();
      process_ctx.reset();
    } else if (!gpu)
      report = swav::train_ranks(config, data, launch, world, {},
                                 sk::ContextOptions{.seed = config.seed});
    if (!lead) return 0;
    char knn[128] = "no kNN evaluation (TEST_MODEL: False)";
    if (config.test_model)
      std::snprintf(knn, sizeof knn, "kNN top-1 %.2f%% (initial network %s, raw pixels %.2f%%)",
                    100 * report.knn,
                    report.knn_init < 0
                        ? "n/a (resumed)"
                        : (std::to_string(100 * report.knn_init).substr(0, 5) + "%").c_str(),
                    100 * report.raw_knn);
    // (after a resume, the iterations this process ran: the seconds are theirs)
    char resumed_from[64] = "";
    if (report.resumed)
      std::snprintf(resumed_from, sizeof resumed_from, " (%lld to %lld, resumed)",
                    static_cast<long long>(report.start_iteration),
                    static_cast<long long>(report.iterations));
    std::printf(
        "done: %lld iterations%s in %.1f s, %.1f of them evaluating and checkpointing (%.1f img/s "
        "while stepping, data wait %.1f%%); %s; fingerprint %016llx\n",
        static_cast<long long>(report.iterations - report.start_iteration), resumed_from,
        report.train_seconds, report.paused_seconds, report.images_per_second,
        100 * report.data_wait_seconds / std::max(report.train_seconds, 1e-9), knn,
        static_cast<unsigned long long>(report.fingerprint));
    print_knn_table(report);
    if (config.plot_metrics) plot_metrics(config);
    return 0;
  } catch (const swav::StoppedElsewhere& e) {  // (said by the stopping rank; named by rank 0)
    if (sk::comm::detect_launch().rank == 0) std::fprintf(stderr, "swav: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "swav: %s\n", e.what());
    return 1;
  }
}
