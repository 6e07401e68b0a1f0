// The ZeRO stages on a CUDA GPU: ranks are threads sharing the one GPU over the in-process
// communicator over device memory (NCCL refuses two ranks on one GPU), with the fused CUDA
// optimizer kernels (sk::ops::Cuda). OSS and SDP equal DDP to 1e-6 after 20 steps, GPU DDP
// equals CPU DDP to rounding (on the scale of the values), memory per rank follows the stage, and
// the optimizer state consolidates and resumes on the device. FSDP over modules (cuBLAS/cuDNN
// autograd) equals DDP to 1e-6 and the CPU's FSDP to rounding, and its sharded checkpoint loads on
// the CPU. CPU offload (the step on the host, pinned memory; or files, offload to NVMe) equals the
// device's own step to rounding. SyncBatchNorm over ranks sharing the GPU equals the CPU's
// batch-norm over the group's concatenated batch.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/shardkit.hpp"
#include "sync_bn_test_support.hpp"

namespace sk = shardkit;
using namespace dp_test;

namespace {

RunResult train_gpu(int world, Stage stage, OptimizerKind kind, PartitionKind partition,
                    int steps = 20) {
  return train(world, stage, kind, partition, steps, 2048, sk::comm::cuda_run_options(0));
}

}  // namespace

TEST_CASE("on the GPU, OSS and SDP equal DDP to 1e-6 after 20 steps, every world size") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    for (int world : {1, 2, 3, 4, 8}) {
      const auto ddp = train_gpu(world, Stage::ddp, kind, PartitionKind::greedy);
      for (int r = 1; r < world; ++r)
        REQUIRE(bitwise_equal(ddp.params[static_cast<std::size_t>(r)], ddp.params[0]));
      for (auto partition : {PartitionKind::greedy, PartitionKind::flat}) {
        for (auto stage : {Stage::oss, Stage::sdp}) {
          const auto sharded = train_gpu(world, stage, kind, partition);
          for (int r = 0; r < world; ++r)
            CHECK_MESSAGE(max_relative_difference(sharded.params[static_cast<std::size_t>(r)],
                                                  ddp.params[0]) <= 1e-6,
                          sk::optim::optimizer_kind_name(kind), " ",
                          sk::parallel::stage_name(stage), " ",
                          sk::shard::partition_kind_name(partition), " world ", world, " rank ", r);
        }
      }
    }
  }
}

TEST_CASE("GPU DDP equals CPU DDP to rounding (fused CUDA kernels vs the CPU loop)") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    const auto gpu = train_gpu(3, Stage::sdp, kind, PartitionKind::greedy);
    const auto cpu = train(3, Stage::sdp, kind, PartitionKind::greedy);
    // 20 steps of f32 updates whose FMA contraction differs between nvcc and g++: rounding at
    // the scale of the values (elementwise, 7e-5 of a parameter that had come near 0 on an H100).
    CHECK_MESSAGE(max_scaled_difference(gpu.params[0], cpu.params[0]) <= 1e-5,
                  sk::optim::optimizer_kind_name(kind));
    CHECK(gpu.params[0] != std::vector<float>(gpu.params[0].size(), 0.0f));
  }
}

TEST_CASE("device memory per rank follows the stage") {
  const int world = 4;
  const sk::shard::ShardPlan plan(model_specs(), world, PartitionKind::greedy);
  const auto ddp = train_gpu(world, Stage::ddp, OptimizerKind::adamw, PartitionKind::greedy, 2);
  const auto sdp = train_gpu(world, Stage::sdp, OptimizerKind::adamw, PartitionKind::greedy, 2);
  using C = sk::MemoryCategory;
  for (int r = 0; r < world; ++r) {
    const auto R = static_cast<std::size_t>(r);
    const auto owned = plan.numel(r) * 4;
    CHECK(ddp.memory[R].current_of(C::gradients) == plan.trainable_end() * 4);
    CHECK(ddp.memory[R].current_of(C::optimizer_state) == 2 * plan.trainable_end() * 4);
    CHECK(sdp.memory[R].current_of(C::gradients) == owned);
    CHECK(sdp.memory[R].current_of(C::optimizer_state) == 2 * owned);
  }
}

