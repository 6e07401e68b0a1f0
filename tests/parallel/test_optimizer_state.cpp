// Optimizer-state consolidation (FairScale's OSS.consolidate_state_dict) and re-sharding: the
// state gathered on one rank equals DDP's full state, and a job resumed from it -- with another
// stage, partition or world size -- continues exactly as if it had never stopped.
#include <doctest/doctest.h>

#include <cmath>
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

// A step refused before it updates anything (here a gradient of the wrong size) moved the step
// count regardless: the next step then took Adam's bias correction of step 2 and SGD's
// momentum as after a first step. The count stays; the step after it is the first.
TEST_CASE("a step refused before it updates anything leaves the step count") {
  sk::Context ctx({.seed = 4});
  auto host = sk::make_host_context(ctx);
  const sk::shard::ShardPlan plan({{"w", {32}, true}}, 1, sk::shard::PartitionKind::flat);
  const auto table = sk::shard::PieceTable::of_plan(plan, true);
  auto random_values = [](std::uint64_t seed) {
    sk::Context c({.seed = seed});
    const sk::Tensor t = sk::empty(c, {32}, sk::DType::f32);
    sk::uniform_(c, t, -1.0, 1.0);
    return sk::to_vector<float>(c, t);
  };
  const auto w0 = random_values(11), g0 = random_values(12);
  for (const bool offload : {false, true}) {
    std::vector<std::vector<float>> after;
    for (const bool refused_first : {false, true}) {
      const sk::Tensor w = sk::from_vector(ctx, w0, {32});
      sk::optim::ShardedOptimizer opt(
          ctx, table, 0, {w}, dp_test::config_for(OptimizerKind::adamw), nullptr,
          offload ? sk::optim::OptimizerOffload{host.get()} : sk::optim::OptimizerOffload{});
      if (refused_first) {
        CHECK_THROWS_AS(opt.step({sk::zeros(ctx, {31}, sk::DType::f32)}, 0.1f), sk::Error);
        CHECK(opt.steps() == 0);
      }
      opt.step({sk::from_vector(ctx, g0, {32})}, 0.1f);
      CHECK(opt.steps() == 1);
      after.push_back(sk::to_vector<float>(ctx, w));
      CHECK(after.back() != w0);
    }
    CAPTURE(offload);
    CHECK(after[0] == after[1]);
  }
}

// What no rule's own validation sees is refused by name when the optimizer is built: kind adam
// with AdamW's flag (it ran AdamW and said "adam" in its checkpoints), LARC with two different
// decays (one was silently dropped), a negative SGD decay under LARC (moved before it was
// checked), the per-step fields (ignored on one path, refused at the first step on another), an
// infinite rate, and a table sharded over ranks without the communicator its norms need.
TEST_CASE("an optimizer's config and norms are refused by name where no rule can see them") {
  sk::Context ctx({.seed = 4});
  const sk::shard::ShardPlan plan({{"w", {32}, true}}, 1, sk::shard::PartitionKind::flat);
  const auto table = sk::shard::PieceTable::of_plan(plan, true);
  auto error_of = [&](const sk::optim::OptimizerConfig& config) -> std::string {
    try {
      sk::optim::ShardedOptimizer opt(ctx, table, 0, {sk::full(ctx, {32}, sk::DType::f32, 0.5)},
                                      config, nullptr);
    } catch (const sk::InvalidArgument& e) {
      return e.what();
    }
    return "no error";
  };
  auto config = [](OptimizerKind kind, auto&& change) {
    auto c = config_for(kind);
    change(c);
    return c;
  };
  using Config = sk::optim::OptimizerConfig;
  const std::vector<std::pair<Config, std::string>> refused = {
      {config(OptimizerKind::adam, [](Config& c) { c.adam.decoupled_weight_decay = true; }),
       "kind adam with adam.decoupled_weight_decay set is AdamW; set kind adamw"},
      {config(OptimizerKind::larc_sgd, [](Config& c) { c.larc.weight_decay = 5e-4f; }),
       "are both set; LARC takes one decay"},
      {config(OptimizerKind::larc_sgd, [](Config& c) { c.sgd.weight_decay = -1e-4f; }),
       "SGD weight_decay must be >= 0"},
      {config(OptimizerKind::larc_sgd, [](Config& c) { c.sgd.inv_grad_scale = 0.5f; }),
       "are the optimizer's own, set at each step"},
      {config(OptimizerKind::sgd, [](Config& c) { c.sgd.first_step = false; }),
       "are the optimizer's own, set at each step"},
      {config(OptimizerKind::adamw, [](Config& c) { c.adam.step = 3; }),
       "are the optimizer's own, set at each step"},
      {config(OptimizerKind::sgd, [](Config& c) { c.sgd.lr = INFINITY; }), "the sgd lr is inf"},
      {config(OptimizerKind::adam, [](Config& c) { c.adam.lr = NAN; }), "the adam lr is nan"},
  };
  for (const auto& [c, says] : refused) {
    const std::string message = error_of(c);
    INFO(message);
    CHECK(message.find(says) != std::string::npos);
  }
  // LARC's own decay alone, or both equal: taken.
  CHECK(error_of(config(OptimizerKind::larc_sgd, [](Config& c) {
          c.larc.weight_decay = c.sgd.weight_decay;
        })) == "no error");
  CHECK(error_of(config(OptimizerKind::larc_sgd, [](Config& c) {
          c.larc.weight_decay = 5e-4f;
          c.sgd.weight_decay = 0;
        })) == "no error");
  // Sharded over two ranks, without a communicator (or with one of another size).
  const sk::shard::ShardPlan halves({{"w", {32}, true}}, 2, sk::shard::PartitionKind::flat);
  const auto sharded = sk::shard::PieceTable::of_plan(halves, false);
  CHECK_THROWS_WITH_AS(sk::optim::ShardedOptimizer(ctx, sharded, 0, {},
                                                   config_for(OptimizerKind::larc_sgd), nullptr),
                       doctest::Contains("a table sharded over 2 ranks needs the communicator"),
                       sk::InvalidArgument);
  sk::comm::run_ranks(3, [&](sk::Context& rank_ctx, sk::comm::Communicator& comm) {
    CHECK_THROWS_WITH_AS(sk::optim::ShardedOptimizer(rank_ctx, sharded, 0, {},
                                                     config_for(OptimizerKind::larc_sgd), &comm),
                         doctest::Contains("with a communicator of 3"), sk::InvalidArgument);
  });
}

