// bench_gpu: every layer's GPU benchmarks in one executable, compiled as one nvcc translation
// unit (a unity build, like test_gpu): the kernels and the library's host code are compiled
// once instead of once per layer, which is most of a GPU benchmark's build time. The benchmarks
// live beside their CPU twins (core/, ops/, comm/, autograd/, parallel/) and register
// themselves; select with --benchmark_filter (e.g. 'BM_gpu_larc', 'nccl', 'resnet18').
// Exits 0 with a note when no GPU is usable.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

int main(int argc, char** argv) {
  if (shardkit::cuda_device_count() == 0) {
    std::printf("no usable CUDA GPU: GPU benchmarks not run\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