TEST_CASE("on the GPU, the consolidated state equals DDP's and a resumed SDP job continues") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    const auto gpu = sk::comm::cuda_run_options(0);
    const auto ddp = run({3, Stage::ddp}, kind, 0, 5, nullptr, 0, gpu).state;
    const auto oss_checkpoint = run({3, Stage::oss}, kind, 0, 5, nullptr, 0, gpu);
    const auto& oss = oss_checkpoint.state;
    REQUIRE(ddp.params.size() == oss.params.size());
    for (std::size_t i = 0; i < ddp.params.size(); ++i) {
      REQUIRE(oss.params[i].buffers.size() == ddp.params[i].buffers.size());
      for (const auto& [name, values] : ddp.params[i].buffers)
        CHECK(max_relative_difference(oss.params[i].buffer(name), values) <= 1e-6);
    }
    // Loading moves the state onto the device and carries the step count.
    const auto resumed = run({3, Stage::sdp}, kind, 5, 1, &oss_checkpoint, 0, gpu).state;
    CHECK(resumed.steps == 6);
  }
}

namespace {

// A module trained under `stage` on the device of `options` (CPU when default), N ranks:
// rank 0's parameters and buffers afterwards. `save_to` / `load_from`: a sharded checkpoint.
// Adam divides each gradient by its own running magnitude, so an element whose gradient is a
// near-cancellation moves by about the learning rate in a direction that rounding picks: two
// runs whose arithmetic differs (GPU and CPU, device and host step) part by O(1) within ten
// steps. Measured on the CPU: a 1-ulp change of the learning rate moves the MLP's AdamW
// parameters by 1.7e-2 of their scale after 10 steps with eps = 1e-8, by 3e-7 with eps = 1e-3.
// Comparisons across arithmetic use the larger eps, where Adam is well-conditioned.
sk::optim::OptimizerConfig cross_arithmetic_config(OptimizerKind kind) {
  auto c = config_for(kind);
  c.adam.eps = 1e-3f;
  return c;
}

// The MLP's wrap: small buckets, under fsdp two units.
sk::parallel::ParallelOptions mlp_options(Stage stage, sk::parallel::OffloadOptions offload,
                                          bool quantized = false) {
  sk::parallel::ParallelOptions o;
  o.stage = stage;
  o.buckets.bucket_bytes = 4096;
  o.fsdp.wrap.unit_paths = {"0", "3"};
  o.offload = offload;
  o.fsdp.quantized_weights = quantized;  // qwZ and qgZ
  o.fsdp.quantized_grads = quantized;
  return o;
}

// The module's parameters and buffers (fsdp: gathered for the read).
std::vector<float> trained_values(sk::Context& ctx, sk::parallel::ShardedModule& model,
                                  const module_test::nn::Module& net) {
  if (model.engine().stage() != Stage::fsdp) return module_test::module_values(ctx, net);
  auto full = model.full_params();
  return module_test::module_values(ctx, net);
}

std::vector<float> train_module(int world, Stage stage, const sk::optim::OptimizerConfig& config,
                                int steps, sk::comm::RunRanksOptions options = {},
                                const std::string& save_to = {}, const std::string& load_from = {},
                                sk::parallel::OffloadOptions offload = {},
                                sk::MemorySnapshot* device_memory = nullptr,
                                sk::MemorySnapshot* host_memory = nullptr, bool quantized = false) {
  std::vector<float> out;
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        auto net = module_test::mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
        sk::parallel::ShardedModule model(ctx, comm, net, config,
                                          mlp_options(stage, offload, quantized));
        if (!load_from.empty())
          (void)sk::checkpoint::load_checkpoint(load_from, model.training_state());
        for (int s = 0; s < steps; ++s) {
          model.zero_grad();
          auto b = module_test::batch(ctx, {6, 12}, 7, comm.rank(), s);
          sk::autograd::backward(ctx, sk::autograd::cross_entropy(ctx, model(ctx, b.x), b.labels));
          model.step(lr_at(config.kind, s));
        }
        if (comm.rank() == 0 && device_memory != nullptr)
          *device_memory = ctx.memory_stats().snapshot();
        if (comm.rank() == 0 && host_memory != nullptr)
          *host_memory = model.training_state().optimizer->host_context().memory_stats().snapshot();
        if (!save_to.empty()) {
          sk::checkpoint::CheckpointOptions c;
          c.layout = sk::checkpoint::CheckpointLayout::sharded;
          sk::checkpoint::save_checkpoint(save_to, model.training_state(), c);
        }
        std::vector<float> values = trained_values(ctx, model, *net);
        if (comm.rank() == 0) out = std::move(values);
      },
      options);
  return out;
}

}  // namespace

