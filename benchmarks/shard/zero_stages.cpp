// Model-state memory and communication per rank for DDP, OSS (ZeRO-1) and SDP (ZeRO-2) on
// ResNet-50's parameter list, measured from the allocator's and the communicator's counters
// after real training steps (N ranks as threads, local communicator), beside the formulas of
// docs/semantics.md for f32 training: params 4Ψ, grads 4Ψ, optimizer state KΨ (K = 4 for SGD with
// momentum, 8 for Adam).
//
//   DDP  (4 + 4 + K)Ψ          OSS  (4 + 4)Ψ + KΨ/N          SDP  4Ψ + (4 + K)Ψ/N
//   communication per step (bus bytes, ring): DDP 2Ψ(N-1)/N·4, OSS 3Ψ(N-1)/N·4 (all-reduce +
//   parameter all-gather, FairScale's OSS), SDP 2Ψ(N-1)/N·4 (reduce-scatter + all-gather).
//
// SDP's bucket buffers are transient; their peak is declared separately and reported.
#include <cstdio>
#include <string>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/data_parallel.hpp"
#include "workloads/resnet50_params.hpp"

namespace sk = shardkit;
using sk::parallel::Stage;

namespace {

std::vector<sk::shard::ParamSpec> resnet50_specs() {
  std::vector<sk::shard::ParamSpec> specs;
  int i = 0;
  for (const auto& shape : sk::workloads::kResNet50Shapes) {
    std::string name = "param.";
    name += std::to_string(i++);
    specs.push_back({name, shape.shape()});
  }
  return specs;
}

struct Measured {
  double model_state = 0;  // params + grads + optimizer state, bytes, max over ranks
  double bucket_peak = 0;  // communication buffers' peak, bytes, max over ranks
  double bus_bytes = 0;    // per step, rank 0
};

Measured measure(Stage stage, sk::optim::OptimizerKind kind, int world) {
  Measured m;
  std::vector<Measured> per_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::optim::OptimizerConfig config;
    config.kind = kind;
    config.sgd.momentum = 0.9f;
    sk::parallel::DataParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = std::size_t{1} << 23;  // 8 MiB: ResNet-50 in ~13 buckets
    sk::parallel::DataParallel<sk::ops::Cpu> dp(ctx, comm, resnet50_specs(), config, options);
    for (std::size_t i = 0; i < dp.params().size(); ++i) sk::uniform_(ctx, dp.param(i), -0.1, 0.1);
    for (int step = 0; step < 2; ++step) {  // the second step shows the steady state
      comm.reset_stats();
      ctx.memory_stats().reset_peak();
      dp.zero_grad();
      for (std::size_t i = dp.params().size(); i-- > 0;) {
        sk::fill(ctx, dp.grad(i), 0.001 * static_cast<double>(comm.rank() + 1));
        dp.ready(i);
      }
      dp.finish();
      dp.step(0.01f);
    }
    const auto snap = ctx.memory_stats().snapshot();
    using C = sk::MemoryCategory;
    auto& mine = per_rank[static_cast<std::size_t>(comm.rank())];
    mine.model_state =
        static_cast<double>(snap.current_of(C::parameters) + snap.current_of(C::gradients) +
                            snap.current_of(C::optimizer_state));
    mine.bucket_peak = static_cast<double>(snap.peak_of(C::communication));
    mine.bus_bytes = static_cast<double>(comm.stats().total_bus_bytes());
  });
  for (const auto& r : per_rank) {
    m.model_state = std::max(m.model_state, r.model_state);
    m.bucket_peak = std::max(m.bucket_peak, r.bucket_peak);
  }
  m.bus_bytes = per_rank[0].bus_bytes;
  return m;
}

double formula_memory(Stage stage, double psi, double k, int n) {
  return sk::parallel::zero_model_state_bytes(stage, psi, k, n);
}

double formula_bus_bytes(Stage stage, double psi, int n) {
  const double ring = psi * (n - 1) / n * 4;
  return stage == Stage::oss ? 3 * ring : 2 * ring;
}

}  // namespace

int main() {
  const double psi = static_cast<double>(sk::workloads::kResNet50Params);
  std::printf(
      "ResNet-50, Ψ = %.0f f32 parameters; model-state MB per rank (max over ranks) and\n"
      "bus MB per step, measured vs formula. Buckets 8 MiB.\n\n",
      psi);
  std::printf("%-9s %-5s %3s %12s %12s %7s %12s %11s %11s %7s\n", "optimizer", "stage", "N",
              "measured MB", "formula MB", "diff %", "buckets MB", "bus MB", "formula MB",
              "diff %");
  for (auto kind : {sk::optim::OptimizerKind::sgd, sk::optim::OptimizerKind::adam}) {
    const double k = kind == sk::optim::OptimizerKind::sgd ? 4 : 8;
    for (int n : {2, 4, 8})
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
        const Measured m = measure(stage, kind, n);
        const double f = formula_memory(stage, psi, k, n);
        const double fb = formula_bus_bytes(stage, psi, n);
        std::printf("%-9s %-5s %3d %12.1f %12.1f %7.2f %12.1f %11.1f %11.1f %7.2f\n",
                    std::string(sk::optim::optimizer_kind_name(kind)).c_str(),
                    std::string(sk::parallel::stage_name(stage)).c_str(), n, m.model_state / 1e6,
                    f / 1e6, 100 * (m.model_state - f) / f, m.bucket_peak / 1e6, m.bus_bytes / 1e6,
                    fb / 1e6, 100 * (m.bus_bytes - fb) / fb);
        std::fflush(stdout);
      }
  }
  return 0;
}
