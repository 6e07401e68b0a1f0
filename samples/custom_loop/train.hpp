// The training loop of the custom-loop sample, written once for both devices: Device is
// CpuDevice (mlp_cpu.hpp) or GpuDevice (mlp_gpu.cuh), which bring the MLP, the optimizer backend
// and how ranks get their contexts. Every rank:
//
//   1. takes its part of Fashion-MNIST from VISSL's stateful distributed sampler;
//   2. runs the MLP's forward and hand-written backward; the backward adds each gradient into
//      dp.grad(i) and calls dp.ready(i), so finished buckets communicate while it goes on;
//   3. dp.finish() waits for the communication, dp.step() updates (sharded by the ZeRO stage).
//
// Rank 0 then evaluates on the test set. Free of Eigen (see mlp.hpp): nvcc compiles this too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <shardkit/comm/comm.hpp>
#include <shardkit/io/io.hpp>
#include <shardkit/parallel/data_parallel.hpp>

#include "checkpoint.hpp"
#include "mlp.hpp"

namespace custom_loop {

// Everything main() decided from the flags.
struct Setup {
  const sk::io::ImageDataset* train = nullptr;
  const sk::io::ImageDataset* test = nullptr;
  std::vector<std::int64_t> widths;
  sk::optim::OptimizerConfig optimizer;
  sk::parallel::DataParallelOptions parallel;
  float lr = 0;
  int ranks = 1;  // threads of this process; ignored under mpirun
  int epochs = 1;
  std::int64_t max_steps = 0;  // 0: whole epochs
  std::int64_t batch = 64;     // per rank
  std::uint64_t seed = 1;
  std::string checkpoint_dir;         // save here every checkpoint_every steps and at the end
  std::int64_t checkpoint_every = 0;  // 0: at the end only
  std::string resume_dir;             // continue from the checkpoint here
  std::int64_t stop_after = 0;        // end this run after so many steps (0: run to the end)
};

struct RankReport {
  sk::MemorySnapshot memory;
  double bus_bytes_per_step = 0;
  double last_loss = 0;
};

struct Results {
  std::string device;
  std::string backend;  // "local" (threads) or "mpi" (processes)
  int world = 0;
  std::int64_t steps = 0;
  double test_accuracy = 0;
  std::vector<RankReport> ranks;  // under mpirun: this process's rank only
  std::uint64_t params_fnv1a = 0;
};

inline std::uint64_t fnv1a(const std::vector<float>& values) {
  std::uint64_t hash = 1469598103934665603ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (std::size_t i = 0; i < values.size() * sizeof(float); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

// Images as rows of normalised pixels (Fashion-MNIST's mean 0.2860, std 0.3530).
inline void batch_images(const sk::io::ImageDataset& data, const std::vector<std::int64_t>& indices,
                         std::size_t first, std::size_t count, Batch& batch) {
  const auto pixels = data.pixels_per_image();
  batch.rows = static_cast<std::int64_t>(count);
  batch.features = pixels;
  batch.pixels.resize(count * static_cast<std::size_t>(pixels));
  batch.labels.resize(count);
  for (std::size_t r = 0; r < count; ++r) {
    const auto index = indices[first + r];
    const std::uint8_t* image = data.image(index);
    float* row = batch.pixels.data() + r * static_cast<std::size_t>(pixels);
    for (std::int64_t p = 0; p < pixels; ++p) row[p] = (image[p] / 255.0f - 0.2860f) / 0.3530f;
    batch.labels[r] = data.labels[static_cast<std::size_t>(index)];
  }
}

// What every rank runs.
template <class Device>
void train_rank(const Setup& s, sk::Context& ctx, sk::comm::Communicator& comm, Results& results,
                std::mutex& results_mutex) {
  const int rank = comm.rank();
  sk::parallel::DataParallel<typename Device::Ops> dp(ctx, comm, mlp_param_specs(s.widths),
                                                      s.optimizer, s.parallel);
  ctx.manual_seed(s.seed);
  init_mlp(ctx, dp.params());
  dp.broadcast_parameters(0);  // every rank starts from rank 0's initialisation
  typename Device::Mlp mlp(ctx, s.widths);

  sk::io::StatefulDistributedSampler sampler(s.train->count, comm.size(), rank, s.batch, s.seed);
  const std::int64_t steps_per_epoch = sampler.samples_per_rank() / s.batch;
  const std::int64_t total_steps = s.max_steps > 0 ? std::min(s.max_steps, steps_per_epoch * s.epochs)
                                                   : steps_per_epoch * s.epochs;
  Batch batch;
  std::int64_t step = s.resume_dir.empty() ? 0 : load_checkpoint(s.resume_dir, ctx, dp);
  // --stop-after ends this run early, as a preempted job would; the schedule still spans the
  // whole run, so a resumed run continues it exactly.
  const std::int64_t run_end = s.stop_after > 0 ? std::min(total_steps, step + s.stop_after) : total_steps;
  const std::int64_t run_begin = step;
  std::int64_t checkpoint_bus_bytes = 0;
  comm.reset_stats();
  for (std::int64_t epoch = step / steps_per_epoch; step < run_end; ++epoch) {
    sampler.set_epoch(epoch);
    const std::int64_t first_batch = step % steps_per_epoch;  // > 0 only when resuming mid-epoch
    sampler.set_start_iter(first_batch);
    const auto indices = sampler.indices();
    for (std::int64_t b = first_batch; b < steps_per_epoch && step < run_end; ++b, ++step) {
      batch_images(*s.train, indices, static_cast<std::size_t>((b - first_batch) * s.batch),
                   static_cast<std::size_t>(s.batch), batch);
      dp.zero_grad();
      mlp.forward(dp.params(), batch);
      mlp.backward(dp.params(), [&](std::size_t i) { return dp.grad(i); },
                   [&](std::size_t i) { dp.ready(i); });
      dp.finish();
      // Cosine decay over the run.
      const float progress = static_cast<float>(step) / static_cast<float>(total_steps);
      dp.step(s.lr * 0.5f * (1.0f + std::cos(3.14159265f * progress)));
      // Reading the loss waits for the GPU: only when it is printed.
      if (rank == 0 && (step % 100 == 0 || step + 1 == total_steps))
        std::printf("step %5lld/%lld  epoch %lld  loss %.4f\n", static_cast<long long>(step),
                    static_cast<long long>(total_steps), static_cast<long long>(epoch), mlp.loss());
      const bool periodic = s.checkpoint_every > 0 && (step + 1) % s.checkpoint_every == 0;
      if (!s.checkpoint_dir.empty() && (periodic || step + 1 == run_end)) {
        const auto before = comm.stats().total_bus_bytes();  // not counted as training traffic
        save_checkpoint(s.checkpoint_dir, ctx, dp);
        checkpoint_bus_bytes += comm.stats().total_bus_bytes() - before;
      }
    }
  }
  const double loss = step > run_begin ? mlp.loss() : 0.0;  // of the last step
  const double bus_bytes = static_cast<double>(comm.stats().total_bus_bytes() - checkpoint_bus_bytes) /
                           static_cast<double>(std::max<std::int64_t>(1, run_end - run_begin));
  // Every rank holds the full parameters after a step: rank 0 evaluates.
  double accuracy = 0;
  if (rank == 0) {
    const auto& test = *s.test;
    std::int64_t correct = 0;
    std::vector<std::int64_t> all(static_cast<std::size_t>(test.count));
    for (std::int64_t i = 0; i < test.count; ++i) all[static_cast<std::size_t>(i)] = i;
    for (std::int64_t first = 0; first < test.count; first += 500) {
      const auto count = static_cast<std::size_t>(std::min<std::int64_t>(500, test.count - first));
      batch_images(test, all, static_cast<std::size_t>(first), count, batch);
      mlp.forward(dp.params(), batch);
      correct += mlp.correct();
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(test.count);
  }
  std::lock_guard lock(results_mutex);
  // Under mpirun this process only knows its own rank: it reports that one (rank 0 prints).
  const auto slot = static_cast<std::size_t>(results.backend == "mpi" ? 0 : rank);
  if (results.ranks.size() <= slot) results.ranks.resize(slot + 1);
  results.ranks[slot] = RankReport{ctx.memory_stats().snapshot(), bus_bytes, loss};
  results.world = comm.size();
  if (rank == 0) results.test_accuracy = accuracy, results.steps = step;
  // A fingerprint of the final parameters (FNV-1a of their bytes), to compare runs exactly.
  if (rank == 0) results.params_fnv1a = fnv1a(sk::to_vector<float>(ctx, dp.params().flat()));
}

// The ranks: threads of this process, or this process under mpirun.
template <class Device>
Results train(const Setup& s) {
  Results results;
  std::mutex results_mutex;
  results.device = Device::name;
  const auto launch = sk::comm::detect_launch();
  if (launch.kind == sk::comm::LaunchKind::mpi) {
    results.backend = "mpi";
    sk::Context ctx(Device::mpi_context(launch, s.seed));
    auto comm = sk::comm::make_communicator(ctx);  // MPI on the CPU, NCCL on GPUs
    train_rank<Device>(s, ctx, *comm, results, results_mutex);
  } else {
    results.backend = "local";
    sk::comm::run_ranks(
        s.ranks,
        [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          train_rank<Device>(s, ctx, comm, results, results_mutex);
        },
        Device::run_options());
  }
  return results;
}

#if SK_WITH_CUDA
// train<GpuDevice>: compiled by nvcc in custom_loop_gpu.cu (see devices.hpp for why apart).
Results train_gpu(const Setup& setup);
#endif

}  // namespace custom_loop
