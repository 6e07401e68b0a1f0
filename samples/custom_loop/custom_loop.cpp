// A custom training loop, sharded with shardkit. Read it top to bottom:
//
//   1. Fashion-MNIST from Debian's dataset-fashion-mnist, split over ranks by VISSL's stateful
//      distributed sampler.
//   2. An MLP whose forward and backward we write ourselves (mlp_cpu.hpp, Eigen).
//   3. sk::parallel::DataParallel owns the flat parameter buffer, the gradient buckets and the
//      sharded optimizer: our backward adds each gradient into dp.grad(i) and calls
//      dp.ready(i); dp.finish() waits for the communication; dp.step() updates.
//   4. The ZeRO stage is a flag: ddp (plain data parallel), oss (ZeRO-1: optimizer state
//      sharded), sdp (ZeRO-2: gradients too). The results are DDP's; the memory is not.
//
// Ranks are threads of this process by default (--ranks N); under mpirun each process is one
// rank over MPI. The last line printed is a JSON summary.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <shardkit/comm/comm.hpp>
#include <shardkit/io/io.hpp>
#include <shardkit/optim/cpu_backend.hpp>
#include <shardkit/parallel/data_parallel.hpp>

#include "mlp_cpu.hpp"

namespace sk = shardkit;
using custom_loop::Matrix;

namespace {

struct Flags {
  std::string stage = "sdp";
  std::string optimizer = "sgd";
  std::string partition = "greedy";
  int ranks = 2;
  int epochs = 1;
  int max_steps = 0;  // 0: whole epochs
  int batch = 64;     // per rank
  float lr = 0;       // 0: the optimizer's default below
  int hidden = 1024;
  double bucket_mb = 4;
  bool broadcast_fp16 = false;
  std::uint64_t seed = 1;
  std::string data_dir = sk::io::kFashionMnistDir;
};

float default_lr(sk::optim::OptimizerKind kind) {
  switch (kind) {
    case sk::optim::OptimizerKind::sgd: return 0.05f;
    case sk::optim::OptimizerKind::larc_sgd: return 2.0f;  // LARC scales it by trust·‖w‖/‖g‖
    default: return 1e-3f;
  }
}

// Images as rows of normalised pixels (Fashion-MNIST's mean 0.2860, std 0.3530).
Matrix batch_images(const sk::io::ImageDataset& data, const std::vector<std::int64_t>& indices,
                    std::size_t first, std::size_t count, std::vector<std::uint8_t>& labels) {
  const auto pixels = data.pixels_per_image();
  Matrix x(static_cast<Eigen::Index>(count), pixels);
  labels.resize(count);
  for (std::size_t r = 0; r < count; ++r) {
    const auto index = indices[first + r];
    const std::uint8_t* image = data.image(index);
    for (std::int64_t p = 0; p < pixels; ++p)
      x(static_cast<Eigen::Index>(r), p) = (image[p] / 255.0f - 0.2860f) / 0.3530f;
    labels[r] = data.labels[static_cast<std::size_t>(index)];
  }
  return x;
}

struct RankReport {
  sk::MemorySnapshot memory;
  double bus_bytes_per_step = 0;
  double last_loss = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"shardkit custom training loop: an MLP on Fashion-MNIST, sharded with ZeRO"};
  app.add_option("--stage", flags.stage, "ddp, oss (ZeRO-1) or sdp (ZeRO-2)")
      ->check(CLI::IsMember({"ddp", "oss", "sdp"}));
  app.add_option("--optimizer", flags.optimizer, "sgd, larc_sgd, adam or adamw")
      ->check(CLI::IsMember({"sgd", "larc_sgd", "adam", "adamw"}));
  app.add_option("--partition", flags.partition, "greedy (whole parameters) or flat (even split)")
      ->check(CLI::IsMember({"greedy", "flat"}));
  app.add_option("--ranks", flags.ranks, "ranks as threads of this process (ignored under mpirun)")
      ->check(CLI::Range(1, 64));
  app.add_option("--epochs", flags.epochs, "passes over the training set")->check(CLI::Range(1, 1000));
  app.add_option("--max-steps", flags.max_steps, "stop after this many steps (0: whole epochs)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch", flags.batch, "images per rank per step")->check(CLI::Range(1, 4096));
  app.add_option("--lr", flags.lr, "learning rate (default: 0.05 sgd, 2 larc_sgd, 1e-3 adam)");
  app.add_option("--hidden", flags.hidden, "width of the two hidden layers")->check(CLI::Range(1, 16384));
  app.add_option("--bucket-mb", flags.bucket_mb, "gradient bucket size in MiB")->check(CLI::PositiveNumber);
  app.add_flag("--broadcast-fp16", flags.broadcast_fp16, "oss/sdp: send parameters as f16");
  app.add_option("--seed", flags.seed, "seed of initialisation and shuffling");
  app.add_option("--data-dir", flags.data_dir, "folder with the Fashion-MNIST .gz files");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto start = std::chrono::steady_clock::now();
    const auto train = sk::io::load_fashion_mnist("train", flags.data_dir);
    const auto test = sk::io::load_fashion_mnist("t10k", flags.data_dir);
    const std::vector<std::int64_t> widths = {train.pixels_per_image(), flags.hidden, flags.hidden, 10};