TEST_CASE("on the GPU, FSDP over a module equals DDP and the CPU's FSDP") {
  const auto gpu = sk::comm::cuda_run_options(0);
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    for (int world : {1, 2, 3}) {
      const auto ddp = train_module(world, Stage::ddp, config_for(kind), 10, gpu);
      const auto fsdp = train_module(world, Stage::fsdp, config_for(kind), 10, gpu);
      CHECK_MESSAGE(max_relative_difference(fsdp, ddp) <= 1e-6,
                    sk::optim::optimizer_kind_name(kind), " world ", world);
      MESSAGE(sk::optim::optimizer_kind_name(kind), " world ", world, ": FSDP and DDP ",
              bitwise_equal(fsdp, ddp) ? "bitwise equal" : "equal to rounding");
    }
    // cuBLAS/cuDNN against oneDNN/Eigen, fused kernels against the CPU functors: rounding.
    const auto cpu = train_module(2, Stage::fsdp, cross_arithmetic_config(kind), 10);
    const auto on_gpu = train_module(2, Stage::fsdp, cross_arithmetic_config(kind), 10, gpu);
    CHECK_MESSAGE(max_scaled_difference(on_gpu, cpu) <= 1e-5, sk::optim::optimizer_kind_name(kind));
  }
}

// qwZ + qgZ on the device: the int8 kernels and the local world's all-to-all over device
// memory. Training follows exact FSDP on the GPU as closely as on the CPU (tests/parallel/
// test_fsdp.cpp), and the GPU's quantised run follows the CPU's: the format gives the same bits
// on both, the model's arithmetic differs by rounding (which may move a value to the next
// quantisation step, hence the same tolerance).
TEST_CASE("on the GPU, FSDP with int8 gathers and gradients follows exact FSDP and the CPU's") {
  const auto gpu = sk::comm::cuda_run_options(0);
  const auto config = config_for(OptimizerKind::sgd);
  for (int world : {2, 3}) {
    const auto exact = train_module(world, Stage::fsdp, config, 10, gpu);
    const auto quantized =
        train_module(world, Stage::fsdp, config, 10, gpu, {}, {}, {}, nullptr, nullptr, true);
    const auto on_cpu =
        train_module(world, Stage::fsdp, config, 10, {}, {}, {}, {}, nullptr, nullptr, true);
    REQUIRE(quantized.size() == exact.size());
    double largest = 0, worst = 0, apart = 0;
    for (std::size_t i = 0; i < exact.size(); ++i) {
      largest = std::max(largest, std::fabs(double(exact[i])));
      worst = std::max(worst, std::fabs(double(quantized[i]) - exact[i]));
      apart = std::max(apart, std::fabs(double(quantized[i]) - on_cpu[i]));
    }
    CAPTURE(world);
    CHECK(worst > 0);
    CHECK(worst <= 0.02 * largest);
    CHECK(apart <= 0.02 * largest);
  }
}

TEST_CASE("a sharded checkpoint written by FSDP on the GPU loads under DDP on the CPU, exactly") {
  const auto dir = std::filesystem::temp_directory_path() / "shardkit_gpu_checkpoint";
  std::filesystem::remove_all(dir);
  const auto saved = train_module(3, Stage::fsdp, config_for(OptimizerKind::adamw), 4,
                                  sk::comm::cuda_run_options(0), dir.string());
  const auto loaded =
      train_module(2, Stage::ddp, config_for(OptimizerKind::adamw), 0, {}, {}, dir.string());
  CHECK(bitwise_equal(loaded, saved));
  std::filesystem::remove_all(dir);
}

