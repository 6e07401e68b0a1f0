// The training loop of the custom-loop sample, written once for both devices and every ZeRO
// stage: Device is CpuDevice (mlp_cpu.hpp) or GpuDevice (mlp_gpu.cuh), which bring the MLP, the
// optimizer backend and how ranks get their contexts; Engine is DataParallel (ddp, oss, sdp)
// or FsdpEngine (fsdp, one unit per layer). Every rank:
//
//   1. takes its part of Fashion-MNIST from VISSL's stateful distributed sampler;
//   2. runs the MLP's forward and hand-written backward; under fsdp each layer's parameters are
//      gathered just before its use (the next layer's gather started ahead) and freed after;
//      the backward adds each gradient into engine.grad(i) and calls engine.ready(i), so
//      finished buckets communicate while it goes on;
//   3. engine.finish() waits for the communication, engine.step() updates (sharded by the
//      stage).
//
// Rank 0 then evaluates on the test set. Free of Eigen (see mlp.hpp): nvcc compiles this too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <shardkit/checkpoint/checkpoint.hpp>
#include <shardkit/comm/comm.hpp>
#include <shardkit/comm/hybrid_mesh.hpp>
#include <shardkit/data/data.hpp>
#include <shardkit/optim/loss_scaler.hpp>
#include <shardkit/parallel/data_parallel.hpp>
#include <shardkit/parallel/fsdp_engine.hpp>

#include "mlp.hpp"