    sk::optim::OptimizerConfig optimizer;
    optimizer.kind = sk::optim::parse_optimizer_kind(flags.optimizer);
    optimizer.sgd.momentum = 0.9f;
    optimizer.sgd.weight_decay = 1e-5f;
    optimizer.larc.trust_coefficient = 0.001f;  // SwAV / VISSL's LARC
    optimizer.larc.clip = false;
    optimizer.adam.weight_decay = optimizer.kind == sk::optim::OptimizerKind::adamw ? 0.01f : 0.0f;
    const float lr = flags.lr > 0 ? flags.lr : default_lr(optimizer.kind);

    sk::parallel::DataParallelOptions options;
    options.stage = sk::parallel::parse_stage(flags.stage);
    options.partition = flags.partition == "flat" ? sk::shard::PartitionKind::flat : sk::shard::PartitionKind::greedy;
    options.buckets.bucket_bytes = static_cast<std::size_t>(flags.bucket_mb * (1 << 20));
    options.broadcast_fp16 = flags.broadcast_fp16;

    const auto launch = sk::comm::detect_launch();
    const bool under_mpi = launch.kind == sk::comm::LaunchKind::mpi;
    std::vector<RankReport> reports;
    std::mutex report_mutex;
    double test_accuracy = 0;
    std::int64_t steps_done = 0;
    int world = 0;

    // --- what every rank runs ---------------------------------------------------------------
    auto run_rank = [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      const int rank = comm.rank();
      sk::parallel::DataParallel<sk::optim::CpuOps> dp(ctx, comm, custom_loop::mlp_param_specs(widths),
                                                       optimizer, options);
      ctx.manual_seed(flags.seed);
      custom_loop::init_mlp(ctx, dp.params());
      dp.broadcast_parameters(0);  // every rank starts from rank 0's initialisation
      custom_loop::MlpCpu mlp(widths);

      sk::io::StatefulDistributedSampler sampler(train.count, comm.size(), rank, flags.batch, flags.seed);
      const std::int64_t steps_per_epoch = sampler.samples_per_rank() / flags.batch;
      const std::int64_t total_steps = flags.max_steps > 0
                                           ? std::min<std::int64_t>(flags.max_steps, steps_per_epoch * flags.epochs)
                                           : steps_per_epoch * flags.epochs;
      std::vector<std::uint8_t> labels;
      std::int64_t step = 0;
      double loss = 0;
      comm.reset_stats();
      for (int epoch = 0; step < total_steps; ++epoch) {
        sampler.set_epoch(epoch);
        const auto indices = sampler.indices();
        for (std::int64_t b = 0; b < steps_per_epoch && step < total_steps; ++b, ++step) {
          const Matrix x = batch_images(train, indices, static_cast<std::size_t>(b * flags.batch),
                                        static_cast<std::size_t>(flags.batch), labels);
          dp.zero_grad();
          loss = mlp.forward(dp.params(), x, labels);
          mlp.backward(dp.params(), [&](std::size_t i) { return dp.grad(i); },
                       [&](std::size_t i) { dp.ready(i); });
          dp.finish();
          // Cosine decay over the run.
          const float progress = static_cast<float>(step) / static_cast<float>(total_steps);
          dp.step(lr * 0.5f * (1.0f + std::cos(3.14159265f * progress)));
          if (rank == 0 && (step % 100 == 0 || step + 1 == total_steps))
            std::printf("step %5lld/%lld  epoch %d  loss %.4f\n", static_cast<long long>(step),
                        static_cast<long long>(total_steps), epoch, loss);
        }
      }
      const double bus_bytes = static_cast<double>(comm.stats().total_bus_bytes()) /
                               static_cast<double>(std::max<std::int64_t>(1, total_steps));
      // Every rank holds the full parameters after a step: rank 0 evaluates.
      if (rank == 0) {
        int correct = 0;
        std::vector<std::int64_t> all(static_cast<std::size_t>(test.count));
        for (std::int64_t i = 0; i < test.count; ++i) all[static_cast<std::size_t>(i)] = i;
        for (std::int64_t first = 0; first < test.count; first += 500) {
          const auto count = static_cast<std::size_t>(std::min<std::int64_t>(500, test.count - first));
          const Matrix x = batch_images(test, all, static_cast<std::size_t>(first), count, labels);
          mlp.forward(dp.params(), x, labels, &correct);
        }
        test_accuracy = static_cast<double>(correct) / static_cast<double>(test.count);
        steps_done = total_steps;
      }
      std::lock_guard lock(report_mutex);
      if (reports.size() < static_cast<std::size_t>(comm.size())) reports.resize(static_cast<std::size_t>(comm.size()));
      reports[static_cast<std::size_t>(rank)] = RankReport{ctx.memory_stats().snapshot(), bus_bytes, loss};
      world = comm.size();
    };