TEST_CASE("on the GPU, CPU offload equals the device's own step to rounding, with no state on it") {
  const auto gpu = sk::comm::cuda_run_options(0);
  using C = sk::MemoryCategory;
  // (offload to NVMe: its files, unnamed, in a directory of the run's own)
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_gpu_nvme_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct RemoveDir {
    std::filesystem::path dir;
    ~RemoveDir() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove_dir{dir};
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    for (auto stage : {Stage::sdp, Stage::fsdp}) {
      const auto config = cross_arithmetic_config(kind);
      const auto plain = train_module(2, stage, config, 10, gpu);
      // The optimizer offloaded; fsdp's shards too; fsdp's shards, master and state in files.
      for (int place = 0; place < 3; ++place) {
        const bool params = place > 0, on_disk = place == 2;
        if (params && stage != Stage::fsdp) continue;
        sk::MemorySnapshot device, host;
        sk::parallel::OffloadOptions offload{.optimizer = true, .params = params};
        if (on_disk) offload.nvme_path = dir.string();
        const auto offloaded =
            train_module(2, stage, config, 10, gpu, {}, {}, offload, &device, &host);
        // The step ran on the host (CPU functors, pinned memory) instead of the fused kernels:
        // rounding, fed back through ten forward passes.
        CHECK_MESSAGE(max_scaled_difference(offloaded, plain) <= 1e-5,
                      sk::optim::optimizer_kind_name(kind), " ", sk::parallel::stage_name(stage),
                      " params ", params, " on disk ", on_disk);
        CHECK(device.current_of(C::optimizer_state) == 0);
        CHECK((host.current_of(C::optimizer_state) > 0) == !on_disk);
        // (the reduced gradients kept on the host, brought down during the backward)
        CHECK(device.current_of(C::gradients) == 0);
        CHECK(host.current_of(C::gradients) > 0);
        if (params) CHECK((host.current_of(C::parameters) > 0) == !on_disk);
      }
    }
  }
}

// Under sdp and fsdp an offloaded optimizer's gradients are kept in pinned host memory, brought
// down bucket by bucket in the backward: the loss scaler's finite check and clipping's leaf sums
// run on the host over them (their results going up to the device), with one rank -- nothing
// exchanged -- and with two.
TEST_CASE("on the GPU, gradients kept on the host serve loss scaling and clipping") {
  const auto gpu = sk::comm::cuda_run_options(0);
  const auto config = cross_arithmetic_config(OptimizerKind::adamw);
  struct Outcome {
    std::vector<float> values;
    std::vector<double> norms;
  };
  for (auto stage : {Stage::sdp, Stage::fsdp})
    for (int world : {1, 2}) {
      const auto run = [&](bool offload) {
        Outcome out;
        sk::comm::run_ranks(
            world,
            [&](sk::Context& ctx, sk::comm::Communicator& comm) {
              auto net = module_test::mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
              sk::parallel::ShardedModule model(ctx, comm, net, config,
                                                mlp_options(stage, {.optimizer = offload}));
              sk::optim::DynamicLossScaler scaler({.init_scale = 1024});
              for (int s = 0; s < 6; ++s) {
                model.zero_grad();
                auto b = module_test::batch(ctx, {6, 12}, 7, comm.rank(), s);
                auto loss = sk::autograd::cross_entropy(ctx, model(ctx, b.x), b.labels);
                const auto scale = static_cast<float>(scaler.scale());
                sk::autograd::backward(ctx, loss, scaler.seed(ctx, loss.data()));
                const sk::Tensor norm = model.clip_grad_norm(0.5, 1.0f / scale);
                if (comm.rank() == 0) out.norms.push_back(sk::to_vector<double>(ctx, norm)[0]);
                model.step(lr_at(config.kind, s), scaler);
              }
              std::vector<float> values = trained_values(ctx, model, *net);
              if (comm.rank() == 0) out.values = std::move(values);
            },
            gpu);
        return out;
      };
      const Outcome plain = run(false), offloaded = run(true);
      const auto what =
          std::string(sk::parallel::stage_name(stage)) + " world " + std::to_string(world);
      CHECK_MESSAGE(max_scaled_difference(offloaded.values, plain.values) <= 1e-5, what);
      REQUIRE(offloaded.norms.size() == plain.norms.size());
      for (std::size_t s = 0; s < plain.norms.size(); ++s)
        CHECK_MESSAGE(std::abs(offloaded.norms[s] - plain.norms[s]) <= 1e-6 * plain.norms[s], what,
                      " step ", s);
    }
}