namespace custom_loop {

// Everything main() decided from the flags.
struct Setup {
  const sk::data::ImageDataset* train = nullptr;
  const sk::data::ImageDataset* test = nullptr;
  std::vector<std::int64_t> widths;
  sk::optim::OptimizerConfig optimizer;
  sk::parallel::ParallelOptions parallel;  // .stage fsdp: FsdpEngine, its buckets
  // > 0: hybrid sharding (sk::comm::HybridMesh, FSDP's HYBRID_SHARD): groups of this many
  // consecutive ranks shard the model states, and the groups replicate them.
  int hybrid_group = 0;
  float lr = 0;
  int ranks = 1;  // threads of this process; ignored under mpirun
  int epochs = 1;
  std::int64_t max_steps = 0;  // 0: whole epochs
  std::int64_t batch = 64;     // per rank
  std::uint64_t seed = 1;
  std::string checkpoint_dir;         // save here every checkpoint_every steps and at the end
  std::int64_t checkpoint_every = 0;  // 0: at the end only
  sk::checkpoint::CheckpointLayout checkpoint_layout = sk::checkpoint::CheckpointLayout::full;
  bool async_checkpoint = false;  // written in the background (sharded layout only)
  std::string resume_dir;         // continue from the checkpoint here
  // f16's dynamic loss scaling (PyTorch GradScaler's init_scale and growth_interval).
  sk::optim::LossScalerOptions loss_scaler;
  std::int64_t stop_after = 0;  // end this run after so many steps (0: run to the end)
  bool graph = false;           // capture the step once and replay it (sk::StepGraph)
};

struct RankReport {
  sk::MemorySnapshot memory;
  sk::MemorySnapshot host_memory;  // CPU offload: the engine's host context (else `memory`)
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
  for (std::size_t i = 0; i < values.size() * sizeof(float); ++i)
    hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

// Images as rows of normalised pixels (Fashion-MNIST's mean 0.2860, std 0.3530).
inline void batch_images(const sk::data::ImageDataset& data,
                         const std::vector<std::int64_t>& indices, std::size_t first,
                         std::size_t count, Batch& batch) {
  const auto pixels = data.pixels_per_image();
  batch.rows = static_cast<std::int64_t>(count);
  batch.features = pixels;
  batch.pixels.resize(count * static_cast<std::size_t>(pixels));
  batch.labels.resize(count);
  for (std::size_t r = 0; r < count; ++r) {
    const auto index = indices[first + r];
    const std::uint8_t* image = data.image(index).pixels;
    float* row = batch.pixels.data() + r * static_cast<std::size_t>(pixels);
    for (std::int64_t p = 0; p < pixels; ++p) row[p] = (image[p] / 255.0f - 0.2860f) / 0.3530f;
    const std::int32_t label = data.labels[static_cast<std::size_t>(index)];
    sk::check(label >= 0 && label < 256, "image ", index, " has label ", label,
              "; the MLP's batches hold labels 0..255 (one byte a row)");
    batch.labels[r] = static_cast<std::uint8_t>(label);
  }
}

// How the MLP reaches the parameters (the MlpParams of mlp.hpp). Resident: every parameter is
// whole (DataParallel; or FsdpEngine inside full_params()). Gathered: FSDP, one unit per layer,
// gathered before the layer's use with the next layer's gather started ahead, freed after; with
// the shards on disk (--offload params --nvme-path) the layer after that has its shard read
// ahead (a no-op otherwise).
// Under mixed precision the parameters are an f16/bf16 compute copy; the hand-written MLP
// computes in f32, so it reads an f32 copy of each (what its GEMMs would widen to anyway).
inline sk::Tensor as_f32(sk::Context& ctx, const sk::Tensor& t) {
  return t.dtype() == sk::DType::f32 ? t : sk::cast(ctx, t, sk::DType::f32);
}

template <class Engine>
struct ResidentParams {
  Engine* engine;
  sk::Context* ctx;
  sk::Tensor param(std::size_t i) const { return as_f32(*ctx, engine->param(i)); }
  void enter(std::size_t, Pass) {}
  void leave(std::size_t, Pass) {}
};

struct GatheredParams {
  sk::parallel::FsdpEngine* engine;
  sk::Context* ctx;
  sk::Tensor param(std::size_t i) const { return as_f32(*ctx, engine->param(i)); }
  void enter(std::size_t layer, Pass pass) {
    engine->gather(layer);
    const auto after = [&](std::size_t u) { return pass == Pass::forward ? u + 1 : u - 1; };
    const std::size_t next = after(layer);  // (wraps at 0, past unit_count())
    if (next < engine->unit_count()) engine->start_gather(next);
    if (after(next) < engine->unit_count()) engine->read_shard_ahead(after(next));
  }
  void leave(std::size_t layer, Pass) { engine->release(layer); }
};

// The engine of a stage, built and initialised alike on every rank: every parameter from the
// seeded initialiser, then rank 0's values everywhere. Over `mesh`'s groups when there is one,
// else over the whole world.
inline std::unique_ptr<sk::parallel::DataParallel> make_engine(
    const Setup& s, sk::Context& ctx, sk::comm::Communicator& comm, sk::comm::HybridMesh* mesh,
    std::type_identity<sk::parallel::DataParallel>) {
  const auto specs = mlp_param_specs(s.widths);
  auto dp =
      mesh != nullptr
          ? std::make_unique<sk::parallel::DataParallel>(ctx, *mesh, specs, s.optimizer, s.parallel)
          : std::make_unique<sk::parallel::DataParallel>(ctx, comm, specs, s.optimizer, s.parallel);
  dp->set_full_params([&](std::size_t i, const sk::Tensor& view) {  // exact f32 masters
    init_mlp_param(ctx, s.widths, i, view);
  });
  return dp;
}

inline std::unique_ptr<sk::parallel::FsdpEngine> make_engine(
    const Setup& s, sk::Context& ctx, sk::comm::Communicator& comm, sk::comm::HybridMesh* mesh,
    std::type_identity<sk::parallel::FsdpEngine>) {
  const auto specs = mlp_param_specs(s.widths);
  std::vector<sk::parallel::FsdpUnitParams> units;  // unit l: fc(l+1).weight and .bias
  for (std::size_t i = 0; i < specs.size(); i += 2)
    units.push_back({"fc" + std::to_string(i / 2 + 1), {specs[i], specs[i + 1]}});
  auto fsdp = mesh != nullptr ? std::make_unique<sk::parallel::FsdpEngine>(
                                    ctx, *mesh, std::move(units), s.optimizer, s.parallel)
                              : std::make_unique<sk::parallel::FsdpEngine>(
                                    ctx, comm, std::move(units), s.optimizer, s.parallel);
  fsdp->set_full_params(
      [&](std::size_t i, const sk::Tensor& view) { init_mlp_param(ctx, s.widths, i, view); });
  return fsdp;
}

inline ResidentParams<sk::parallel::DataParallel> training_params(sk::Context& ctx,
                                                                  sk::parallel::DataParallel& dp) {
  return {&dp, &ctx};
}
inline GatheredParams training_params(sk::Context& ctx, sk::parallel::FsdpEngine& fsdp) {
  return {&fsdp, &ctx};
}

// Where the MLP adds gradient i. In f32, the engine's own gradient storage. Under mixed
// precision the MLP's f32 gradient goes to a scratch tensor, and ready(i) adds it into the
// engine's f16/bf16 storage, times the loss scale for f16 (the scaled backward a GradScaler
// user runs), before marking it ready.
template <class Engine>
class GradientSink {
 public:
  GradientSink(sk::Context& ctx, Engine& engine, std::size_t count)
      : ctx_(&ctx), engine_(&engine), scratch_(count) {}
  sk::Tensor grad(std::size_t i) {
    const sk::Tensor target = engine_->grad(i);
    if (target.dtype() == sk::DType::f32) return target;
    scratch_[i] = sk::zeros(*ctx_, target.shape(), sk::DType::f32, sk::MemoryCategory::gradients);
    return scratch_[i];
  }
  void ready(std::size_t i, double scale) {
    if (scratch_[i].defined()) {
      if (scale != 1) {  // (the ops layer's multiply-and-check pass, by `scale`)
        sk::Tensor found = sk::zeros(*ctx_, {1}, sk::DType::f32);
        sk::ops::unscale_and_check(*ctx_, static_cast<float>(scale),
                                   std::vector<sk::Tensor>{scratch_[i]}, found);
      }
      sk::add_(*ctx_, engine_->grad(i), scratch_[i]);
      scratch_[i] = sk::Tensor();
    }
    engine_->ready(i);
  }

