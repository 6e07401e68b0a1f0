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

namespace sk = shardkit;
using namespace module_test;
using Cpu = sk::ops::Cpu;

namespace {

// Rank r's input [rows[r], C, (4, 5)] and the upstream gradient for it, from a seeded stream.
std::vector<double> values_for(int rank, std::int64_t count, std::uint64_t salt) {
  sk::Context host({.seed = 4242ull + 977ull * static_cast<std::uint64_t>(rank) + salt});
  auto t = sk::empty(host, {count}, sk::DType::f64);
  sk::normal_(host, t, 0.7, 1.9);  // a mean far from 0: the combination must not lose it
  return sk::to_vector<double>(host, t);
}

struct BnResult {
  std::vector<double> y, grad_x, grad_w, grad_b, running_mean, running_var;
};

// A ReLU after the batch-norm: none, fused into it (BatchNormOptions::relu), or its own op.
enum class Relu { none, fused, separate };

// One training forward and backward of a BatchNorm (weight/bias set to fixed non-trivial values)
// on x with upstream gradient g; `group` synchronises it when set.
BnResult run_bn(sk::Context& ctx, sk::DType dtype, int dims, const sk::Shape& shape,
                const std::vector<double>& x, const std::vector<double>& g,
                std::shared_ptr<sk::autograd::BatchStatsGroup> group, Relu relu = Relu::none) {
  const std::int64_t C = shape[1];
  nn::BatchNorm bn(ctx, C, dims, dtype);
  std::vector<double> w, b;
  for (std::int64_t c = 0; c < C; ++c) {
    w.push_back(0.5 + 0.25 * double(c));
    b.push_back(-0.3 + 0.1 * double(c));
  }
  sk::copy(ctx, bn.weight.data(), sk::cast(ctx, sk::from_vector(ctx, w, {C}), bn.weight.dtype()));
  sk::copy(ctx, bn.bias.data(), sk::cast(ctx, sk::from_vector(ctx, b, {C}), bn.bias.dtype()));
  if (group) sk::parallel::convert_sync_batch_norm(bn, group);
  bn.options.relu = relu == Relu::fused;
  ag::Variable in(sk::cast(ctx, sk::from_vector(ctx, x, shape), dtype), true);
  ag::Variable y = bn(ctx, in);
  if (relu == Relu::separate) y = ag::relu(ctx, y);
  ag::backward(ctx, y, sk::cast(ctx, sk::from_vector(ctx, g, shape), dtype));
  auto f64 = [&](const sk::Tensor& t) {
    return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
  };
  return {f64(y.data()),       f64(in.grad()),       f64(bn.weight.grad()),
          f64(bn.bias.grad()), f64(bn.running_mean), f64(bn.running_var)};
}

// Every output of two runs equal bit for bit (a check per field, so a failure names it).
void check_same_bits(const BnResult& got, const BnResult& want) {
  CHECK_MESSAGE(got.y == want.y, "output");
  CHECK_MESSAGE(got.grad_x == want.grad_x, "input gradient");
  CHECK_MESSAGE(got.grad_w == want.grad_w, "weight gradient");
  CHECK_MESSAGE(got.grad_b == want.grad_b, "bias gradient");
  CHECK_MESSAGE(got.running_mean == want.running_mean, "running mean");
  CHECK_MESSAGE(got.running_var == want.running_var, "running variance");
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const char* what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i])));
  CHECK_MESSAGE(worst <= tol, what, ": largest relative difference ", worst, " (bound ", tol, ")");
}