TEST_CASE("on the GPU, SyncBatchNorm equals the CPU's batch-norm over the group's whole batch") {
  using sync_bn_test::check_against_concatenation;
  const auto gpu = sk::comm::cuda_run_options(0);
  for (int dims : {1, 2}) {
    // f64 runs the synchronised path's own kernels end to end (rank 4 of the second case, alone
    // in its group, runs the same steps for a group of one: the parts folded straight into its
    // statistics, its weight and bias gradients written by the gradient sums' fold): the
    // moments, their folding, the affine map and both gradient passes to 1e-12.
    check_against_concatenation(sk::DType::f64, dims, {3, 5, 2, 4}, 4, 1e-12, gpu);
    check_against_concatenation(sk::DType::f64, dims, {2, 3, 4, 2, 5}, 2, 1e-12, gpu);
    check_against_concatenation(sk::DType::f32, dims, {3, 5, 2, 4}, 4, 2e-5, gpu);
    check_against_concatenation(sk::DType::bf16, dims, {4, 6, 2}, 3, 2e-2, gpu);
  }
  // Layers of a real size: more values per channel than a block has threads (the per-channel
  // kernels' loops), and in the 1-d case more channels (300) than one block of the statistics
  // kernel covers.
  const sync_bn_test::BnGeometry wide{64, 8, 8};
  check_against_concatenation(sk::DType::f64, 2, {16, 12}, 2, 1e-12, gpu, wide);
  check_against_concatenation(sk::DType::f32, 2, {16, 12}, 2, 2e-5, gpu, wide);
  check_against_concatenation(sk::DType::f16, 2, {16, 12}, 2, 1e-2, gpu, wide);
  check_against_concatenation(sk::DType::f32, 1, {300, 260}, 2, 2e-5, gpu, {300, 1, 1});
}

TEST_CASE("on the GPU, SyncBatchNorm with a fused ReLU equals it then ReLU, bit for bit") {
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64})
    sync_bn_test::check_fused_relu(dtype, sk::comm::cuda_run_options(0));
}

// What the host waits for in a training step on the GPU (Context::host_waits: reads, uploads,
// stream synchronisations, collective waits), two ranks sharing it over the local communicator:
// none for a plain, a loss-scaled or a LARC step under every stage -- the CPU ledger's claim
// (test_sharded_module.cpp) where each wait would stall the GPU's queue. The loss is a fixed
// projection of the output to one value (the CUDA cross-entropy still reads its label check
// back at every forward, docs/design.md).
TEST_CASE("on the GPU, a training step makes no host wait: plain, loss-scaled, LARC, every stage") {
  namespace ag = sk::autograd;
  const auto gpu = sk::comm::cuda_run_options(0);
  constexpr int kWarmup = 2, kMeasured = 3;
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
      for (bool scaled : {false, true}) {
        sk::comm::run_ranks(
            2,
            [&](sk::Context& ctx, sk::comm::Communicator& comm) {
              auto net = module_test::mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
              sk::parallel::ParallelOptions options;
              options.stage = stage;
              options.buckets.bucket_bytes = 4096;
              sk::parallel::ShardedModule model(ctx, comm, net, config_for(kind), options);
              sk::optim::DynamicLossScaler scaler;
              std::vector<module_test::Batch> batches;
              for (int s = 0; s < kWarmup + kMeasured; ++s)
                batches.push_back(module_test::batch(ctx, {6, 12}, 7, comm.rank(), s));
              const ag::Variable project(sk::full(ctx, {7, 1}, sk::DType::f32, 0.25));
              const ag::Variable mean(sk::full(ctx, {1, 6}, sk::DType::f32, 1.0 / 6.0));
              sk::HostWaits before;
              for (int s = 0; s < kWarmup + kMeasured; ++s) {
                if (s == kWarmup) before = ctx.host_waits();
                model.zero_grad();
                const auto& b = batches[static_cast<std::size_t>(s)];
                auto loss = ag::matmul(ctx, mean, ag::matmul(ctx, model(ctx, b.x), project));
                const float lr = 0.05f * (1.0f - 0.05f * static_cast<float>(s));
                if (scaled) {
                  ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
                  model.step(lr, scaler);
                } else {
                  ag::backward(ctx, loss);
                  model.step(lr);
                }
              }
              const auto got = ctx.host_waits() - before;
              CHECK_MESSAGE(got.total() == 0, sk::optim::optimizer_kind_name(kind), " ",
                            sk::parallel::stage_name(stage), scaled ? " loss-scaled" : "", " rank ",
                            comm.rank(), ": ", got.reads, " reads, ", got.uploads, " uploads, ",
                            got.synchronizations, " synchronisations, ", got.collective_waits,
                            " collective waits in ", kMeasured, " steps");
            },
            gpu);
      }
    }
  }
}