// Once a clip (or loss scaling) has moved the step count to the device, it is an f32 there: a
// step past 2^24 is refused on the host's bound. (It went on, and the count stalled at 2^24.)
TEST_CASE("a step count on the device is refused past 2^24 instead of stalling there") {
  sk::Context ctx({.seed = 4});
  const sk::shard::ShardPlan plan({{"w", {32}, true}}, 1, sk::shard::PartitionKind::flat);
  const auto table = sk::shard::PieceTable::of_plan(plan, true);
  const sk::Tensor w = sk::full(ctx, {32}, sk::DType::f32, 0.5);
  sk::optim::ShardedOptimizer opt(ctx, table, 0, {w}, config_for(OptimizerKind::sgd), nullptr);
  const sk::Tensor g = sk::full(ctx, {32}, sk::DType::f32, 0.25);
  (void)opt.clip_grad_norm({g}, 1.0);
  opt.step({g}, 0.1f);
  CHECK(opt.steps() == 1);
  opt.set_steps((std::int64_t{1} << 24) - 1);
  opt.step({g}, 0.1f);
  CHECK(opt.steps() == std::int64_t{1} << 24);
  CHECK_THROWS_WITH_AS(opt.step({g}, 0.1f), doctest::Contains("is past 2^24"), sk::InvalidArgument);
  CHECK(opt.steps() == std::int64_t{1} << 24);
}

// An optimizer-state file's parameter list is checked as its tensors are: a shape of [-4]
// covered no elements (a rewrite then dropped the parameter without a word) and [2.7] read as
// [2]; each is refused naming the file, the parameter and the shape.
TEST_CASE("an optimizer-state file whose parameter list claims a shape no tensor has is refused") {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("shardkit_bad_shapes_" + std::to_string(::getpid()) + ".safetensors"))
                        .string();
  for (const std::string shape : {"[-4]", "[2.7]", "[4294967296, 4294967296, 4]"}) {
    sk::checkpoint::save_safetensors(
        path, {},
        {{"format", std::string(sk::checkpoint::kOptimizerStateFormat)},
         {"optimizer", "sgd"},
         {"steps", "0"},
         {"parameters", "[{\"name\": \"b\", \"shape\": " + shape + "}]"}});
    CAPTURE(shape);
    CHECK_THROWS_WITH_AS(sk::checkpoint::load_optimizer_state(path),
                         doctest::Contains("metadata 'parameters' gives 'b' the shape"),
                         sk::IoError);
  }
  std::filesystem::remove(path);
}

// A state whose step count the device cannot hold (past 2^24, once the count lives there: a
// clipped or loss-scaled step made the gate) was refused only after every buffer had been
// overwritten with it. Refused first now: the optimizer's state stays as it was.
TEST_CASE("a state refused for its step count leaves the optimizer's state as it was") {
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::adamw));
    dp.zero_grad();
    dp_test::fake_backward(dp, ctx, comm.rank(), 0);
    dp.finish();
    (void)dp.clip_grad_norm(1.0);  // (the step gate: the count lives on the device now)
    dp.step(0.05f);
    const auto before = dp.consolidate_optimizer_state(0);
    auto bad = before;
    bad.steps = (std::int64_t{1} << 24) + 1;
    for (auto& p : bad.params)
      for (auto& [name, values] : p.buffers)
        for (auto& v : values) v += 1.0f;
    CHECK_THROWS_WITH(dp.load_optimizer_state(bad), doctest::Contains("is past 2^24"));
    CHECK(states_equal(dp.consolidate_optimizer_state(0), before, 0));
  });
}
