// Autograd on the CPU: forward + backward of conv / batch-norm / linear at ResNet shapes
// (GFLOP/s, and % of an Eigen GEMM of the same precision measured in the same run), and a
// ResNet-18 training step (images/s). resnet18_torch_peer.py is PyTorch's side of that step;
// compare_torch_cpu.sh runs both and prints the ratio.
#include <Eigen/Core>

#include <sys/resource.h>

#include <chrono>

#include "autograd_workloads.hpp"
#include "bench_common.hpp"

namespace sk = shardkit;
namespace bench = shardkit::bench;
namespace wl = shardkit::bench::autograd_workloads;

namespace {

// The compute ceiling: GFLOP/s of a 512^3 f32 Eigen GEMM, median of 9, measured once.
double gemm_ceiling() {
  static double ceiling = 0;
  if (ceiling > 0) return ceiling;
  Eigen::MatrixXf a = Eigen::MatrixXf::Random(512, 512), b = Eigen::MatrixXf::Random(512, 512),
                  c(512, 512);
  std::vector<double> seconds;
  for (int i = 0; i < 10; ++i) {
    const auto start = std::chrono::steady_clock::now();
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (i > 0) seconds.push_back(elapsed.count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return ceiling = 2.0 * 512 * 512 * 512 / seconds[seconds.size() / 2];
}

// Runs the workload as the benchmark loop; counters GFLOPs (per second) and pct_of_gemm as
// plain numbers. Returns the seconds per iteration.
double run_flops(benchmark::State& state, wl::Workload w) {
  w.run();  // warm-up
  bench::LoopClock clock;
  for (auto _ : state) w.run();
  const double seconds = clock.seconds_per_iteration(state);
  state.counters["GFLOPs"] = w.flops / seconds / 1e9;
  state.counters["pct_of_gemm"] = w.flops / seconds * 100.0 / gemm_ceiling();
  return seconds;
}

void BM_conv_fwd_bwd(benchmark::State& state) {
  sk::Context ctx({.seed = 1});
  run_flops(state, wl::conv_workload(ctx, state.range(0), state.range(1), state.range(2),
                                     state.range(3), state.range(4), state.range(5)));
}
// {N, C, HW, OC, K, stride}: ResNet-18 stem at 112 px, layer1/layer3 3x3, a strided 3x3,
// ResNet-50's 1x1 expansion.
BENCHMARK(BM_conv_fwd_bwd)
    ->ArgNames({"N", "C", "HW", "OC", "K", "S"})
    ->Args({8, 3, 112, 64, 7, 2})
    ->Args({8, 64, 56, 64, 3, 1})
    ->Args({8, 128, 56, 128, 3, 2})
    ->Args({8, 256, 14, 256, 3, 1})
    ->Args({8, 64, 56, 256, 1, 1})
    ->Unit(benchmark::kMillisecond);

// {N, C, HW, block, threads}: NCHW (block 0) or channel blocks of 8 / 16, on the context's default
// threads (0) or on one, as each rank of the SwAV quick config runs. GBps counts the five passes
// no batch-norm can avoid (forward: read x, write y; backward: read x and the output gradient,
// write the input gradient); ours makes nine (the moments' and the gradient sums' extra reads),
// as the bits of its double sums require. pct_of_copy: against a copy of one such tensor on as
// many threads, in this run.
void BM_batch_norm_fwd_bwd(benchmark::State& state) {
  sk::Context ctx({.seed = 2, .cpu_threads = static_cast<int>(state.range(4))});
  const double seconds = run_flops(
      state,
      wl::batch_norm_workload(ctx, state.range(0), state.range(1), state.range(2), state.range(3)));
  const double tensor_bytes =
      4.0 * double(state.range(0) * state.range(1) * state.range(2) * state.range(2));
  bench::report_bandwidth(
      state, seconds, 5.0 * tensor_bytes,
      bench::host_copy_bytes_per_second(static_cast<std::size_t>(tensor_bytes), ctx.cpu_threads()));
}
BENCHMARK(BM_batch_norm_fwd_bwd)
    ->ArgNames({"N", "C", "HW", "block", "threads"})
    ->Args({8, 64, 56, 0, 0})
    ->Args({8, 256, 14, 0, 0})
    // The SwAV quick config's first and third stages (256 crops per rank), on one thread.
    ->Args({256, 16, 20, 0, 1})
    ->Args({256, 16, 20, 8, 1})
    ->Args({256, 16, 20, 16, 1})
    ->Args({256, 64, 5, 0, 1})
    ->Args({256, 64, 5, 8, 1})
    ->Args({256, 64, 5, 16, 1})
    ->Unit(benchmark::kMillisecond);

void BM_linear_fwd_bwd(benchmark::State& state) {
  sk::Context ctx({.seed = 3});
  run_flops(state, wl::linear_workload(ctx, state.range(0), state.range(1), state.range(2)));
}
BENCHMARK(BM_linear_fwd_bwd)
    ->ArgNames({"N", "in", "out"})
    ->Args({64, 512, 1000})   // ResNet-18 fc
    ->Args({64, 2048, 1000})  // ResNet-50 fc
    ->Unit(benchmark::kMillisecond);

// Pages the process touched for the first time (minor page faults), in MiB: after the warm-up
// step the host allocator's cache should serve every buffer, so the timed steps fault in little.
double faulted_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_minflt) * 4096.0 / double(1 << 20);
}

void BM_resnet18_train_step(benchmark::State& state) {
  sk::Context ctx({.seed = 4});
  auto w = wl::resnet18_step(ctx, state.range(0), state.range(1), state.range(1) <= 64 ? 10 : 1000,
                             state.range(2), static_cast<wl::ActivationLayout>(state.range(3)));
  const double before_warm_up = faulted_mib();
  w.run();
  const double before_timed = faulted_mib();
  bench::LoopClock clock;
  for (auto _ : state) w.run();
  state.counters["images_per_s"] = double(state.range(0)) / clock.seconds_per_iteration(state);
  state.counters["warm_up_faulted_MiB"] = before_timed - before_warm_up;
  state.counters["faulted_MiB_per_step"] =
      (faulted_mib() - before_timed) / double(state.iterations());
}
// The last argument: the activations' layout, NCHW (0), channels-last (1) or channel blocks (2)
// (autograd_workloads.hpp's ActivationLayout).
BENCHMARK(BM_resnet18_train_step)
    ->ArgNames({"batch", "HW", "width", "layout"})
    ->Args({32, 32, 64, 0})  // CIFAR-sized, small-image stem
    ->Args({32, 32, 64, 1})
    ->Args({32, 32, 64, 2})
    ->Args({8, 224, 64, 0})  // ImageNet-sized
    ->Args({8, 224, 64, 1})
    ->Args({8, 224, 64, 2})
    // The SwAV quick config's trunk shape: a quarter of the width on 20-pixel crops, where the
    // convolutions are narrow and reordering their operands costs most.
    ->Args({64, 20, 16, 0})
    ->Args({64, 20, 16, 1})
    ->Args({64, 20, 16, 2})
    // Host-bound: ResNet-18's 60 layers at 4 channels on 8x8 images, where the arithmetic is
    // next to nothing and a step's time is its ops' host work -- conv, batch-norm, ReLU and
    // additions inside modules, with their backward -- as on a GPU that outruns its host.
    ->Args({2, 8, 4, 0})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// ClassyVision's RegNetY-400MF (grouped 3 x 3 convolutions of 8 channels a group,
// squeeze-and-excitation in every block): its step against PyTorch's in compare_regnet_cpu.py.
void BM_regnet_y_400mf_train_step(benchmark::State& state) {
  sk::Context ctx({.seed = 4});
  auto w = wl::regnet_y_400mf_step(ctx, state.range(0), state.range(1),
                                   state.range(1) <= 64 ? 10 : 1000);
  w.run();
  bench::LoopClock clock;
  for (auto _ : state) w.run();
  state.counters["images_per_s"] = double(state.range(0)) / clock.seconds_per_iteration(state);
}
BENCHMARK(BM_regnet_y_400mf_train_step)
    ->ArgNames({"batch", "HW"})
    ->Args({32, 32})  // CIFAR-sized, res_stem_cifar
    ->Args({8, 224})  // ImageNet-sized
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

}  // namespace

BENCHMARK_MAIN();