 private:
  sk::Context* ctx_;
  Engine* engine_;
  std::vector<sk::Tensor> scratch_;
};

// Runs `body` with every parameter whole and readable (collective under fsdp).
template <class Body>
void with_full_params(sk::Context& ctx, sk::parallel::DataParallel& dp, Body&& body) {
  body(ResidentParams<sk::parallel::DataParallel>{&dp, &ctx});
}
template <class Body>
void with_full_params(sk::Context& ctx, sk::parallel::FsdpEngine& fsdp, Body&& body) {
  auto scope = fsdp.full_params();
  body(ResidentParams<sk::parallel::FsdpEngine>{&fsdp, &ctx});
}

// What every rank runs, under one engine.
template <class Device, class Engine>
void train_rank_with(const Setup& s, sk::Context& ctx, sk::comm::Communicator& comm,
                     Results& results, std::mutex& results_mutex) {
  const int rank = comm.rank();
  ctx.manual_seed(s.seed);
  std::unique_ptr<sk::comm::HybridMesh> mesh;
  if (s.hybrid_group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(comm, s.hybrid_group);
  auto engine = make_engine(s, ctx, comm, mesh.get(), std::type_identity<Engine>{});
  // The bytes this rank moved, over the world and, under hybrid sharding, its group's and its
  // replicas' communicators.
  const auto bus_bytes_moved = [&] {
    std::uint64_t bytes = comm.stats().total_bus_bytes();
    if (mesh) bytes += mesh->shard().stats().total_bus_bytes();
    if (mesh && mesh->replicate() != nullptr) bytes += mesh->replicate()->stats().total_bus_bytes();
    return bytes;
  };
  typename Device::Mlp mlp(ctx, s.widths);
  auto params = training_params(ctx, *engine);
  GradientSink<Engine> gradients(ctx, *engine, 2 * (s.widths.size() - 1));
  // f16 needs loss scaling (GradScaler's defaults); bf16 has f32's range.
  const bool scaled = s.parallel.precision.param_dtype == sk::DType::f16;
  sk::optim::DynamicLossScaler scaler(s.loss_scaler);
  // What checkpoints save and load: the engine's state, and the loss scaler's scale and count
  // of finite steps under f16 (a resumed run scales its gradients as one that never stopped).
  const auto training_state = [&] {
    auto state = engine->training_state();
    if (scaled) state.scaler = &scaler;
    return state;
  };

  sk::data::StatefulDistributedSampler sampler(s.train->count, comm.size(), rank, s.batch, s.seed);
  const std::int64_t steps_per_epoch = sampler.samples_per_rank() / s.batch;
  sk::check(steps_per_epoch > 0, "--batch ", s.batch, " is more than the ",
            sampler.samples_per_rank(), " training images each of the ", comm.size(),
            " ranks takes an epoch; pass a smaller --batch or fewer --ranks");
  const std::int64_t total_steps = s.max_steps > 0
                                       ? std::min(s.max_steps, steps_per_epoch * s.epochs)
                                       : steps_per_epoch * s.epochs;
  const std::int64_t images_per_step = s.batch * comm.size();
  Batch batch;
  std::int64_t step = 0;
  if (!s.resume_dir.empty()) {  // the sampler position follows from the step
    // A folder of step folders resumes from the one `latest` names (the newest complete save);
    // any other folder is one checkpoint itself.
    const auto latest = sk::checkpoint::latest_checkpoint(s.resume_dir);
    const std::string from = latest ? *latest : s.resume_dir;
    const auto loaded = sk::checkpoint::load_checkpoint(from, training_state());
    // The loop's own position, in images (an optimizer counts the steps it applied: f16's
    // skipped steps are not among them); a checkpoint from another --ranks or --batch resumes
    // at the same epoch and images, where the schedule's progress is too.
    step = loaded.steps;
    if (loaded.metadata.count("custom_loop.step") != 0) {  // (earlier checkpoints: steps)
      const auto number = [&](const char* key) {
        const auto it = loaded.metadata.find(key);
        std::size_t used = 0;
        std::int64_t value = -1;
        try {
          value = it == loaded.metadata.end() ? -1 : std::stoll(it->second, &used);
        } catch (const std::exception&) {
        }
        sk::check<sk::IoError>(value >= 0 && used == it->second.size(), "checkpoint '", from,
                               "': its entry '", key,
                               "' is missing or not a count; resume "
                               "from a checkpoint this program wrote");
        return value;
      };
      const std::int64_t written = number("custom_loop.step");
      const std::int64_t written_per_epoch =
          std::max<std::int64_t>(1, number("custom_loop.steps_per_epoch"));
      step = sk::data::converted_position(
                 {written, written / written_per_epoch, written % written_per_epoch},
                 number("custom_loop.images_per_step"), images_per_step, steps_per_epoch)
                 .iteration;
    }
    if (rank == 0)
      std::printf("resumed from %s at step %lld (%s checkpoint of a %d-rank %s run)\n",
                  from.c_str(), static_cast<long long>(step),
                  std::string(sk::checkpoint::checkpoint_layout_name(loaded.layout)).c_str(),
                  loaded.world_size, loaded.stage.c_str());
  }
  // --stop-after ends this run early, as a preempted job would; the schedule still spans the
  // whole run, so a resumed run continues it exactly.
  const std::int64_t run_end =
      s.stop_after > 0 ? std::min(total_steps, step + s.stop_after) : total_steps;
  const std::int64_t run_begin = step;
  std::int64_t checkpoint_bus_bytes = 0;
  // --async-checkpoint: a save blocks for a copy of this rank's state; the files are written
  // while the next steps run (checkpoint/async_checkpoint.hpp).
  std::optional<sk::checkpoint::AsyncCheckpointer> saver;
  if (s.async_checkpoint && !s.checkpoint_dir.empty()) saver.emplace(s.checkpoint_dir);
  // --graph: two warm-up steps, then the step captured once and replayed (core/step_graph.hpp).
  std::optional<sk::StepGraph> graph;
  if (s.graph) graph.emplace(ctx, "custom_loop's training step");
  comm.reset_stats();
  if (mesh) mesh->shard().reset_stats();
  if (mesh && mesh->replicate() != nullptr) mesh->replicate()->reset_stats();
  // The peaks reported are the training steps' -- what the memory plan bounds -- not the set-up's
  // (the initial parameters' f32 broadcast, a resumed checkpoint's reads).
  ctx.memory_stats().reset_peak();
  for (std::int64_t epoch = step / steps_per_epoch; step < run_end; ++epoch) {
    sampler.set_epoch(epoch);
    const std::int64_t first_batch = step % steps_per_epoch;  // > 0 only when resuming mid-epoch
    sampler.set_start_iter(first_batch);
    const auto indices = sampler.indices();
    for (std::int64_t b = first_batch; b < steps_per_epoch && step < run_end; ++b, ++step) {
      batch_images(*s.train, indices, static_cast<std::size_t>((b - first_batch) * s.batch),
                   static_cast<std::size_t>(s.batch), batch);
      mlp.stage(batch);  // the step reads fixed inputs: staged before it, outside it
      // Cosine decay over the run, set before the step (a captured step reads it on the device).
      const float progress = static_cast<float>(step) / static_cast<float>(total_steps);
      engine->set_lr(s.lr * 0.5f * (1.0f + std::cos(3.14159265f * progress)));
      const auto train_step = [&] {
        engine->zero_grad();
        mlp.forward(params);
        const double scale =
            scaled ? scaler.scale() : 1.0;  // (a host read: the MLP scales on the host)
        mlp.backward(
            params, [&](std::size_t i) { return gradients.grad(i); },
            [&](std::size_t i) { gradients.ready(i, scale); });
        engine->finish();
        if (scaled)
          engine->step(scaler);  // an overflowing step is skipped on every rank
        else
          engine->step();
      };
      if (graph)
        graph->run("batch " + std::to_string(s.batch), train_step);
      else
        train_step();
      // Reading the loss waits for the GPU: only when it is printed.
      if (rank == 0 && (step % 100 == 0 || step + 1 == total_steps))
        std::printf("step %5lld/%lld  epoch %lld  loss %.4f\n", static_cast<long long>(step),
                    static_cast<long long>(total_steps), static_cast<long long>(epoch), mlp.loss());
      const bool periodic = s.checkpoint_every > 0 && (step + 1) % s.checkpoint_every == 0;
      if (!s.checkpoint_dir.empty() && (periodic || step + 1 == run_end)) {
        const auto before = bus_bytes_moved();  // not counted as training traffic
        sk::checkpoint::CheckpointOptions options;
        options.layout = s.checkpoint_layout;
        options.metadata["custom_loop.step"] = std::to_string(step + 1);
        options.metadata["custom_loop.steps_per_epoch"] = std::to_string(steps_per_epoch);
        options.metadata["custom_loop.images_per_step"] = std::to_string(images_per_step);
        auto state = training_state();
        // A step folder behind an atomic `latest`: a kill at any moment leaves a complete one.
        std::string folder;
        if (saver) {
          folder = saver->save(step + 1, state, options) + ", in the background";
        } else {
          folder = sk::checkpoint::save_step_checkpoint(s.checkpoint_dir, step + 1, state, options);
        }
        if (rank == 0)
          std::printf(
              "checkpoint: step %lld saved to %s (%s)\n", static_cast<long long>(step + 1),
              folder.c_str(),
              std::string(sk::checkpoint::checkpoint_layout_name(s.checkpoint_layout)).c_str());
        checkpoint_bus_bytes += bus_bytes_moved() - before;
      }
    }
  }
  if (saver) {  // the last save written and published on every rank before the run ends
    const auto before = bus_bytes_moved();
    saver->finish();
    checkpoint_bus_bytes += bus_bytes_moved() - before;
  }
  if (graph && rank == 0)
    std::printf(
        "step graph: %lld warm-up steps, %lld captured, %lld replayed; %.2f MB kept for it\n",
        static_cast<long long>(graph->stats().eager),
        static_cast<long long>(graph->stats().captures),
        static_cast<long long>(graph->stats().replays), graph->reserved_bytes() / 1e6);
  const double loss = step > run_begin ? mlp.loss() : 0.0;  // of the last step
  const double bus_bytes = static_cast<double>(bus_bytes_moved() - checkpoint_bus_bytes) /
                           static_cast<double>(std::max<std::int64_t>(1, run_end - run_begin));
  const sk::MemorySnapshot memory = ctx.memory_stats().snapshot();  // before gathering for the test
  const sk::MemorySnapshot host_memory = engine->host_context().memory_stats().snapshot();
  // Rank 0 evaluates with every parameter whole (gathered on every rank under fsdp), and takes
  // a fingerprint of the final parameters (FNV-1a of their bytes in parameter order).
  double accuracy = 0;
  std::uint64_t fingerprint = 0;
  with_full_params(ctx, *engine, [&](auto whole) {
    if (rank != 0) return;
    const auto& test = *s.test;
    std::int64_t correct = 0;
    std::vector<std::int64_t> all(static_cast<std::size_t>(test.count));
    for (std::int64_t i = 0; i < test.count; ++i) all[static_cast<std::size_t>(i)] = i;
    for (std::int64_t first = 0; first < test.count; first += 500) {
      const auto count = static_cast<std::size_t>(std::min<std::int64_t>(500, test.count - first));
      batch_images(test, all, static_cast<std::size_t>(first), count, batch);
      mlp.forward(whole, batch);
      correct += mlp.correct();
    }
    accuracy = static_cast<double>(correct) / static_cast<double>(test.count);
    std::vector<float> values;
    for (std::size_t i = 0; i < 2 * (s.widths.size() - 1); ++i) {
      const auto v = sk::to_vector<float>(ctx, whole.param(i));
      values.insert(values.end(), v.begin(), v.end());
    }
    fingerprint = fnv1a(values);
  });
  std::lock_guard lock(results_mutex);
  // Under a launcher this process only knows its own rank: it reports that one (rank 0 prints).
  const auto slot = static_cast<std::size_t>(results.backend != "local" ? 0 : rank);
  if (results.ranks.size() <= slot) results.ranks.resize(slot + 1);
  results.ranks[slot] = RankReport{memory, host_memory, bus_bytes, loss};
  results.world = comm.size();
  if (rank == 0) results.test_accuracy = accuracy, results.steps = step;
  if (rank == 0) results.params_fnv1a = fingerprint;
}

// What every rank runs: the stage picks the engine.
template <class Device>
void train_rank(const Setup& s, sk::Context& ctx, sk::comm::Communicator& comm, Results& results,
                std::mutex& results_mutex) {
  if (s.parallel.stage == sk::parallel::Stage::fsdp)
    train_rank_with<Device, sk::parallel::FsdpEngine>(s, ctx, comm, results, results_mutex);
  else
    train_rank_with<Device, sk::parallel::DataParallel>(s, ctx, comm, results, results_mutex);
}

// The ranks: threads of this process, or this process under mpirun.
template <class Device>
Results train(const Setup& s) {
  Results results;
  std::mutex results_mutex;
  results.device = Device::name;
  const auto launch = sk::comm::detect_launch();
  // A process per rank under mpirun, or under RANK/WORLD_SIZE (NCCL on GPUs; on the CPU
  // make_communicator says to launch with mpirun) -- not its own --ranks threads, which would
  // train each process's world alone into the same checkpoint folder.
  if (launch.kind != sk::comm::LaunchKind::single) {
    results.backend = launch.kind == sk::comm::LaunchKind::mpi ? "mpi" : "env";
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