// `rows[r]` samples on rank r, groups of `group_size` consecutive ranks.
void check_against_concatenation(sk::DType dtype, int dims, const std::vector<std::int64_t>& rows,
                                 int group_size, double tol) {
  const int world = static_cast<int>(rows.size());
  const std::int64_t C = 3, inner = dims == 2 ? 20 : 1;
  auto shape_of = [&](std::int64_t n) {
    return dims == 2 ? sk::Shape{n, C, 4, 5} : sk::Shape{n, C};
  };
  std::vector<BnResult> per_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const int r = comm.rank();
    const std::int64_t n = rows[static_cast<std::size_t>(r)] * C * inner;
    auto group = sk::parallel::sync_batch_norm_group(comm, group_size);
    per_rank[static_cast<std::size_t>(r)] = run_bn(ctx, dtype, dims, shape_of(rows[std::size_t(r)]),
                                                   values_for(r, n, 1), values_for(r, n, 2), group);
  });
  for (int first = 0; first < world; first += group_size) {
    const int last = std::min(world, first + group_size);
    // The group's batch on one rank, plain batch-norm (its CPU path is checked against float64
    // and PyTorch elsewhere).
    std::vector<double> x, g;
    std::int64_t total = 0;
    for (int r = first; r < last; ++r) {
      const std::int64_t n = rows[static_cast<std::size_t>(r)] * C * inner;
      const auto xr = values_for(r, n, 1), gr = values_for(r, n, 2);
      x.insert(x.end(), xr.begin(), xr.end());
      g.insert(g.end(), gr.begin(), gr.end());
      total += rows[static_cast<std::size_t>(r)];
    }
    sk::Context ctx;
    const BnResult want = run_bn(ctx, dtype, dims, shape_of(total), x, g, nullptr);
    std::vector<double> y, gx, gw(static_cast<std::size_t>(C), 0.0), gb = gw;
    for (int r = first; r < last; ++r) {
      const auto& got = per_rank[static_cast<std::size_t>(r)];
      y.insert(y.end(), got.y.begin(), got.y.end());
      gx.insert(gx.end(), got.grad_x.begin(), got.grad_x.end());
      for (std::size_t c = 0; c < gw.size(); ++c) {
        gw[c] += got.grad_w[c];
        gb[c] += got.grad_b[c];
      }
      // Every member holds the group's running statistics.
      check_close(got.running_mean, want.running_mean, tol, "running_mean");
      check_close(got.running_var, want.running_var, tol, "running_var");
    }
    INFO(sk::dtype_name(dtype), " BatchNorm", dims, "d, world ", world, ", group size ", group_size,
         ", group from rank ", first);
    check_close(y, want.y, tol, "output");
    check_close(gx, want.grad_x, tol, "input gradient");
    check_close(gw, want.grad_w, tol, "weight gradient (summed over the group)");
    check_close(gb, want.grad_b, tol, "bias gradient (summed over the group)");
  }
}

}  // namespace

TEST_CASE("SyncBatchNorm over a group equals batch-norm over the group's concatenated batch") {
  for (int dims : {1, 2}) {
    check_against_concatenation(sk::DType::f64, dims, {3, 5, 2, 4}, 4, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {4, 4}, 2, 1e-12);
    check_against_concatenation(sk::DType::f64, dims, {2, 3, 4, 2, 5}, 2,
                                1e-12);  // {0,1} {2,3} {4}
    check_against_concatenation(sk::DType::f32, dims, {3, 5, 2, 4}, 4, 2e-5);
    check_against_concatenation(sk::DType::bf16, dims, {4, 6, 2}, 3, 2e-2);
  }
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
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    CAPTURE(sk::dtype_name(dtype));
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      const std::int64_t rows = 3 + comm.rank();  // uneven batches
      const std::int64_t n = rows * 3 * 20;
      const auto x = values_for(comm.rank(), n, 1), g = values_for(comm.rank(), n, 2);
      auto group = sk::parallel::sync_batch_norm_group(comm, 2);
      const auto fused = run_bn(ctx, dtype, 2, {rows, 3, 4, 5}, x, g, group, Relu::fused);
      const auto separate = run_bn(ctx, dtype, 2, {rows, 3, 4, 5}, x, g, group, Relu::separate);
      // (the ReLU cut some outputs and passed others)
      CHECK(std::count(fused.y.begin(), fused.y.end(), 0.0) > 0);
      CHECK(std::count(fused.y.begin(), fused.y.end(), 0.0) < n);
      check_same_bits(fused, separate);
    });
  }
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
    sk::parallel::ShardedModuleOptions options;
    options.stage = stage;
    sk::parallel::ShardedModule<Cpu> model(
        ctx, comm, net, dp_test::config_for(sk::optim::OptimizerKind::sgd), options);
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
      auto full = model.fsdp().full_params();  // collective: every rank gathers
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
