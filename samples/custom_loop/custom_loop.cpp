// A custom training loop, sharded with shardkit. Read it top to bottom, then train.hpp:
//
//   1. Fashion-MNIST from Debian's dataset-fashion-mnist, split over ranks by VISSL's stateful
//      distributed sampler.
//   2. An MLP whose forward and backward we write ourselves: mlp_cpu.hpp (Eigen) on the CPU,
//      mlp_gpu.cuh (cuBLAS plus kernels of our own) on a GPU. --device picks (devices.hpp).
//   3. sk::parallel::DataParallel (ddp, oss, sdp) or sk::parallel::FsdpEngine (fsdp) owns the
//      flat parameter buffers, the gradient buckets and the sharded optimizer: our backward adds
//      each gradient into engine.grad(i) and calls engine.ready(i); engine.finish() waits for
//      the communication; engine.step() updates (train.hpp). Under fsdp each layer is a unit
//      whose parameters exist whole only while the layer runs.
//   4. The ZeRO stage is a flag: ddp (plain data parallel), oss (ZeRO-1: optimizer state
//      sharded), sdp (ZeRO-2: gradients too), fsdp (ZeRO-3: parameters too). The results are
//      DDP's; the memory is not. --offload optimizer moves the optimizer's master, state and
//      step to the host (params: fsdp's parameter shards too), with the same results.
//   5. Checkpoints (sk::checkpoint::save_step_checkpoint): --checkpoint DIR saves the
//      parameters and the optimizer state, whole (streamed to rank 0) or one file per rank
//      (--checkpoint-layout sharded), as a step folder that becomes DIR/latest in one atomic
//      rename once complete; --async-checkpoint writes the sharded files in the background
//      (sk::checkpoint::AsyncCheckpointer); --resume DIR continues exactly from the newest
//      complete one, under any stage and rank count, however the previous run ended.
//   6. --graph: the training step captured once and replayed (sk::StepGraph): the batch is
//      staged and the rate set before each step, outside it, and the step reads them; on a GPU
//      each step is then one CUDA graph launch.
//
// Ranks are threads of this process by default (--ranks N; on a GPU they share it); under
// mpirun each process is one rank, over MPI on the CPU and NCCL on GPUs. The last line printed
// is a JSON summary.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <shardkit/checkpoint/checkpoint.hpp>
#include <shardkit/comm/comm.hpp>
#include <shardkit/data/data.hpp>
#include <shardkit/parallel/memory_plan.hpp>

#include "devices.hpp"

namespace sk = shardkit;