// A ResNet-18 (8 channels wide, 8x8 inputs) trained through a StepGraph on the GPU -- two
// warm-up steps, one capture, CUDA graph launches after -- ends with the parameters and buffers
// of the same steps run eagerly, bit for bit: every stage, one rank and two sharing the GPU
// (their captured collectives meet on the device, comm/device_rendezvous.hpp), f32 and bf16
// compute, AdamW and LARC-SGD, plain and loss-scaled with an overflow at a replayed step (an
// inf in the input), a cosine-like rate set before each run (read from the step gate on the
// device).
namespace {

// The bytes of a module's whole state, in order: what "bit for bit" compares.
std::vector<unsigned char> state_bytes(sk::parallel::ShardedModule& model) {
  std::vector<unsigned char> bytes;
  for (const auto& [name, t] : model.state_dict(false)) {
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    bytes.insert(bytes.end(), p, p + t.nbytes());
  }
  return bytes;
}

// One run of the comparison: `world` ranks sharing the GPU, eager then through a StepGraph.
// With `sync_bn` every batch-norm synchronises over the whole world (its statistics exchanged
// by all-gather and all-reduce on a communicator split from the world's, inside the capture).
void check_captured_resnet(int world, OptimizerKind kind, Stage stage, sk::DType compute,
                           bool scaled, bool sync_bn) {
  namespace ag = sk::autograd;
  sk::comm::CommOptions comm_options;
  comm_options.timeout = std::chrono::seconds(10);  // a device wait that never ends: fail, fast
  const auto gpu = sk::comm::cuda_run_options(0, comm_options);
  constexpr int kSteps = 6;
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        std::vector<std::vector<unsigned char>> finals;
        std::vector<sk::StepGraphStats> stats;
        for (bool graphed : {false, true}) {
          auto net = module_test::small_resnet(ctx, 5);
          if (sync_bn) {
            // (outside CHECK, which would swallow a failed split: this rank would then go on
            // without SyncBatchNorm and the other time out at the first exchange)
            const auto converted = sk::parallel::convert_sync_batch_norm(
                *net, sk::parallel::sync_batch_norm_group(comm, world));
            CHECK(converted > 0);
          }
          sk::parallel::ParallelOptions options;
          options.stage = stage;
          options.buckets.bucket_bytes = 1 << 16;
          if (compute != sk::DType::f32)
            options.precision = sk::parallel::MixedPrecision::of(compute);
          sk::parallel::ShardedModule model(ctx, comm, net, config_for(kind), options);
          sk::optim::DynamicLossScaler scaler;
          const auto x = sk::empty(ctx, {4, 3, 8, 8}, sk::DType::f32);
          const auto labels = sk::empty(ctx, {4}, sk::DType::i64);
          float lr = 0;
          const auto step = [&] {
            model.zero_grad();
            auto loss = ag::cross_entropy(ctx, model(ctx, ag::Variable(x)), labels);
            if (scaled) {
              ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
              graphed ? model.step(scaler) : model.step(lr, scaler);
            } else {
              ag::backward(ctx, loss);
              graphed ? model.step() : model.step(lr);
            }
          };
          sk::StepGraph graph(ctx, "resnet18");
          for (int s = 0; s < kSteps; ++s) {
            const auto b = module_test::batch(ctx, {4, 3, 8, 8}, 5, comm.rank(), s);
            sk::copy(ctx, x, b.x.data());
            sk::copy(ctx, labels, b.labels);
            if (scaled && s == 4)
              sk::fill(ctx, x.slice(0, 1, 2), std::numeric_limits<double>::infinity());
            lr = 0.05f * (1.0f - 0.1f * static_cast<float>(s));
            if (graphed) {
              model.set_lr(lr);
              graph.run("4x3x8x8", step);
            } else {
              step();
            }
          }
          stats.push_back(graph.stats());
          finals.push_back(state_bytes(model));
        }
        CHECK(stats[1].captures == 1);
        CHECK(stats[1].replays == kSteps - 3);
        CHECK_MESSAGE(finals[0] == finals[1], sk::optim::optimizer_kind_name(kind), " ",
                      sk::parallel::stage_name(stage), " ", sk::dtype_name(compute),
                      scaled ? " loss-scaled" : "", sync_bn ? " SyncBatchNorm" : "", ", world ",
                      world, " rank ", comm.rank());
      },
      gpu);
}

}  // namespace

