// ShardedModule (ddp/oss/sdp over an nn::Module) against the hand-written DataParallel loop:
// the same model, batches and optimizer give bitwise the same parameters and buffers; with
// activation checkpointing too; buffers follow DDP's broadcast_buffers semantics.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace module_test;
using Cpu = sk::ops::Cpu;
using sk::optim::OptimizerKind;
using sk::parallel::Stage;

namespace {

constexpr int kSteps = 6;

float lr_at(int step) { return 0.05f * (1.0f - 0.05f * static_cast<float>(step)); }

// The hand-written loop: a plain module per rank, its gradients copied into DataParallel's
// buckets, DataParallel's parameters copied back, rank 0's buffers broadcast before forwards.
std::vector<float> hand_written(int world, Stage stage, OptimizerKind kind) {
  std::vector<float> rank0;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::DataParallelOptions options;
    options.stage = stage;
    options.partition = sk::shard::PartitionKind::flat;
    options.buckets.bucket_bytes = 4096;
    sk::parallel::DataParallel<Cpu> dp(ctx, comm, sk::parallel::module_param_specs(*net),
                                       dp_test::config_for(kind), options);
    auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, dp.param(i), params[i].data());
    dp.broadcast_parameters(0);
    sk::parallel::broadcast_module_buffers(ctx, *net, comm);
    for (int s = 0; s < kSteps; ++s) {
      for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, params[i].data(), dp.param(i));
      sk::parallel::broadcast_module_buffers(ctx, *net, comm);
      net->zero_grad();
      dp.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, (*net)(ctx, b.x), b.labels));
      for (std::size_t i = params.size(); i-- > 0;) {
        if (!params[i].requires_grad()) continue;
        sk::copy(ctx, dp.grad(i), params[i].grad());
        dp.ready(i);
      }
      dp.finish();
      dp.step(lr_at(s));
    }
    for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, params[i].data(), dp.param(i));
    if (comm.rank() == 0) rank0 = module_values(ctx, *net);
  });
  return rank0;
}

std::vector<float> wrapped(int world, Stage stage, OptimizerKind kind, int checkpoint_segments) {
  std::vector<std::vector<float>> per_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    net->set_checkpoint_segments(checkpoint_segments);
    sk::parallel::ShardedModuleOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 4096;
    sk::parallel::ShardedModule<Cpu> model(ctx, comm, net, dp_test::config_for(kind), options);
    for (int s = 0; s < kSteps; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(lr_at(s));
    }
    // The module's own parameters are views of the flat buffer: reading them reads the result.
    per_rank[static_cast<std::size_t>(comm.rank())] = module_values(ctx, *net);
  });
  // Parameters agree on every rank; buffers too (broadcast before each forward, updated by the
  // last forward from each rank's own batch: compare parameters only across ranks).
  return per_rank[0];
}

}  // namespace

TEST_CASE("ShardedModule ddp/oss/sdp equal the hand-written DataParallel loop bitwise") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (int world : {1, 2, 3}) {
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
        const auto expected = hand_written(world, stage, kind);
        for (int segments : {0, 2}) {
          const auto got = wrapped(world, stage, kind, segments);
          CHECK_MESSAGE(dp_test::bitwise_equal(got, expected), sk::optim::optimizer_kind_name(kind),
                        " ", sk::parallel::stage_name(stage), " world ", world,
                        " checkpoint segments ", segments);
        }
      }
    }
  }
}

TEST_CASE(
    "ShardedModule: parameters stay views, names and frozen flags survive, errors are clear") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 5 + static_cast<std::uint64_t>(comm.rank()));
    const auto names_before = net->named_parameters();
    sk::parallel::ShardedModuleOptions options;
    options.stage = Stage::sdp;
    sk::parallel::ShardedModule<Cpu> model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                           options);
    const auto names_after = net->named_parameters();
    REQUIRE(names_after.size() == names_before.size());
    for (std::size_t i = 0; i < names_after.size(); ++i) {
      CHECK(names_after[i].first == names_before[i].first);
      CHECK(names_after[i].second.data().shares_storage(model.engine().param(0)));
      CHECK(names_after[i].second.requires_grad() == names_before[i].second.requires_grad());
    }
    // Rank 0's parameters everywhere after wrapping.
    auto mine = module_values(ctx, *net);
    std::vector<float> rank0 = mine;
    auto t = sk::from_vector(ctx, rank0, {static_cast<std::int64_t>(rank0.size())});
    comm.broadcast(t, 0).wait();
    CHECK(sk::to_vector<float>(ctx, t) == mine);
  });
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Linear>(ctx, 3, 2, true, sk::DType::f64));
    CHECK_THROWS_WITH(sk::parallel::ShardedModule<Cpu>(ctx, comm, net, {}),
                      doctest::Contains("parameter '0.weight' is f64"));
  });
}
