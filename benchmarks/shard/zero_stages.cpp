// Model-state memory and communication per rank for DDP, OSS (ZeRO-1), SDP (ZeRO-2) and FSDP
// (ZeRO-3) training torchvision's ResNet-50 (nn::resnet50, 1000 classes) through
// ShardedModule, measured from the allocator's and the communicator's counters over real
// training steps (N ranks as threads, local communicator, two 32x32 images per rank: the
// model states, not the activations, are what this measures), beside the formulas of
// docs/semantics.md for f32 training: params 4Ψ, grads 4Ψ, optimizer state KΨ (K = 4 for SGD
// with momentum, 8 for Adam).
//
//   DDP  (4 + 4 + K)Ψ     OSS  (4 + 4)Ψ + KΨ/N     SDP  4Ψ + (4 + K)Ψ/N     FSDP (4 + 4 + K)Ψ/N
//   communication per step (bus bytes, ring): DDP 2Ψ(N-1)/N·4, OSS 3Ψ(N-1)/N·4 (all-reduce +
//   parameter all-gather, FairScale's OSS), SDP 2Ψ(N-1)/N·4 (reduce-scatter + all-gather), FSDP
//   3Ψ(N-1)/N·4 with reshard_after_forward (gather for forward and again for backward, one
//   reduce-scatter), 2Ψ(N-1)/N·4 without.
//
// A third table: the same under bf16 mixed precision (Adam), against (2 + 2 + 12)Ψ.
//
// FSDP units: every Bottleneck block (16) plus the root (stem, fc). The root unit stays gathered
// from its forward into its backward (its backward comes first), so FSDP's traffic with
// resharding is 3Ψ minus one all-gather of the root (fc.weight, 8% of Ψ: -2.7%). Batch-norm
// statistics are module buffers (counted under parameters; 0.2% of Ψ) and are not broadcast
// per step here, so the traffic is the model's alone.
//
// The second table: peaks per category over one whole training step (the second) with a
// real batch per rank (8 images of 64x64), activations included, for Adam at N = 4. With
// `--csv FILE` that table is also written as CSV (benchmarks/shard/plot_zero_stages.py
// draws it).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using sk::parallel::Stage;
using C = sk::MemoryCategory;

namespace {

struct Measured {
  double model_state = 0;    // params + grads + optimizer state - module buffers, max over ranks
  double bus_bytes = 0;      // per step, rank 0
  sk::MemorySnapshot peaks;  // rank 0, over the second step
};

struct Config {
  Stage stage;
  bool reshard = true;
  sk::DType precision = sk::DType::f32;  // bf16: mixed precision (f32 masters in the optimizer)
};

struct Batch {
  std::int64_t images;
  std::int64_t side;
};

Measured measure(Config config, sk::optim::OptimizerKind kind, int world, Batch batch) {
  std::vector<Measured> per_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = sk::nn::resnet50(ctx);
    double buffers = 0;
    for (const auto& [name, b] : net->named_buffers()) buffers += static_cast<double>(b.nbytes());
    sk::optim::OptimizerConfig optimizer;
    optimizer.kind = kind;
    optimizer.sgd.momentum = 0.9f;
    sk::parallel::ParallelOptions options;
    options.stage = config.stage;
    options.broadcast_buffers = false;
    options.buckets.bucket_bytes = std::size_t{1} << 23;  // 8 MiB
    options.fsdp.reshard_after_forward = config.reshard;
    if (config.precision != sk::DType::f32)
      options.precision = sk::parallel::MixedPrecision::of(config.precision);
    for (int layer = 1; layer <= 4; ++layer)
      for (int b = 0; b < (layer == 1 ? 3 : layer == 2 ? 4 : layer == 3 ? 6 : 3); ++b)
        options.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." +
                                               std::to_string(b));
    sk::parallel::ShardedModule model(ctx, comm, net, optimizer, options);
    auto x = sk::empty(ctx, {batch.images, 3, batch.side, batch.side}, sk::DType::f32);
    sk::normal_(ctx, x, 0.0, 1.0);
    std::vector<std::int64_t> classes;
    for (std::int64_t i = 0; i < batch.images; ++i)
      classes.push_back((comm.rank() * 37 + i) % 1000);
    const auto labels = sk::from_vector<std::int64_t>(ctx, classes, {batch.images});
    for (int step = 0; step < 2; ++step) {  // the second step shows the steady state
      comm.reset_stats();
      ctx.memory_stats().reset_peak();
      model.zero_grad();
      auto loss = sk::autograd::cross_entropy(ctx, model(ctx, sk::autograd::Variable(x)), labels);
      sk::autograd::backward(ctx, loss);
      model.step(0.01f);
    }
    const auto snap = ctx.memory_stats().snapshot();
    auto& mine = per_rank[static_cast<std::size_t>(comm.rank())];
    mine.model_state =
        static_cast<double>(snap.current_of(C::parameters) + snap.current_of(C::gradients) +
                            snap.current_of(C::optimizer_state)) -
        buffers;
    mine.bus_bytes = static_cast<double>(comm.stats().total_bus_bytes());
    mine.peaks = snap;
  });
  Measured m = per_rank[0];
  for (const auto& r : per_rank) m.model_state = std::max(m.model_state, r.model_state);
  return m;
}

double formula_bus_bytes(Config config, double psi, int n) {
  const double ring = psi * (n - 1) / n * 4;
  if (config.stage == Stage::oss || (config.stage == Stage::fsdp && config.reshard))
    return 3 * ring;
  return 2 * ring;
}

