// Optimizer-state consolidation (FairScale's OSS.consolidate_state_dict) and re-sharding: the
// state gathered on one rank equals DDP's full state, and a job resumed from it -- with another
// stage, partition or world size -- continues exactly as if it had never stopped.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "shardkit/checkpoint/optimizer_state_file.hpp"
#include "shardkit/ops/cpu_backend.hpp"

namespace sk = shardkit;
using namespace dp_test;
using sk::optim::OptimizerState;

TEST_CASE("the state consolidated on one rank equals DDP's full optimizer state") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    for (int world : {1, 3, 4}) {
      const auto ddp = run({world, Stage::ddp, PartitionKind::greedy}, kind, 0, 10, nullptr);
      REQUIRE(ddp.state.steps == 10);
      REQUIRE(ddp.state.params.size() == 8);  // the trainable ones, registration order
      CHECK(ddp.state.params[0].name == "embed.weight");
      CHECK(ddp.state.params[3].name == "block.1.weight");  // frozen.scale has no state
      const bool adam = kind == OptimizerKind::adamw;
      CHECK(ddp.state.params[0].buffer(adam ? "exp_avg" : "momentum_buffer").size() == 37u * 11u);
      CHECK(ddp.state.params[0].buffer("exp_avg_sq").empty() == !adam);
      for (auto partition : {PartitionKind::greedy, PartitionKind::flat}) {
        for (auto stage : {Stage::oss, Stage::sdp}) {
          const int recipient = world - 1;
          const auto sharded = run({world, stage, partition}, kind, 0, 10, nullptr, recipient);
          CHECK_MESSAGE(states_equal(sharded.state, ddp.state, 0),
                        sk::optim::optimizer_kind_name(kind), " ", sk::parallel::stage_name(stage),
                        " ", sk::shard::partition_kind_name(partition), " world ", world);
        }
      }
    }
  }
}

TEST_CASE("a job resumed from a consolidated state continues as if it had never stopped") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    CAPTURE(sk::optim::optimizer_kind_name(kind));
    // Uninterrupted: 20 steps of OSS on 3 ranks.
    const Job oss3{3, Stage::oss, PartitionKind::greedy};
    const auto whole = run(oss3, kind, 0, 20, nullptr);
    // Interrupted after 10; resumed as SDP on 3 ranks with the other partition.
    const auto half = run(oss3, kind, 0, 10, nullptr);
    const auto resumed = run({3, Stage::sdp, PartitionKind::flat}, kind, 10, 10, &half);
    CHECK(bitwise_equal(resumed.params, whole.params));
    CHECK(states_equal(resumed.state, whole.state, 0));
    // World size changes (3 -> 2, 3 -> 4): every stage resumes to DDP's result on that world.
    for (int world : {2, 4}) {
      const auto ddp = run({world, Stage::ddp, PartitionKind::greedy}, kind, 10, 5, &half);
      for (auto stage : {Stage::oss, Stage::sdp}) {
        const auto got = run({world, stage, PartitionKind::greedy}, kind, 10, 5, &half);
        CHECK_MESSAGE(bitwise_equal(got.params, ddp.params), sk::parallel::stage_name(stage),
                      " world ", world);
        CHECK(states_equal(got.state, ddp.state, 0));
      }
    }
  }
}

TEST_CASE("without the state, a resumed Adam or momentum run differs (the test can fail)") {
  const Job oss3{3, Stage::oss, PartitionKind::greedy};
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    const auto whole = run(oss3, kind, 0, 12, nullptr);
    auto half = run(oss3, kind, 0, 10, nullptr);
    half.state.steps = 0;  // as if only the parameters had been saved
    for (auto& p : half.state.params) {
      p.buffers.clear();
    }
    const auto resumed = run(oss3, kind, 10, 2, &half);
    CHECK(max_relative_difference(resumed.params, whole.params) > 1e-4);
  }
}

