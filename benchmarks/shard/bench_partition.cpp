// Partition balance and speed. Prints the imbalance (max load / mean load - 1) of ResNet-50's
// 161 parameter tensors for N = 2..64, ours (largest first) beside FairScale's unsorted greedy,
// then times the greedy partition of ResNet-50 and of a million parameters.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <vector>

#include "shardkit/shard/partition.hpp"
#include "workloads/resnet50_params.hpp"

namespace sk = shardkit;

namespace {

std::vector<std::int64_t> resnet50_sizes() {
  std::vector<std::int64_t> sizes;
  for (const auto& shape : sk::workloads::kResNet50Shapes) sizes.push_back(shape.numel());
  return sizes;
}

void print_imbalance_table() {
  const auto sizes = resnet50_sizes();
  std::printf("ResNet-50 (%zu tensors, %lld parameters): partition imbalance, max/mean - 1\n",
              sizes.size(), static_cast<long long>(sk::workloads::kResNet50Params));
  std::printf("%6s %14s %14s\n", "ranks", "ours (LPT) %", "FairScale %");
  for (int n : {2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64})
    std::printf("%6d %14.2f %14.2f\n", n, 100 * sk::shard::greedy_partition(sizes, n).imbalance(),
                100 * sk::shard::fairscale_partition(sizes, n).imbalance());
  std::printf("\n");
}

void BM_greedy_partition_resnet50(benchmark::State& state) {
  const auto sizes = resnet50_sizes();
  for (auto _ : state)
    benchmark::DoNotOptimize(sk::shard::greedy_partition(sizes, static_cast<int>(state.range(0))));
}

void BM_greedy_partition_million(benchmark::State& state) {
  std::mt19937_64 rng(1);
  std::vector<std::int64_t> sizes(1'000'000);
  for (auto& s : sizes) s = 1 + static_cast<std::int64_t>(rng() % 100000);
  for (auto _ : state)
    benchmark::DoNotOptimize(sk::shard::greedy_partition(sizes, static_cast<int>(state.range(0))));
  state.counters["params"] = static_cast<double>(sizes.size());
}

}  // namespace

BENCHMARK(BM_greedy_partition_resnet50)->Arg(8)->Arg(64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_greedy_partition_million)->Arg(8)->Arg(64)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  print_imbalance_table();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
