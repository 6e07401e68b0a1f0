// What the SyncBatchNorm tests on either device share: seeded per-rank inputs, one training
// forward and backward of a BatchNorm, and the check that a group's ranks together equal plain
// batch-norm on one rank over the group's concatenated batch (the CPU's, in the same dtype).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "module_test_model.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/parallel/sync_batch_norm.hpp"

namespace sync_bn_test {

using namespace module_test;

// Rank r's input [rows[r], C, (4, 5)] and the upstream gradient for it, from a seeded stream.
inline std::vector<double> values_for(int rank, std::int64_t count, std::uint64_t salt) {
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
inline BnResult run_bn(sk::Context& ctx, sk::DType dtype, int dims, const sk::Shape& shape,
                       const std::vector<double>& x, const std::vector<double>& g,
                       std::shared_ptr<sk::autograd::BatchStatsGroup> group,
                       Relu relu = Relu::none) {
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
inline void check_same_bits(const BnResult& got, const BnResult& want) {
  CHECK_MESSAGE(got.y == want.y, "output");
  CHECK_MESSAGE(got.grad_x == want.grad_x, "input gradient");
  CHECK_MESSAGE(got.grad_w == want.grad_w, "weight gradient");
  CHECK_MESSAGE(got.grad_b == want.grad_b, "bias gradient");
  CHECK_MESSAGE(got.running_mean == want.running_mean, "running mean");
  CHECK_MESSAGE(got.running_var == want.running_var, "running variance");
}

inline void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                        const char* what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i])));
  CHECK_MESSAGE(worst <= tol, what, ": largest relative difference ", worst, " (bound ", tol, ")");
}

// A sample's channels, and its planes' height and width in the 2-d case.
struct BnGeometry {
  std::int64_t channels = 3, height = 4, width = 5;
};

// `rows[r]` samples on rank r, groups of `group_size` consecutive ranks.
// The ranks run under `options` (sk::comm::cuda_run_options for ranks sharing a GPU); the
// reference is the CPU's plain batch-norm.
inline void check_against_concatenation(sk::DType dtype, int dims,
                                        const std::vector<std::int64_t>& rows, int group_size,
                                        double tol, const sk::comm::RunRanksOptions& options = {},
                                        BnGeometry geometry = {}) {
  const int world = static_cast<int>(rows.size());
  const std::int64_t C = geometry.channels,
                     inner = dims == 2 ? geometry.height * geometry.width : 1;
  auto shape_of = [&](std::int64_t n) {
    return dims == 2 ? sk::Shape{n, C, geometry.height, geometry.width} : sk::Shape{n, C};
  };
  std::vector<BnResult> per_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        const int r = comm.rank();
        const std::int64_t n = rows[static_cast<std::size_t>(r)] * C * inner;
        auto group = sk::parallel::sync_batch_norm_group(comm, group_size);
        per_rank[static_cast<std::size_t>(r)] =
            run_bn(ctx, dtype, dims, shape_of(rows[std::size_t(r)]), values_for(r, n, 1),
                   values_for(r, n, 2), group);
      },
      options);
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

// On 2 ranks with uneven batches, SyncBatchNorm with a fused ReLU gives the same bits as
// SyncBatchNorm followed by a ReLU of its own.
inline void check_fused_relu(sk::DType dtype, const sk::comm::RunRanksOptions& options = {}) {
  CAPTURE(sk::dtype_name(dtype));
  sk::comm::run_ranks(
      2,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
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
      },
      options);
}

}  // namespace sync_bn_test