TEST_CASE("on the GPU, a captured ResNet-18 step replays the eager steps bit for bit") {
  for (int world : {1, 2})
    for (auto kind : {OptimizerKind::adamw, OptimizerKind::larc_sgd})
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp})
        for (auto compute : {sk::DType::f32, sk::DType::bf16})
          for (bool scaled : {false, true})
            check_captured_resnet(world, kind, stage, compute, scaled, false);
}

// The header's own pattern: the rate passed to step() inside the step, each rate its key. Two
// keys captured at different rates, then each replayed after the other: every replay steps at
// its own key's rate (the fill of the gate's rate slot was left out of a capture whose rate the
// slot already held, so a replay read whichever rate was written last), equal to the eager
// steps bit for bit.
TEST_CASE("on the GPU, step graphs keyed by learning rate each replay their own rate") {
  namespace ag = sk::autograd;
  const std::vector<float> rates = {0.1f, 0.1f,  0.1f, 0.05f, 0.05f, 0.05f,
                                    0.1f, 0.05f, 0.1f, 0.1f,  0.05f};
  sk::comm::run_ranks(
      1,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        std::vector<std::vector<unsigned char>> finals;
        for (bool graphed : {false, true}) {
          auto net = module_test::small_resnet(ctx, 5);
          sk::parallel::ParallelOptions options;
          options.stage = Stage::sdp;
          sk::parallel::ShardedModule model(ctx, comm, net, config_for(OptimizerKind::sgd),
                                            options);
          const auto x = sk::empty(ctx, {4, 3, 8, 8}, sk::DType::f32);
          const auto labels = sk::empty(ctx, {4}, sk::DType::i64);
          sk::StepGraph graph(ctx, "resnet18 by rate");
          for (std::size_t s = 0; s < rates.size(); ++s) {
            const auto b = module_test::batch(ctx, {4, 3, 8, 8}, 5, 0, static_cast<int>(s));
            sk::copy(ctx, x, b.x.data());
            sk::copy(ctx, labels, b.labels);
            const float lr = rates[s];
            const auto step = [&] {
              model.zero_grad();
              ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, ag::Variable(x)), labels));
              model.step(lr);
            };
            graphed ? (void)graph.run("lr " + std::to_string(lr), step) : step();
          }
          if (graphed) {
            CHECK(graph.stats().captures == 2);
            CHECK(graph.stats().replays == 5);
          }
          finals.push_back(state_bytes(model));
        }
        CHECK(finals[0] == finals[1]);
      },
      sk::comm::cuda_run_options(0));
}

// SyncBatchNorm's exchanges captured with the rest of the step (what the SwAV trainer's
// MACHINE.CUDA_GRAPH: auto still leaves eager until this has run on a GPU).
TEST_CASE("on the GPU, a captured ResNet-18 step with SyncBatchNorm over two ranks replays it") {
  for (auto stage : {Stage::ddp, Stage::fsdp})
    for (auto compute : {sk::DType::f32, sk::DType::bf16})
      check_captured_resnet(2, OptimizerKind::larc_sgd, stage, compute, compute != sk::DType::f32,
                            true);
}

// FSDP2's float8 gathers (E4M3, a scale per tensor) and int8 gradients under capture: the
// tensors' maxima are all-reduced once a step (parallel/tensor_scales.hpp) and a captured
// step computes its own -- here after an evaluation's eager forward just before the capture
// left them fresh, which a graph that did not compute them would replay for ever after.
TEST_CASE("on the GPU, a captured FSDP step with per-tensor E4M3 gathers replays the eager steps") {
  namespace ag = sk::autograd;
  sk::comm::CommOptions comm_options;
  comm_options.timeout = std::chrono::seconds(10);
  const auto gpu = sk::comm::cuda_run_options(0, comm_options);
  constexpr int kSteps = 6;
  for (int world : {1, 2}) {
    sk::comm::run_ranks(
        world,
        [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          std::vector<std::vector<unsigned char>> finals;
          for (bool graphed : {false, true}) {
            auto net = module_test::small_resnet(ctx, 5);
            sk::parallel::ParallelOptions options;
            options.stage = Stage::fsdp;
            options.buckets.bucket_bytes = 1 << 16;
            options.fsdp.quantized_weights = true;
            options.fsdp.quantized_weights_format = sk::ops::QuantFormat::f8_e4m3;
            options.fsdp.quantized_weights_scale = sk::ops::QuantScale::tensor;
            options.fsdp.quantized_grads = true;
            sk::parallel::ShardedModule model(ctx, comm, net, config_for(OptimizerKind::adamw),
                                              options);
            const auto x = sk::empty(ctx, {4, 3, 8, 8}, sk::DType::f32);
            const auto labels = sk::empty(ctx, {4}, sk::DType::i64);
            float lr = 0;
            const auto step = [&] {
              model.zero_grad();
              ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, ag::Variable(x)), labels));
              graphed ? model.step() : model.step(lr);
            };
            sk::StepGraph graph(ctx, "resnet18 e4m3");
            for (int s = 0; s < kSteps; ++s) {
              const auto b = module_test::batch(ctx, {4, 3, 8, 8}, 5, comm.rank(), s);
              sk::copy(ctx, x, b.x.data());
              sk::copy(ctx, labels, b.labels);
              if (s == 2) {  // an evaluation between the warm-up steps and the capture
                ag::NoGradGuard no_grad(ctx);
                (void)model(ctx, ag::Variable(x));
              }
              lr = 0.01f * (1.0f - 0.1f * static_cast<float>(s));
              if (graphed) {
                model.set_lr(lr);
                graph.run("4x3x8x8", step);
              } else {
                step();
              }
            }
            CHECK(graph.stats().captures == (graphed ? 1 : 0));
            finals.push_back(state_bytes(model));
          }
          CHECK_MESSAGE(finals[0] == finals[1], "world ", world, " rank ", comm.rank());
        },
        gpu);
  }
}

