// CPU offload's step cost on the CPU path (offload_step.hpp): ResNet-50 on one rank, AdamW and
// LARC-SGD, f32 and bf16, on 1 thread and on every hardware thread. Here "device" and host are
// the same RAM, so `cost` is what the staging copies add; GBps / pct_of_copy is the CPU
// optimizer's throughput against a memcpy on the same threads (the target: >= 60% on all
// threads). bench_gpu (bench_offload_gpu.cu) measures the same against a GPU's own step.
#include <map>
#include <memory>

#include <shardkit/ops/cpu_backend.hpp>
#include "offload_step.hpp"

namespace sk = shardkit;
namespace os = shardkit::bench::offload_step;

namespace {

sk::Context& context(int threads) {
  static std::map<int, std::unique_ptr<sk::Context>> cache;
  auto& slot = cache[threads];
  if (!slot) slot = std::make_unique<sk::Context>(sk::ContextOptions{.cpu_threads = threads});
  return *slot;
}

void BM_offload_step(benchmark::State& state) {
  const auto kind =
      state.range(0) == 0 ? sk::optim::OptimizerKind::adamw : sk::optim::OptimizerKind::larc_sgd;
  const auto precision = state.range(1) == 0 ? sk::DType::f32 : sk::DType::bf16;
  auto& ctx = context(static_cast<int>(state.range(2)));
  os::run(state, ctx, kind, precision, 2, [] {});
}

// {optimizer: 0 AdamW, 1 LARC-SGD} x {bf16: 0 f32, 1 bf16} x {threads: 1, all}.
void cases(benchmark::internal::Benchmark* b) {
  const int all = sk::default_cpu_threads();
  b->ArgNames({"larc", "bf16", "threads"});
  for (int larc : {0, 1})
    for (int bf16 : {0, 1}) {
      b->Args({larc, bf16, 1});
      if (all > 1) b->Args({larc, bf16, all});
    }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

}  // namespace

BENCHMARK(BM_offload_step)->Apply(cases);
BENCHMARK_MAIN();
