// CPU offload's step cost beside a GPU (offload_step.hpp): ResNet-50 on one rank, AdamW and
// LARC-SGD, f32 and bf16. plain_ms is the fused step on the GPU; ms_per_step the offloaded one
// (gradients down over PCIe into pinned memory, the update on every host thread, parameters up
// in chunks that overlap it); cost their ratio; GBps / pct_of_copy the host update's
// throughput against a host memcpy on the same threads. Part of bench_gpu (bench_gpu_main.cu).
#include <cstdio>
#include <memory>

#include "offload_step.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace sk = shardkit;
namespace os = shardkit::bench::offload_step;

namespace offload_gpu {

sk::Context& context() {
  static std::unique_ptr<sk::Context> ctx = sk::make_cuda_context(0, 0, 5);
  return *ctx;
}

void BM_offload_step_gpu(benchmark::State& state) {
  const auto kind =
      state.range(0) == 0 ? sk::optim::OptimizerKind::adamw : sk::optim::OptimizerKind::larc_sgd;
  const auto precision = state.range(1) == 0 ? sk::DType::f32 : sk::DType::bf16;
  auto& ctx = context();
  os::run(state, ctx, kind, precision, 1, [&] { ctx.synchronize(); });
}

BENCHMARK(BM_offload_step_gpu)
    ->ArgNames({"larc", "bf16"})
    ->Args({0, 0})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

}  // namespace offload_gpu
