// DDP, OSS (ZeRO-1) and SDP (ZeRO-2) on a CUDA GPU: ranks are threads sharing the one GPU over
// the in-process communicator over device memory (NCCL refuses two ranks on one GPU), with the
// fused CUDA optimizer kernels (sk::ops::Cuda). OSS and SDP equal DDP to 1e-6 after 20 steps, GPU DDP
// equals CPU DDP to rounding, memory per rank follows the stage, and the optimizer state
// consolidates and resumes on the device.
#include <doctest/doctest.h>

#include <vector>

#include "dp_test_model.hpp"
#include "kernels/shardkit_cuda.cuh"
#include "shardkit/ops/cpu_backend.hpp"

namespace sk = shardkit;
using namespace dp_test;
using Cpu = sk::ops::Cpu;
using Gpu = sk::ops::Cuda;

namespace {

RunResult train_gpu(int world, Stage stage, OptimizerKind kind, PartitionKind partition, int steps = 20) {
  return train<Gpu>(world, stage, kind, partition, steps, 2048, sk::comm::cuda_run_options(0));
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
            CHECK_MESSAGE(max_relative_difference(sharded.params[static_cast<std::size_t>(r)], ddp.params[0]) <= 1e-6,
                          sk::optim::optimizer_kind_name(kind), " ", sk::parallel::stage_name(stage), " ",
                          sk::shard::partition_kind_name(partition), " world ", world, " rank ", r);
        }
      }
    }
  }
}

TEST_CASE("GPU DDP equals CPU DDP to rounding (fused CUDA kernels vs the CPU loop)") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    const auto gpu = train_gpu(3, Stage::sdp, kind, PartitionKind::greedy);
    const auto cpu = train<Cpu>(3, Stage::sdp, kind, PartitionKind::greedy);
    // 20 steps of f32 updates whose FMA contraction may differ between nvcc and g++.
    CHECK_MESSAGE(max_relative_difference(gpu.params[0], cpu.params[0]) <= 1e-5,
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
    const auto ddp = run<Gpu>({3, Stage::ddp}, kind, 0, 5, nullptr, 0, gpu).state;
    const auto oss_checkpoint = run<Gpu>({3, Stage::oss}, kind, 0, 5, nullptr, 0, gpu);
    const auto& oss = oss_checkpoint.state;
    REQUIRE(ddp.params.size() == oss.params.size());
    for (std::size_t i = 0; i < ddp.params.size(); ++i) {
      REQUIRE(oss.params[i].buffers.size() == ddp.params[i].buffers.size());
      for (const auto& [name, values] : ddp.params[i].buffers)
        CHECK(max_relative_difference(oss.params[i].buffer(name), values) <= 1e-6);
    }
    // Loading moves the state onto the device and carries the step count.
    const auto resumed = run<Gpu>({3, Stage::sdp}, kind, 5, 1, &oss_checkpoint, 0, gpu).state;
    CHECK(resumed.steps == 6);
  }
}
