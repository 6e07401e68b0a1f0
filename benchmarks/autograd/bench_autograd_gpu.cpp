// Autograd on the GPU (cuDNN / cuBLAS / own kernels), timed with CUDA events: the same workloads
// as bench_autograd (conv / batch-norm / linear fwd+bwd at ResNet shapes, ResNet-18 training
// step) at GPU-sized batches. Part of bench_gpu (bench_gpu_main.cu).
#include <benchmark/benchmark.h>

#include <cstdio>

#include "autograd_workloads.hpp"
#include "shardkit/autograd/cuda_libraries.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace sk = shardkit;
namespace wl = shardkit::bench::autograd_workloads;

namespace autograd_gpu {

// Times w.run() with CUDA events on the context's stream.
void time_workload(benchmark::State& state, sk::Context& ctx, const wl::Workload& w, double items) {
  cudaEvent_t start, stop;
  SK_CUDA_CHECK(cudaEventCreate(&start));
  SK_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) w.run();  // warm-up: algorithm choice, pool growth
  ctx.synchronize();
  for (auto _ : state) {
    SK_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    w.run();
    SK_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    SK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
  }
  using benchmark::Counter;
  if (w.flops > 0)
    state.counters["TFLOPs"] = Counter(w.flops / 1e12, Counter::kIsIterationInvariantRate);
  if (items > 0)
    state.counters["images_per_s"] = Counter(items, Counter::kIsIterationInvariantRate);
  if (w.bytes > 0)  // the floor's bytes a second: compare with bench_gpu's copy rows
    state.counters["floor_GBps"] = Counter(w.bytes / 1e9, Counter::kIsIterationInvariantRate);
  SK_CUDA_CHECK(cudaEventDestroy(start));
  SK_CUDA_CHECK(cudaEventDestroy(stop));
}

// TF32 on, as PyTorch's cuDNN convolutions default to, so the figures compare with its eager mode.
std::unique_ptr<sk::Context> gpu_context(benchmark::State&) {
  auto ctx = sk::make_cuda_context(0, 0, 1);
  sk::autograd::cuda::libraries(*ctx).allow_tf32 = true;
  return ctx;
}

void BM_conv_fwd_bwd_gpu(benchmark::State& state) {
  auto ctx = gpu_context(state);
  time_workload(
      state, *ctx,
      wl::conv_workload(*ctx, state.range(0), state.range(1), state.range(2), state.range(3),
                        state.range(4), state.range(5), state.range(6) != 0),
      0);
}
// CL: 1 for channels-last (NHWC) activations, which cuDNN convolves without the layout
// transposes it makes around NCHW ones.
BENCHMARK(BM_conv_fwd_bwd_gpu)
    ->ArgNames({"N", "C", "HW", "OC", "K", "S", "CL"})
    ->Args({64, 3, 224, 64, 7, 2, 0})
    ->Args({64, 64, 56, 64, 3, 1, 0})
    ->Args({64, 64, 56, 64, 3, 1, 1})
    ->Args({64, 128, 56, 128, 3, 2, 0})
    ->Args({64, 256, 14, 256, 3, 1, 0})
    ->Args({64, 256, 14, 256, 3, 1, 1})
    ->Args({64, 64, 56, 256, 1, 1, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_batch_norm_fwd_bwd_gpu(benchmark::State& state) {
  auto ctx = gpu_context(state);
  time_workload(state, *ctx,
                wl::batch_norm_workload(*ctx, state.range(0), state.range(1), state.range(2), 0,
                                        state.range(3) != 0),
                0);
}
// CL: 1 for channels-last activations (rows of channels: batch_norm_sync.cuh's tiles).
BENCHMARK(BM_batch_norm_fwd_bwd_gpu)
    ->ArgNames({"N", "C", "HW", "CL"})
    ->Args({64, 64, 56, 0})
    ->Args({64, 64, 56, 1})
    ->Args({64, 256, 14, 0})
    ->Args({64, 256, 14, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_max_pool_fwd_bwd_gpu(benchmark::State& state) {
  auto ctx = gpu_context(state);
  time_workload(state, *ctx,
                wl::max_pool_workload(*ctx, state.range(0), state.range(1), state.range(2),
                                      state.range(3) != 0),
                0);
}
// ImageNet's stem pool at batch 64 (the ResNet-18 224² step's): our kernels, deterministic.
BENCHMARK(BM_max_pool_fwd_bwd_gpu)
    ->ArgNames({"N", "C", "HW", "CL"})
    ->Args({64, 64, 112, 0})
    ->Args({64, 64, 112, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_linear_fwd_bwd_gpu(benchmark::State& state) {
  auto ctx = gpu_context(state);
  time_workload(state, *ctx,
                wl::linear_workload(*ctx, state.range(0), state.range(1), state.range(2)), 0);
}
BENCHMARK(BM_linear_fwd_bwd_gpu)
    ->ArgNames({"N", "in", "out"})
    ->Args({256, 512, 1000})
    ->Args({256, 2048, 1000})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// The step's activations NCHW (CL: 0) or channels-last from the stem on (CL: 1, the images too,
// as PyTorch's model.to(memory_format=torch.channels_last)).
wl::ActivationLayout layout_arg(benchmark::State& state) {
  return state.range(3) != 0 ? wl::ActivationLayout::channels_last : wl::ActivationLayout::nchw;
}

// Both ResNet-18 rows' configurations: the two sizes in each layout, and a host-bound
// one (4 channels on 8 x 8 images: the step is its ops' host work, bench_autograd's too).
void resnet_step_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "HW", "width", "CL"})
      ->Args({256, 32, 64, 0})
      ->Args({256, 32, 64, 1})
      ->Args({64, 224, 64, 0})
      ->Args({64, 224, 64, 1})
      ->Args({2, 8, 4, 0})
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

void BM_resnet18_train_step_gpu(benchmark::State& state) {
  auto ctx = gpu_context(state);
  const std::int64_t batch = state.range(0), hw = state.range(1);
  time_workload(
      state, *ctx,
      wl::resnet18_step(*ctx, batch, hw, hw <= 64 ? 10 : 1000, state.range(2), layout_arg(state)),
      double(batch));
}
BENCHMARK(BM_resnet18_train_step_gpu)->Apply(resnet_step_args);

// The same step through a StepGraph (core/step_graph.hpp): the warm-up's first two runs are
// eager, the third captures it, every timed run is one CUDA graph launch -- what the host's
// per-op work costs the eager step is the difference.
void BM_resnet18_train_step_gpu_graph(benchmark::State& state) {
  auto ctx = gpu_context(state);
  const std::int64_t batch = state.range(0), hw = state.range(1);
  const auto eager =
      wl::resnet18_step(*ctx, batch, hw, hw <= 64 ? 10 : 1000, state.range(2), layout_arg(state));
  auto graph = std::make_shared<sk::StepGraph>(*ctx, "resnet18 step");
  wl::Workload graphed;
  graphed.run = [graph, eager] { graph->run("resnet18", eager.run); };
  time_workload(state, *ctx, graphed, double(batch));
  state.counters["captures"] = static_cast<double>(graph->stats().captures);
}
BENCHMARK(BM_resnet18_train_step_gpu_graph)->Apply(resnet_step_args);

}  // namespace autograd_gpu