    // --- ranks: threads of this process, or this process under mpirun ------------------------
    if (under_mpi) {
      sk::Context ctx({.rank = launch.rank, .seed = flags.seed});
      auto comm = sk::comm::make_communicator(ctx);
      run_rank(ctx, *comm);
    } else {
      sk::comm::run_ranks(flags.ranks, run_rank);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // --- report (rank 0 of the job) ----------------------------------------------------------
    if (!under_mpi || launch.rank == 0) {
      std::printf("\ntest accuracy %.2f%% after %lld steps (%s, %s, %d ranks, %.1f s)\n",
                  100 * test_accuracy, static_cast<long long>(steps_done), flags.stage.c_str(),
                  flags.optimizer.c_str(), world, seconds);
      std::printf("\nmemory per rank (MB, current after the last step; communication peak over the run in brackets):\n");
      std::printf("%4s %12s %12s %16s %14s\n", "rank", "parameters", "gradients", "optimizer_state", "communication");
      nlohmann::json memory = nlohmann::json::array();
      for (std::size_t r = 0; r < reports.size(); ++r) {
        const auto& m = reports[r].memory;
        using C = sk::MemoryCategory;
        std::printf("%4zu %12.2f %12.2f %16.2f %6.2f [%5.2f]\n", r, m.current_of(C::parameters) / 1e6,
                    m.current_of(C::gradients) / 1e6, m.current_of(C::optimizer_state) / 1e6,
                    m.current_of(C::communication) / 1e6, m.peak_of(C::communication) / 1e6);
        nlohmann::json row;
        for (auto c : sk::kAllMemoryCategories)
          row[std::string(sk::memory_category_name(c))] = m.current_of(c);
        row["peak_total"] = m.peak_total;
        memory.push_back(row);
      }
      nlohmann::json summary = {
          {"sample", "custom_loop"},       {"stage", flags.stage},
          {"optimizer", flags.optimizer},  {"partition", flags.partition},
          {"ranks", world},                {"backend", under_mpi ? "mpi" : "local"},
          {"device", "cpu"},               {"steps", steps_done},
          {"batch_per_rank", flags.batch}, {"test_accuracy", test_accuracy},
          {"final_loss_rank0", reports.empty() ? 0.0 : reports[0].last_loss},
          {"seconds", seconds},
          {"bus_bytes_per_step_rank0", reports.empty() ? 0.0 : reports[0].bus_bytes_per_step},
          {"memory_bytes_per_rank", memory}};
      std::printf("%s\n", summary.dump().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_loop: %s\n", e.what());
    return 1;
  }
}
