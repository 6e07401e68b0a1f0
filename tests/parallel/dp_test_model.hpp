// The model, "backward" and training run shared by the data-parallel tests (CPU, GPU and
// optimizer-state tests): uneven parameter sizes, a frozen parameter, gradients that depend on
// the weights, and host-side arithmetic so that every device computes the same gradients.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/parallel/data_parallel.hpp"

namespace dp_test {

namespace sk = shardkit;
using sk::optim::OptimizerKind;
using sk::parallel::DataParallel;
using sk::parallel::Stage;
using sk::shard::PartitionKind;

// Uneven sizes, a frozen parameter, and counts that do not divide by 3, 4 or 8.
inline std::vector<sk::shard::ParamSpec> model_specs() {
  return {{"embed.weight", {37, 11}},   {"block.0.weight", {64, 37}}, {"block.0.bias", {64}},
          {"frozen.scale", {5}, false}, {"block.1.weight", {19, 64}}, {"block.1.bias", {19}},
          {"head.weight", {3, 19}},     {"head.bias", {3}},           {"tiny", {1}}};
}

inline sk::optim::OptimizerConfig config_for(OptimizerKind kind) {
  sk::optim::OptimizerConfig c;
  c.kind = kind;
  c.sgd.momentum = 0.9f;
  c.sgd.weight_decay = 1e-4f;
  c.sgd.dampening = 0.1f;
  c.larc.trust_coefficient = 0.001f;
  c.larc.clip = false;
  c.adam.weight_decay = 0.01f;
  return c;
}

// A deterministic "backward": gradient i of rank r at step s = 0.5·w + noise(seed r, s, i),
// added into grad(i), marked ready last parameter first (and the middle ones swapped). The sum
// is formed on the host, so CPU and GPU runs see identical gradients.
inline void fake_backward(DataParallel& dp, sk::Context& ctx, int rank, int step) {
  const auto& layout = dp.plan().layout();
  std::vector<std::size_t> order;
  for (std::size_t i = layout.size(); i-- > 0;)
    if (layout[i].trainable) order.push_back(i);
  if (order.size() > 3) std::swap(order[1], order[2]);
  for (auto i : order) {
    sk::Context noise_ctx({.seed = 1000003ull * static_cast<std::uint64_t>(rank + 1) +
                                   7919ull * static_cast<std::uint64_t>(step) + i});
    auto noise = sk::empty(noise_ctx, dp.param(i).shape(), sk::DType::f32);
    sk::normal_(noise_ctx, noise, 0.0, 1.0);
    const auto g = dp.grad(i);
    const auto w = sk::to_vector<float>(ctx, dp.param(i));
    auto sum = sk::to_vector<float>(ctx, g);
    const float* n = noise.template data<float>();
    for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += 0.5f * w[e] + n[e];
    sk::copy(ctx, g, sk::from_vector(noise_ctx, sum, g.shape()));
    dp.ready(i);
  }
}

inline float lr_at(OptimizerKind kind, int step) {
  const float lr = kind == OptimizerKind::larc_sgd ? 0.5f : 0.05f;
  return lr * (1.0f - 0.02f * static_cast<float>(step));
}

// Every parameter of `dp`, in spec order, on the host.
inline std::vector<float> all_params(DataParallel& dp, sk::Context& ctx) {
  std::vector<float> out;
  for (std::size_t i = 0; i < dp.params().size(); ++i) {
    const auto v = sk::to_vector<float>(ctx, dp.param(i));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Every rank initialises differently (the broadcast then makes them equal, as DDP does). The
// values come from the host, so CPU and GPU runs start from the same parameters.
inline void init_differently(DataParallel& dp, sk::Context& ctx, int rank) {
  sk::Context host({.seed = 4242ull + static_cast<std::uint64_t>(rank)});
  for (std::size_t i = 0; i < dp.params().size(); ++i) {
    auto values = sk::empty(host, dp.param(i).shape(), sk::DType::f32);
    sk::uniform_(host, values, -0.5, 0.5);
    sk::copy(ctx, dp.param(i), values);
  }
}

struct RunResult {
  std::vector<std::vector<float>> params;  // per rank, every parameter in spec order
  std::vector<sk::MemorySnapshot> memory;  // per rank, after the last step
};

// `steps` steps of `stage` on `world` ranks, from the same (rank 0's) initialisation.
inline RunResult train_with(int world, Stage stage, const sk::optim::OptimizerConfig& config,
                            PartitionKind partition, int steps = 20,
                            std::size_t bucket_bytes = 2048,
                            const sk::comm::RunRanksOptions& ranks = {}) {
  RunResult result;
  result.params.resize(static_cast<std::size_t>(world));
  result.memory.resize(static_cast<std::size_t>(world));
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = stage;
        options.partition = partition;
        options.buckets.bucket_bytes = bucket_bytes;
        DataParallel dp(ctx, comm, model_specs(), config, options);
        init_differently(dp, ctx, comm.rank());
        dp.broadcast_parameters(0);
        for (int s = 0; s < steps; ++s) {
          dp.zero_grad();
          fake_backward(dp, ctx, comm.rank(), s);
          dp.finish();
          dp.step(lr_at(config.kind, s));
        }
        result.params[static_cast<std::size_t>(comm.rank())] = all_params(dp, ctx);
        result.memory[static_cast<std::size_t>(comm.rank())] = ctx.memory_stats().snapshot();
      },
      ranks);
  return result;
}

inline RunResult train(int world, Stage stage, OptimizerKind kind, PartitionKind partition,
                       int steps = 20, std::size_t bucket_bytes = 2048,
                       const sk::comm::RunRanksOptions& ranks = {}) {
  return train_with(world, stage, config_for(kind), partition, steps, bucket_bytes, ranks);
}

struct Checkpoint {
  std::vector<float> params;        // every parameter in spec order (as all_params)
  sk::optim::OptimizerState state;  // consolidated on `recipient`
};

struct Job {
  int world = 1;
  Stage stage = Stage::ddp;
  PartitionKind partition = PartitionKind::greedy;
};

// Steps [first, first + count) of `job`, starting from `from` (or a fresh initialisation), and
// the checkpoint of the end (parameters from rank 0, optimizer state consolidated on `recipient`).
inline Checkpoint run(const Job& job, OptimizerKind kind, int first, int count,
                      const Checkpoint* from, int recipient = 0,
                      const sk::comm::RunRanksOptions& ranks = {}) {
  Checkpoint out;
  sk::comm::run_ranks(
      job.world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = job.stage;
        options.partition = job.partition;
        options.buckets.bucket_bytes = 2048;
        DataParallel dp(ctx, comm, model_specs(), config_for(kind), options);
        if (from == nullptr) {
          init_differently(dp, ctx, comm.rank());
          dp.broadcast_parameters(0);
        } else {
          std::int64_t at = 0;
          for (std::size_t i = 0; i < dp.params().size(); ++i) {
            const auto n = dp.param(i).numel();
            const std::vector<float> values(from->params.begin() + at,
                                            from->params.begin() + at + n);
            sk::copy(ctx, dp.param(i), sk::from_vector(ctx, values, dp.param(i).shape()));
            at += n;
          }
          dp.load_optimizer_state(from->state);
        }
        for (int s = first; s < first + count; ++s) {
          dp.zero_grad();
          fake_backward(dp, ctx, comm.rank(), s);
          dp.finish();
          dp.step(lr_at(kind, s));
        }
        auto state = dp.consolidate_optimizer_state(recipient);
        if (comm.rank() == recipient) {
          out.state = std::move(state);
          out.params = all_params(dp, ctx);
        } else {
          CHECK(state.empty());  // only the recipient holds the whole state
        }
      },
      ranks);
  return out;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = a.size() == b.size() ? 0.0 : INFINITY;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) /
                                std::max(1e-3, std::fabs(static_cast<double>(b[i]))));
  return worst;
}

// max |a - b| over max |b|: the difference on the scale of the whole vector. Runs whose
// arithmetic differs (GPU against CPU) differ by rounding at the scale of the values a parameter
// passed through, which the elementwise measure above inflates where it has since come near 0.
inline double max_scaled_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? worst / scale : worst;
}

// Two optimizer states alike: kind, steps, names, shapes, and every buffer (bitwise for
// tolerance 0).
inline bool states_equal(const sk::optim::OptimizerState& a, const sk::optim::OptimizerState& b,
                         double tolerance) {
  if (a.kind != b.kind || a.steps != b.steps || a.params.size() != b.params.size()) return false;
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    const auto &x = a.params[i], &y = b.params[i];
    if (x.name != y.name || x.shape != y.shape) return false;
    if (x.buffers.size() != y.buffers.size()) return false;
    for (const auto& [name, values] : x.buffers)
      if (tolerance == 0 ? !bitwise_equal(values, y.buffer(name))
                         : max_relative_difference(values, y.buffer(name)) > tolerance)
        return false;
  }
  return true;
}

}  // namespace dp_test
