// The SwAV trainer's kNN evaluation (samples/swav/knn.cpp) against a ceiling measured in the
// same run: the same similarity product as one oneDNN sgemm call on the same threads, without
// the vote. The floor is that product, 2 * queries * bank * dim flops; the vote reads each
// similarity once more. A bank of 60 000 rows (Fashion-MNIST's training set) and 2 048 queries
// (a fifth of its test set), at the feature widths the shipped configs read.
//
//   build/benchmarks/swav/bench_knn      (SHARDKIT_NUM_THREADS sets the threads)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "bench_common.hpp"
#include "knn.hpp"
#include "shardkit/core/config.hpp"
#include "shardkit/core/thread_pool.hpp"
#if SK_WITH_DNNL
#include <omp.h>

#include "shardkit/core/dnnl_check.hpp"
#endif

namespace {

constexpr std::int64_t kBank = 60000, kQueries = 2048;

struct Features {
  std::vector<float> bank, queries;
  std::vector<std::int32_t> bank_labels, query_labels;
};

// Random unit rows and labels (never zeros: the vote's time depends on how often a similarity
// displaces one of the k best).
Features features(std::int64_t dim) {
  std::mt19937_64 rng(1234 + static_cast<std::uint64_t>(dim));
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> label(0, 9);
  Features f;
  f.bank.resize(static_cast<std::size_t>(kBank * dim));
  f.queries.resize(static_cast<std::size_t>(kQueries * dim));
  for (auto& v : f.bank) v = normal(rng);
  for (auto& v : f.queries) v = normal(rng);
  swav::l2_normalize_rows(f.bank, dim);
  swav::l2_normalize_rows(f.queries, dim);
  for (std::int64_t i = 0; i < kBank; ++i)
    f.bank_labels.push_back(static_cast<std::int32_t>(label(rng)));
  for (std::int64_t i = 0; i < kQueries; ++i)
    f.query_labels.push_back(static_cast<std::int32_t>(label(rng)));
  return f;
}

// Seconds for the whole queries x bank product as one oneDNN sgemm on `threads` threads (the
// median of 3 after a warm-up); 0 in builds without oneDNN.
double product_seconds(const Features& f, std::int64_t dim, int threads) {
#if SK_WITH_DNNL
  std::vector<float> out(static_cast<std::size_t>(kQueries * kBank));
  omp_set_num_threads(threads);
  std::vector<double> seconds;
  for (int i = 0; i < 4; ++i) {
    const auto start = std::chrono::steady_clock::now();
    SK_DNNL_CHECK(dnnl_sgemm('N', 'T', kQueries, kBank, dim, 1.0f, f.queries.data(), dim,
                             f.bank.data(), dim, 0.0f, out.data(), kBank));
    benchmark::DoNotOptimize(out.data());
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (i > 0) seconds.push_back(elapsed.count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
#else
  (void)f, (void)dim, (void)threads;
  return 0;
#endif
}

void BM_knn(benchmark::State& state) {
  const std::int64_t dim = state.range(0);
  const int threads = shardkit::default_cpu_threads();
  const Features f = features(dim);
  shardkit::ThreadPool pool(threads);
  // One untimed evaluation first: at large dims a run may time a single iteration, and the
  // ceiling drops its own first run too.
  std::int64_t correct = swav::knn_correct(f.bank, f.bank_labels, f.queries, f.query_labels, dim, 0,
                                           kQueries, 20, 0.07, pool);
  benchmark::DoNotOptimize(correct);
  shardkit::bench::LoopClock clock;
  for (auto _ : state) {
    correct = swav::knn_correct(f.bank, f.bank_labels, f.queries, f.query_labels, dim, 0, kQueries,
                                20, 0.07, pool);
    benchmark::DoNotOptimize(correct);
  }
  const double seconds = clock.seconds_per_iteration(state);
  const double flops = 2.0 * kQueries * kBank * dim;
  state.counters["threads"] = threads;
  state.counters["GFLOPs"] = flops / seconds / 1e9;
  state.counters["ms_per_eval"] = seconds * 1e3;
  if (const double ceiling = product_seconds(f, dim, threads); ceiling > 0) {
    state.counters["ceiling_GFLOPs"] = flops / ceiling / 1e9;
    state.counters["pct_of_product"] = 100.0 * ceiling / seconds;
  }
}
// res5avg of the quick configs (128), res3 / res5 of the long one (1152), res4 of the GPU one
// (9216).
BENCHMARK(BM_knn)->Arg(128)->Arg(1152)->Arg(9216)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