namespace {

// The choices the command line names and main() turns into the run's setup; the numbers and
// folders that are the setup as they stand bind to custom_loop::Setup directly.
struct Flags {
  std::string stage = "sdp";
  std::string optimizer = "sgd";
  std::string partition = "flat";
  float lr = 0;  // 0: the optimizer's default below
  int hidden = 1024;
  double bucket_mb = 4;
  bool broadcast_fp16 = false;
  std::string data_dir = sk::data::kFashionMnistDir;
  std::string device = "auto";
  bool skip_without_gpu = false;
  std::string checkpoint_layout = "full";
  std::string precision = "f32";
  std::string offload = "none";
  std::string nvme_path;
  std::string quantized_weights_format = "int8";
  std::string quantized_weights_scale = "block";
  std::string quantized_grads_format = "int8";
};

float default_lr(sk::optim::OptimizerKind kind) {
  switch (kind) {
    case sk::optim::OptimizerKind::sgd:
      return 0.05f;
    case sk::optim::OptimizerKind::larc_sgd:
      return 2.0f;  // LARC scales it by trust·‖w‖/‖g‖
    default:
      return 1e-3f;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  custom_loop::Setup setup;
  setup.ranks = 2;
  CLI::App app{"shardkit custom training loop: an MLP on Fashion-MNIST, sharded with ZeRO"};
  app.add_option("--stage", flags.stage, "ddp, oss (ZeRO-1), sdp (ZeRO-2) or fsdp (ZeRO-3)")
      ->check(CLI::IsMember({"ddp", "oss", "sdp", "fsdp"}));
  app.add_option("--optimizer", flags.optimizer, "sgd, larc_sgd, adam or adamw")
      ->check(CLI::IsMember({"sgd", "larc_sgd", "adam", "adamw"}));
  app.add_option("--precision", flags.precision,
                 "f32, or mixed precision with an f16 (loss-scaled) or bf16 compute copy: f32 "
                 "masters and optimizer state, gradients reduced in the compute dtype")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--offload", flags.offload,
                 "CPU offload: none, optimizer (f32 master, optimizer state and step on the "
                 "host's threads; any stage) or params (fsdp: the parameter shards too)")
      ->check(CLI::IsMember({"none", "optimizer", "params"}));
  app.add_option("--nvme-path", flags.nvme_path,
                 "offload to NVMe: the f32 master and optimizer state in files in this "
                 "directory on a fast disk, streamed through RAM at each step (DeepSpeed "
                 "ZeRO-Infinity's offload_optimizer device nvme; implies --offload optimizer; "
                 "with --offload params, fsdp's parameter shards there too: offload_param "
                 "device nvme)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--partition", flags.partition,
                 "oss/sdp: flat (even split, exactly 1/N per rank) or greedy (whole parameters, "
                 "FairScale's OSS)")
      ->check(CLI::IsMember({"greedy", "flat"}));
  app.add_option("--ranks", setup.ranks, "ranks as threads of this process (ignored under mpirun)")
      ->check(CLI::Range(1, 64));
  app.add_option("--epochs", setup.epochs, "passes over the training set")
      ->check(CLI::Range(1, 1000));
  app.add_option("--max-steps", setup.max_steps, "stop after this many steps (0: whole epochs)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch", setup.batch, "images per rank per step")->check(CLI::Range(1, 4096));
  // (CLI11's PositiveNumber and Range let a NaN through: every comparison with it is false)
  const CLI::Validator positive_finite(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !std::isfinite(value) || value <= 0)
          return "'" + text + "' is not a positive finite number";
        return {};
      },
      "POSITIVE");
  app.add_option("--lr", flags.lr, "learning rate (default: 0.05 sgd, 2 larc_sgd, 1e-3 adam)")
      ->check(positive_finite);
  app.add_option("--loss-scale-init", setup.loss_scaler.init_scale,
                 "--precision f16: the loss scale to start from (GradScaler's init_scale)")
      ->check(positive_finite & CLI::Range(0.0, 3.0e38));
  app.add_option("--loss-scale-growth-interval", setup.loss_scaler.growth_interval,
                 "--precision f16: finite steps in a row before the scale doubles "
                 "(GradScaler's growth_interval)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  app.add_option("--hidden", flags.hidden, "width of the two hidden layers")
      ->check(CLI::Range(1, 16384));
  app.add_option("--bucket-mb", flags.bucket_mb, "gradient bucket size in MiB")
      ->check(positive_finite & CLI::Range(0.0, 65536.0));
  app.add_flag("--broadcast-fp16", flags.broadcast_fp16, "oss/sdp: send parameters as f16");
  app.add_flag("--quantized-weights", setup.parallel.fsdp.quantized_weights,
               "fsdp: gather the parameters as int8 blocks with an f32 scale each (DeepSpeed's "
               "qwZ); the shards and the optimizer stay exact");
  app.add_option("--quantized-weights-format", flags.quantized_weights_format,
                 "--quantized-weights: the codes, int8 (DeepSpeed's qwZ), f8_e4m3 (FSDP2's "
                 "float8 all-gather) or int4")
      ->check(CLI::IsMember({"int8", "f8_e4m3", "int4"}));
  app.add_option("--quantized-weights-scale", flags.quantized_weights_scale,
                 "--quantized-weights: a scale per block of --quantization-block values, or "
                 "with f8_e4m3 a scale per tensor (FSDP2's float8 all-gather)")
      ->check(CLI::IsMember({"block", "tensor"}));
  app.add_flag("--quantized-grads", setup.parallel.fsdp.quantized_grads,
               "fsdp: reduce the gradients by an all-to-all of int8 blocks summed in f32 by "
               "each owner (DeepSpeed's qgZ)");
  app.add_option("--quantized-grads-format", flags.quantized_grads_format,
                 "--quantized-grads: the codes, int8, int4 (ZeRO++'s gradient width; an even "
                 "--quantization-block) or f8_e4m3")
      ->check(CLI::IsMember({"int8", "int4", "f8_e4m3"}));
  app.add_flag("--grad-error-feedback", setup.parallel.fsdp.grad_error_feedback,
               "--quantized-grads: carry what quantisation dropped into the next step");
  app.add_option("--reshard-group", setup.parallel.fsdp.reshard_group_size,
                 "fsdp: after the forward keep each unit sharded over groups of this many ranks "
                 "(a node), so the backward gathers inside them (DeepSpeed's hpZ; 0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--hybrid-group", setup.hybrid_group,
                 "hybrid sharding (FSDP's HYBRID_SHARD): groups of this many consecutive ranks "
                 "(a node) shard the model states and the groups replicate them, so only the "
                 "gradients' exchange crosses groups (quantised too with --quantized-grads; 0: "
                 "off, one group of every rank)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--quantization-block", setup.parallel.fsdp.quantization_block,
                 "--quantized-weights / --quantized-grads: values per scale")
      ->check(CLI::Range(1, 1 << 24));
  app.add_flag("--graph", setup.graph,
               "capture the training step once, after two warm-up steps, and replay it: one CUDA "
               "graph launch per step on a GPU (sk::StepGraph); on the CPU the step runs under the "
               "capture's rules, with the same results");
  app.add_option("--seed", setup.seed, "seed of initialisation and shuffling");
  app.add_option("--data-dir", flags.data_dir, "folder with the Fashion-MNIST .gz files");
  app.add_option("--device", flags.device,
                 "auto (the GPU if this build has CUDA and one is present), cpu or gpu")
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  app.add_flag("--skip-without-gpu", flags.skip_without_gpu,
               "for test harnesses: with --device gpu, exit 77 (skipped) when no GPU can be used");
  app.add_option("--checkpoint", setup.checkpoint_dir,
                 "folder of the checkpoints: step folders, the newest behind DIR/latest (at the "
                 "end, and every --checkpoint-every steps)");
  app.add_option("--checkpoint-every", setup.checkpoint_every,
                 "steps between checkpoints (0: at the end only)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-layout", flags.checkpoint_layout,
                 "full (model.safetensors + optimizer.safetensors, gathered on rank 0) or "
                 "sharded (one file per rank)")
      ->check(CLI::IsMember({"full", "sharded"}));
  app.add_flag("--async-checkpoint", setup.async_checkpoint,
               "write checkpoints in the background: a save blocks only for a copy of each "
               "rank's state (needs --checkpoint-layout sharded)");
  app.add_option("--resume", setup.resume_dir,
                 "continue from the newest complete checkpoint in this folder (DIR/latest), or "
                 "from this checkpoint folder itself (any stage or rank count)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--stop-after", setup.stop_after,
                 "end this run after so many steps, as a preempted job would (the schedule still "
                 "spans the whole run; resume it with --resume)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    // `kill -USR1 <pid>` prints what each rank's communicator did last (a hung job says where).
    sk::comm::install_recorder_dump(SIGUSR1);
    setup.parallel.fsdp.quantized_weights_format =
        *sk::find_name(flags.quantized_weights_format, sk::ops::kQuantFormatNames);
    setup.parallel.fsdp.quantized_grads_format =
        *sk::find_name(flags.quantized_grads_format, sk::ops::kQuantFormatNames);
    setup.parallel.fsdp.quantized_weights_scale =
        *sk::find_name(flags.quantized_weights_scale, sk::ops::kQuantScaleNames);
    const auto device = custom_loop::choose_device(flags.device, flags.skip_without_gpu);
    if (device == custom_loop::DeviceChoice::skip) {
      std::printf("custom_loop: --device gpu, but no GPU can be used here: skipped\n");
      return 77;  // Meson's (and automake's) "skipped"
    }
    const auto start = std::chrono::steady_clock::now();
    const auto train = sk::data::load_fashion_mnist("train", flags.data_dir);
    const auto test = sk::data::load_fashion_mnist("t10k", flags.data_dir);

    setup.train = &train;
    setup.test = &test;
    setup.widths = {train.pixels_per_image(), flags.hidden, flags.hidden, 10};

    auto& optimizer = setup.optimizer;
    optimizer.kind = sk::optim::parse_optimizer_kind(flags.optimizer);
    optimizer.sgd.momentum = 0.9f;
    optimizer.sgd.weight_decay = 1e-5f;
    optimizer.larc.trust_coefficient = 0.001f;  // SwAV / VISSL's LARC
    optimizer.larc.clip = false;
    optimizer.adam.weight_decay = optimizer.kind == sk::optim::OptimizerKind::adamw ? 0.01f : 0.0f;
    setup.lr = flags.lr > 0 ? flags.lr : default_lr(optimizer.kind);

    auto& options = setup.parallel;
    options.stage = sk::parallel::parse_stage(flags.stage);
    options.partition = flags.partition == "flat" ? sk::shard::PartitionKind::flat
                                                  : sk::shard::PartitionKind::greedy;
    options.buckets.bucket_bytes = static_cast<std::size_t>(flags.bucket_mb * (1 << 20));
    options.broadcast_fp16 = flags.broadcast_fp16;
    if (flags.precision != "f32")
      options.precision = sk::parallel::MixedPrecision::of(
          flags.precision == "f16" ? sk::DType::f16 : sk::DType::bf16);
    sk::check(!setup.graph || flags.precision != "f16",
              "--graph with --precision f16: this MLP multiplies its f16 gradients by the loss "
              "scale on the host (a read of the scale at every step), which a captured step "
              "cannot do; use --precision bf16 or f32 with --graph");
    options.offload.optimizer = flags.offload != "none";
    options.offload.params = flags.offload == "params";
    options.offload.nvme_path = flags.nvme_path;
    sk::parallel::validate(options.offload, options.stage);

    setup.checkpoint_layout = flags.checkpoint_layout == "sharded"
                                  ? sk::checkpoint::CheckpointLayout::sharded
                                  : sk::checkpoint::CheckpointLayout::full;
    sk::check(!setup.async_checkpoint ||
                  setup.checkpoint_layout == sk::checkpoint::CheckpointLayout::sharded,
              "--async-checkpoint writes one file per rank in the background; add "
              "--checkpoint-layout sharded (the full layout gathers on rank 0 while the ranks "
              "wait)");
    if (!setup.checkpoint_dir.empty()) std::filesystem::create_directories(setup.checkpoint_dir);

    // --- the memory plan, before any state exists (parallel/memory_plan.hpp) -----------------
    const auto launch = sk::comm::detect_launch();
    sk::parallel::PlannedRun run;
    run.parallel = options;
    // (under a launcher, its ranks: mpirun -np 1 is one rank, not --ranks' default of 2)
    run.world_size = launch.kind != sk::comm::LaunchKind::single ? launch.size : setup.ranks;
    run.group_size = setup.hybrid_group;
    sk::check(setup.hybrid_group == 0 || run.world_size % setup.hybrid_group == 0,
              "--hybrid-group ", setup.hybrid_group, " does not divide the ", run.world_size,
              " ranks; pass a divisor of the rank count (the ranks of one node)");
    sk::check(setup.hybrid_group == 0 || options.fsdp.reshard_group_size == 0,
              "--reshard-group with --hybrid-group: the hybrid groups already keep the gathers "
              "inside them; pass one of the two");
    run.optimizer = optimizer;
    const auto specs = custom_loop::mlp_param_specs(setup.widths);
    for (std::size_t i = 0; i < specs.size(); i += 2)  // train.hpp's units: one per layer
      run.fsdp_units.push_back({i, i + 1});
    const auto plan = sk::parallel::plan_memory(specs, run);
    if (launch.rank == 0)
      std::printf(
          "memory plan per rank (MB): parameters %.2f, gradients %.2f, optimizer state "
          "%.2f, communication <= %.2f\n",
          plan.parameters / 1e6, plan.gradients / 1e6, plan.optimizer_state / 1e6,
          double(plan.communication + plan.gathered) / 1e6);
    if (launch.rank == 0 && options.offload.enabled())
      std::printf(
          "offloaded to the host per rank (MB): parameters %.2f, gradients %.2f, optimizer "
          "state %.2f; %.2f MB between host and device per step\n",
          plan.host_parameters / 1e6, plan.host_gradients / 1e6, plan.host_optimizer_state / 1e6,
          plan.host_transfer / 1e6);
    if (launch.rank == 0 && options.offload.on_disk())
      std::printf(
          "on disk in %s per rank (MB): optimizer state (and a separate f32 master) %.2f, "
          "parameter shards "
          "%.2f; %.2f MB read and written there per step, at most %.2f MB of it in RAM at once\n",
          options.offload.nvme_path.c_str(), plan.disk_optimizer_state / 1e6,
          plan.disk_parameters / 1e6, plan.disk_transfer / 1e6, plan.disk_streaming / 1e6);

    // --- train: every rank runs train.hpp's loop on the chosen device -------------------------
    const custom_loop::Results results = custom_loop::train_on(device, setup);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // --- report (rank 0 of the job) ----------------------------------------------------------
    const bool under_mpi = results.backend != "local";  // (a process per rank)
    if (under_mpi && sk::comm::detect_launch().rank != 0) return 0;
    const std::string groups = setup.hybrid_group > 0
                                   ? " as " + std::to_string(results.world / setup.hybrid_group) +
                                         " hybrid groups of " + std::to_string(setup.hybrid_group)
                                   : "";
    std::printf("\ntest accuracy %.2f%% after %lld steps (%s, %s, %d ranks%s on the %s, %.1f s)\n",
                100 * results.test_accuracy, static_cast<long long>(results.steps),
                flags.stage.c_str(), flags.optimizer.c_str(), results.world, groups.c_str(),
                results.device.c_str(), seconds);
    std::printf(
        "\nmemory per rank (MB, current after the last step; communication peak over the run in "
        "brackets%s):\n",
        under_mpi ? "; this process's rank only" : "");
    std::printf("%4s %12s %12s %16s %14s\n", "rank", "parameters", "gradients", "optimizer_state",
                "communication");
    nlohmann::json memory = nlohmann::json::array();
    using C = sk::MemoryCategory;
    sk::MemorySnapshot most;  // per category, the most loaded rank's figure
    for (std::size_t r = 0; r < results.ranks.size(); ++r) {
      const auto& m = results.ranks[r].memory;
      std::printf("%4zu %12.2f %12.2f %16.2f %6.2f [%5.2f]\n", r, m.current_of(C::parameters) / 1e6,
                  m.current_of(C::gradients) / 1e6, m.current_of(C::optimizer_state) / 1e6,
                  m.current_of(C::communication) / 1e6, m.peak_of(C::communication) / 1e6);
      for (auto c : sk::kAllMemoryCategories) {
        const auto i = static_cast<std::size_t>(c);
        most.current[i] = std::max(most.current[i], m.current[i]);
        most.peak[i] = std::max(most.peak[i], m.peak[i]);
      }
      nlohmann::json row;
      for (auto c : sk::kAllMemoryCategories)
        row[std::string(sk::memory_category_name(c))] = m.current_of(c);
      row["peak_total"] = m.peak_total;
      memory.push_back(row);
    }
    if (results.ranks.size() > 1)
      std::printf(" max %12.2f %12.2f %16.2f %6.2f [%5.2f]\n", most.current_of(C::parameters) / 1e6,
                  most.current_of(C::gradients) / 1e6, most.current_of(C::optimizer_state) / 1e6,
                  most.current_of(C::communication) / 1e6, most.peak_of(C::communication) / 1e6);
    std::printf("plan %12.2f %12.2f %16.2f   <= %5.2f\n", plan.parameters / 1e6,
                plan.gradients / 1e6, plan.optimizer_state / 1e6,
                double(plan.communication + plan.gathered) / 1e6);
    if (options.offload.enabled() && !results.ranks.empty()) {
      const auto& h = results.ranks[0].host_memory;
      std::printf(
          "host %12.2f %12.2f %16.2f   (rank 0's offloaded state; planned %.2f / %.2f / "
          "%.2f)\n",
          h.current_of(C::parameters) / 1e6, h.current_of(C::gradients) / 1e6,
          h.current_of(C::optimizer_state) / 1e6, plan.host_parameters / 1e6,
          plan.host_gradients / 1e6, plan.host_optimizer_state / 1e6);
    }
    const custom_loop::RankReport rank0 =
        results.ranks.empty() ? custom_loop::RankReport{} : results.ranks[0];
    nlohmann::json summary = {{"sample", "custom_loop"},
                              {"stage", flags.stage},
                              {"optimizer", flags.optimizer},
                              {"partition", flags.partition},
                              {"precision", flags.precision},
                              {"offload", flags.offload},
                              {"nvme_path", flags.nvme_path},
                              {"ranks", results.world},
                              {"hybrid_group", setup.hybrid_group},
                              {"backend", results.backend},
                              {"device", results.device},
                              {"steps", results.steps},
                              {"batch_per_rank", setup.batch},
                              {"test_accuracy", results.test_accuracy},
                              {"final_loss_rank0", rank0.last_loss},
                              {"params_fnv1a", results.params_fnv1a},
                              {"seconds", seconds},
                              {"bus_bytes_per_step_rank0", rank0.bus_bytes_per_step},
                              {"memory_bytes_per_rank", memory},
                              {"memory_plan_bytes",
                               {{"parameters", plan.parameters},
                                {"gradients", plan.gradients},
                                {"optimizer_state", plan.optimizer_state},
                                {"communication_bound", plan.communication + plan.gathered},
                                {"host_parameters", plan.host_parameters},
                                {"host_gradients", plan.host_gradients},
                                {"host_optimizer_state", plan.host_optimizer_state},
                                {"disk_optimizer_state", plan.disk_optimizer_state},
                                {"disk_parameters", plan.disk_parameters},
                                {"disk_streaming", plan.disk_streaming}}}};
    std::printf("%s\n", summary.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_loop: %s\n", e.what());
    return 1;
  }
}