TEST_CASE("consolidation holds at most one other rank's range at a time") {
  const int world = 4;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ParallelOptions options;
    options.stage = Stage::oss;
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::adamw), options);
    dp.zero_grad();
    fake_backward(dp, ctx, comm.rank(), 0);
    dp.finish();
    dp.step(0.01f);
    ctx.memory_stats().reset_peak();
    (void)dp.consolidate_optimizer_state(0);
    std::int64_t largest_range = 0;
    for (int r = 0; r < world; ++r) largest_range = std::max(largest_range, dp.plan().numel(r));
    const auto peak = ctx.memory_stats().snapshot().peak_of(sk::MemoryCategory::communication);
    CHECK(peak > 0);
    CHECK(peak <= largest_range * 4);
  });
}

TEST_CASE("loading a state that does not fit gets a clear error") {
  const auto saved = run({2, Stage::oss, PartitionKind::greedy}, OptimizerKind::sgd, 0, 2, nullptr);
  const auto sgd = config_for(OptimizerKind::sgd);
  auto expect = [&](const OptimizerState& state, const sk::optim::OptimizerConfig& config,
                    const std::string& part) {
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      sk::parallel::ParallelOptions options;
      options.stage = Stage::sdp;
      DataParallel dp(ctx, comm, model_specs(), config, options);
      try {
        dp.load_optimizer_state(state);
        FAIL("no throw");
      } catch (const sk::InvalidArgument& e) {
        CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
      }
    });
  };
  expect(saved.state, config_for(OptimizerKind::adamw),
         "the state is for sgd but this optimizer is adamw");
  auto missing = saved.state;
  missing.params.erase(missing.params.begin() + 2);
  expect(missing, sgd, "no entry for parameter 'block.0.bias'");
  auto extra = saved.state;
  extra.params.push_back(extra.params.back());
  extra.params.back().name = "ghost";
  expect(extra, sgd, "the state has 9 parameters, this model 8 trainable ones");
  auto reshaped = saved.state;
  reshaped.params[1].shape = {37, 64};
  expect(reshaped, sgd, "'block.0.weight' has shape [64, 37] here but [37, 64]");
  auto short_buffer = saved.state;
  short_buffer.params[4].buffers["momentum_buffer"].pop_back();
  expect(short_buffer, sgd, "'block.1.bias' has 18 momentum_buffer values; expected 19");
  auto no_momentum = sgd;
  no_momentum.sgd.momentum = 0;  // keeps no buffer
  expect(saved.state, no_momentum, "keeps none");
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd));
    CHECK_THROWS_WITH_AS((void)dp.consolidate_optimizer_state(2),
                         doctest::Contains("recipient 2 is not a rank of this 2-rank job"),
                         sk::InvalidArgument);
  });
}

TEST_CASE("the consolidated state survives a safetensors file, and a job resumes from it") {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("shardkit_optimizer_state_" + std::to_string(::getpid()) + ".safetensors"))
                        .string();
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    const Job oss3{3, Stage::oss, PartitionKind::greedy};
    const auto whole = run(oss3, kind, 0, 14, nullptr);
    auto half = run(oss3, kind, 0, 10, nullptr);
    sk::checkpoint::save_optimizer_state(path, half.state);
    const auto loaded = sk::checkpoint::load_optimizer_state(path);
    CHECK(states_equal(loaded, half.state, 0));
    half.state = loaded;
    const auto resumed = run({2, Stage::sdp, PartitionKind::flat}, kind, 10, 4, &half);
    const auto reference = run({2, Stage::ddp, PartitionKind::greedy}, kind, 10, 4, &half);
    CHECK(bitwise_equal(resumed.params, reference.params));
    CHECK(!bitwise_equal(resumed.params, whole.params));  // 2 ranks see other data than 3
  }
  // Stateless parameters (SGD without momentum) keep their names and shapes.
  auto config = config_for(OptimizerKind::sgd);
  config.sgd.momentum = 0;
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config);
    auto state = dp.consolidate_optimizer_state(0);
    if (comm.rank() == 0) sk::checkpoint::save_optimizer_state(path, state);
    comm.barrier();
    const auto loaded = sk::checkpoint::load_optimizer_state(path);
    CHECK(loaded.params.size() == 8);
    CHECK(loaded.params[1].shape == sk::Shape{64, 37});
    CHECK(loaded.params[1].buffers.empty());
    dp.load_optimizer_state(loaded);
  });
  std::filesystem::remove(path);
}