std::string label(Config config) {
  std::string name(sk::parallel::stage_name(config.stage));
  if (config.stage == Stage::fsdp && !config.reshard) name += "-keep";
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  const char* csv = nullptr;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--csv") == 0) csv = argv[i + 1];
  sk::Context probe;
  double psi = 0;
  for (const auto& p : sk::nn::resnet50(probe)->parameters()) psi += static_cast<double>(p.numel());
  std::printf(
      "ResNet-50, Ψ = %.0f f32 parameters; model-state MB per rank (max over ranks) and bus MB\n"
      "per step (rank 0), measured vs formula; fsdp-keep = reshard_after_forward off.\n\n",
      psi);
  std::printf("%-9s %-9s %3s %12s %12s %7s %9s %11s %11s %7s\n", "optimizer", "stage", "N",
              "measured MB", "formula MB", "diff %", "vs DDP", "bus MB", "formula MB", "diff %");
  struct Row {
    std::string what;
    sk::MemorySnapshot peaks;
  };
  std::vector<Row> peaks;
  const Config configs[] = {
      {Stage::ddp}, {Stage::oss}, {Stage::sdp}, {Stage::fsdp}, {Stage::fsdp, false}};
  for (auto kind : {sk::optim::OptimizerKind::sgd, sk::optim::OptimizerKind::adam}) {
    const double k = kind == sk::optim::OptimizerKind::sgd ? 4 : 8;
    for (int n : {2, 4, 8}) {
      double ddp = 0;
      for (const auto& config : configs) {
        const Measured m = measure(config, kind, n, Batch{2, 32});
        if (config.stage == Stage::ddp) ddp = m.model_state;
        const double f = sk::parallel::zero_model_state_bytes(config.stage, psi, k, n);
        const double fb = formula_bus_bytes(config, psi, n);
        std::printf("%-9s %-9s %3d %12.1f %12.1f %7.2f %8.2fx %11.1f %11.1f %7.2f\n",
                    std::string(sk::optim::optimizer_kind_name(kind)).c_str(),
                    label(config).c_str(), n, m.model_state / 1e6, f / 1e6,
                    100 * (m.model_state - f) / f, ddp / m.model_state, m.bus_bytes / 1e6, fb / 1e6,
                    100 * (m.bus_bytes - fb) / fb);
        std::fflush(stdout);
      }
    }
  }
  // Mixed precision (bf16 compute copy and gradients, f32 master, Adam): the ZeRO paper's own
  // accounting, 2 + 2 bytes of parameters and gradients and K = 12 of optimizer state.
  std::printf(
      "\nMixed precision (bf16), Adam: the ZeRO paper's (2 + 2 + K)Ψ with K = 12 (f32 master, "
      "exp_avg,\nexp_avg_sq):\n\n");
  std::printf("%-9s %-9s %3s %12s %12s %7s %9s\n", "precision", "stage", "N", "measured MB",
              "formula MB", "diff %", "vs DDP");
  for (int n : {2, 4, 8}) {
    double ddp = 0;
    for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
      const Config config{stage, true, sk::DType::bf16};
      const Measured m = measure(config, sk::optim::OptimizerKind::adam, n, Batch{2, 32});
      if (stage == Stage::ddp) ddp = m.model_state;
      const double f = sk::parallel::zero_model_state_bytes(stage, psi, 12, n, 2);
      std::printf("%-9s %-9s %3d %12.1f %12.1f %7.2f %8.2fx\n", "bf16",
                  std::string(sk::parallel::stage_name(stage)).c_str(), n, m.model_state / 1e6,
                  f / 1e6, 100 * (m.model_state - f) / f, ddp / m.model_state);
      std::fflush(stdout);
    }
  }
  for (const auto& config : configs)
    peaks.push_back(
        {label(config), measure(config, sk::optim::OptimizerKind::adam, 4, Batch{8, 64}).peaks});
  std::printf(
      "\nPeak MB per category over one training step, rank 0, Adam, N = 4, 8 images of 64x64\n"
      "per rank:\n\n");
  std::printf("%-9s %11s %10s %10s %14s %12s %8s %10s\n", "stage", "parameters", "gradients",
              "optimizer", "communication", "activations", "other", "total");
  for (const auto& row : peaks) {
    const auto& p = row.peaks;
    std::printf("%-9s %11.1f %10.1f %10.1f %14.1f %12.1f %8.1f %10.1f\n", row.what.c_str(),
                p.peak_of(C::parameters) / 1e6, p.peak_of(C::gradients) / 1e6,
                p.peak_of(C::optimizer_state) / 1e6, p.peak_of(C::communication) / 1e6,
                p.peak_of(C::activations) / 1e6, p.peak_of(C::other) / 1e6, p.peak_total / 1e6);
  }
  if (csv != nullptr) {
    std::ofstream out(csv);
    out << "stage,parameters,gradients,optimizer_state,communication,activations,other,total\n";
    for (const auto& row : peaks) {
      const auto& p = row.peaks;
      out << row.what;
      for (auto c : {C::parameters, C::gradients, C::optimizer_state, C::communication,
                     C::activations, C::other})
        out << ',' << p.peak_of(c) / 1e6;
      out << ',' << p.peak_total / 1e6 << '\n';
    }
    std::printf("\nwrote %s\n", csv);
  }
  return 0;
}
