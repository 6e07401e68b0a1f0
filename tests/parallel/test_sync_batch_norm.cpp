// SyncBatchNorm: a group's ranks normalise with the statistics of the group's whole batch, so
// N ranks with per-rank batches equal one rank with their concatenation (outputs, input
// gradients, running statistics; weight and bias gradients summed over the ranks), with uneven
// batches and with groups smaller than the world; and a ResNet trained under ddp and fsdp with
// SyncBatchNorm over 4 ranks follows the single-rank run on the concatenated batches.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/parallel/sync_batch_norm.hpp"
#include "sync_bn_test_support.hpp"

namespace sk = shardkit;
using namespace module_test;

using namespace sync_bn_test;

TEST_CASE("SyncBatchNorm over a group equals batch-norm over the group's concatenated batch") {
  for (int dims : {1, 2}) {
    check_against_concatenation(sk::DType::f64, dims, {3, 5, 2, 4}, 4, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {4, 4}, 2, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {2, 3, 4, 2, 5}, 2,
                                1e-12);  // {0,1} {2,3} {4}
    check_against_concatenation(sk::DType::f32, dims, {3, 5, 2, 4}, 4, 2e-5);
    check_against_concatenation(sk::DType::bf16, dims, {4, 6, 2}, 3, 2e-2);
  }
  // Layers of a real size (the GPU test's cases, on the CPU).
  const BnGeometry wide{64, 8, 8};
  check_against_concatenation(sk::DType::f32, 2, {16, 12}, 2, 2e-5, {}, wide);
  check_against_concatenation(sk::DType::f16, 2, {16, 12}, 2, 1e-2, {}, wide);
  check_against_concatenation(sk::DType::f32, 1, {300, 260}, 2, 2e-5, {}, {300, 1, 1});
}

// The group's batch is what must hold more than one value per channel: a member with one
// sample, or none, takes part (PyTorch's rule). Refused on that member alone, it left the others
// waiting in the exchange.
TEST_CASE("SyncBatchNorm takes members with one sample or none") {
  for (int dims : {1, 2}) {
    check_against_concatenation(sk::DType::f64, dims, {3, 1}, 2, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {1, 1, 1, 1}, 4, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {4, 0, 2, 3}, 2, 1e-12);
  }
}

// A group's batch of one value per channel has no unbiased variance: the output is the bias and
// the running statistics stay as they were (PyTorch's become infinite).
TEST_CASE("SyncBatchNorm over a group's single value keeps the running statistics") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const std::int64_t rows = comm.rank() == 0 ? 1 : 0;
    const auto x = values_for(comm.rank(), rows * 3, 1), g = values_for(comm.rank(), rows * 3, 2);
    const auto got = run_bn(ctx, sk::DType::f64, 1, {rows, 3}, x, g,
                            sk::parallel::sync_batch_norm_group(comm, 2));
    CHECK(got.running_mean == std::vector<double>{0.0, 0.0, 0.0});
    CHECK(got.running_var == std::vector<double>{1.0, 1.0, 1.0});
    if (rows == 1) {
      check_close(got.y, {-0.3, -0.2, -0.1}, 1e-12, "output (run_bn's bias)");
      for (double v : got.grad_x) CHECK(std::isfinite(v));
    }
  });
}

TEST_CASE("SyncBatchNorm with a group of one rank is plain batch-norm, bit for bit") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const std::int64_t n = 6 * 3 * 20;
    const auto x = values_for(comm.rank(), n, 1), g = values_for(comm.rank(), n, 2);
    const auto plain = run_bn(ctx, sk::DType::f32, 2, {6, 3, 4, 5}, x, g, nullptr);
    const auto synced = run_bn(ctx, sk::DType::f32, 2, {6, 3, 4, 5}, x, g,
                               sk::parallel::sync_batch_norm_group(comm, 1));
    check_same_bits(synced, plain);
  });
}

TEST_CASE("SyncBatchNorm with a fused ReLU equals SyncBatchNorm then ReLU, bit for bit") {
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) check_fused_relu(dtype);
}

namespace {

constexpr int kSyncSteps = 3;
constexpr int kRanks = 4;
constexpr std::int64_t kPerRank = 3;

// A small ResNet-18 trained kSyncSteps SGD steps; with `world` ranks each rank takes its own
// batch of kPerRank images and SyncBatchNorm spans the world; with one rank the batch is the
// concatenation of all kRanks ranks' batches. Parameters and buffers afterwards.
std::vector<float> resnet_run(int world, sk::parallel::Stage stage) {
  std::vector<float> out;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = small_resnet(ctx, 31);
    if (world > 1)
      CHECK(sk::parallel::convert_sync_batch_norm(
                *net, sk::parallel::sync_batch_norm_group(comm, world)) == 20);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    sk::parallel::ShardedModule model(ctx, comm, net,
                                      dp_test::config_for(sk::optim::OptimizerKind::sgd), options);
    for (int s = 0; s < kSyncSteps; ++s) {
      model.zero_grad();
      std::vector<ag::Variable> xs;
      std::vector<std::int64_t> labels;
      for (int r = 0; r < kRanks; ++r) {
        if (world > 1 && r != comm.rank()) continue;
        auto b = batch(ctx, {kPerRank, 3, 8, 8}, 5, r, s);
        xs.push_back(b.x);
        const auto l = sk::to_vector<std::int64_t>(ctx, b.labels);
        labels.insert(labels.end(), l.begin(), l.end());
      }
      const ag::Variable x = xs.size() == 1 ? xs[0] : ag::cat(ctx, xs);
      const auto y = sk::from_vector(ctx, labels, {static_cast<std::int64_t>(labels.size())});
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, x), y));
      model.step(0.05f);
    }
    if (stage == sk::parallel::Stage::fsdp) {
      auto full = model.full_params();  // collective: every rank gathers
      if (comm.rank() == 0) out = module_values(ctx, *net);
    } else if (comm.rank() == 0) {
      out = module_values(ctx, *net);
    }
  });
  return out;
}

}  // namespace

TEST_CASE("ResNet with SyncBatchNorm on 4 ranks (ddp, fsdp) follows one rank on the whole batch") {
  const auto one = resnet_run(1, sk::parallel::Stage::ddp);
  for (auto stage : {sk::parallel::Stage::ddp, sk::parallel::Stage::fsdp}) {
    const auto four = resnet_run(kRanks, stage);
    REQUIRE(four.size() == one.size());
    double worst = 0;
    for (std::size_t i = 0; i < one.size(); ++i)
      worst = std::max(worst, double(std::abs(four[i] - one[i])) / (1.0 + std::abs(one[i])));
    INFO(sk::parallel::stage_name(stage));
    CHECK(worst < 1e-5);
  }
}