// Deferred parameters on the device (core/deferred_init.hpp): each rank's shards made from rank
// 0's recipes are the eager build's values bit for bit, in f32 and in bf16 with the shards
// offloaded, and Philox gives the CPU's eager values too.
TEST_CASE(
    "on the GPU, a deferred ResNet-18 wrapped under fsdp starts and trains as the eager one") {
  auto build = [](sk::Context& ctx, std::uint64_t seed, bool deferred) {
    sk::nn::ResNetOptions o;
    o.num_classes = 5;
    o.small_image_stem = true;
    o.base_channels = 8;
    o.init = sk::nn::ResNetInit::torchvision;
    o.zero_init_residual = true;
    ctx.manual_seed(seed);
    std::optional<sk::DeferredParameters> scope;
    if (deferred) scope.emplace(ctx);
    return sk::nn::resnet18(ctx, o);
  };
  // `offloaded`: bf16 compute with the parameter shards in host memory (each rank makes its
  // shard in f32 staging beside it, on the host, then rounds it there).
  auto run = [&](bool deferred, bool offloaded) {
    std::vector<std::vector<float>> states;  // rank 0: after the wrap, after two steps
    sk::comm::run_ranks(
        2,
        [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          auto net = build(ctx, 60 + static_cast<std::uint64_t>(comm.rank()), deferred);
          sk::parallel::ParallelOptions options;
          options.stage = Stage::fsdp;
          if (offloaded) {
            options.precision.param_dtype = sk::DType::bf16;
            options.offload.optimizer = true;
            options.offload.params = true;
          }
          for (int layer = 1; layer <= 4; ++layer)
            options.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer));
          sk::parallel::ShardedModule model(ctx, comm, net, config_for(OptimizerKind::sgd),
                                            options);
          for (int s = 0; s <= 2; ++s) {
            if (s > 0) {
              model.zero_grad();
              auto b = module_test::batch(ctx, {4, 3, 8, 8}, 5, comm.rank(), s);
              sk::autograd::backward(ctx,
                                     sk::autograd::cross_entropy(ctx, model(ctx, b.x), b.labels));
              model.step(0.05f);
            }
            if (s == 1) continue;
            auto full = model.full_params();  // (collective)
            auto values = module_test::module_values(ctx, *net);
            if (comm.rank() == 0) states.push_back(std::move(values));
          }
        },
        sk::comm::cuda_run_options(0));
    return states;
  };
  for (const bool offloaded : {false, true}) {
    CAPTURE(offloaded);
    const auto eager = run(false, offloaded), deferred = run(true, offloaded);
    REQUIRE(eager.size() == 2);
    REQUIRE(deferred.size() == 2);
    CHECK(bitwise_equal(deferred[0], eager[0]));
    CHECK(bitwise_equal(deferred[1], eager[1]));
    if (offloaded) continue;
    sk::Context cpu;
    CHECK(bitwise_equal(module_test::module_values(cpu, *build(cpu, 60, false)), eager[0]));
  }
}
