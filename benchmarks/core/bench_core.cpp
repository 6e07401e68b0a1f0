// Core tensor operations on the host against the memcpy ceiling: contiguous and strided copies,
// fill, Philox uniform fill, and the f32 -> bf16 cast. Bytes are the minimum each must move.
#include "bench_common.hpp"

#include <shardkit/shardkit.hpp>

namespace sk = shardkit;
namespace bench = shardkit::bench;

namespace {

constexpr std::int64_t kSide = 4096;  // 2^24 floats: 64 MiB, well beyond the caches
constexpr std::int64_t kCount = kSide * kSide;

void BM_memcpy_ceiling(benchmark::State& state) {
  const double bytes = static_cast<double>(kCount) * 4;
  sk::Context ctx;
  auto a = sk::full(ctx, {kCount}, sk::DType::f32, 1.0);
  auto b = sk::full(ctx, {kCount}, sk::DType::f32, 2.0);
  bench::LoopClock clock;
  for (auto _ : state) {
    std::memcpy(b.data_ptr(), a.data_ptr(), b.nbytes());
    benchmark::ClobberMemory();
  }
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 2 * bytes,
                          bench::host_copy_bytes_per_second(a.nbytes()));
}

void BM_copy_contiguous(benchmark::State& state) {
  sk::Context ctx({.seed = 1});
  auto src = sk::empty(ctx, {kCount}, sk::DType::f32);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kCount}, sk::DType::f32);
  bench::LoopClock clock;
  for (auto _ : state) sk::copy(ctx, dst, src);
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 2.0 * kCount * 4,
                          bench::host_copy_bytes_per_second(src.nbytes()));
}

void BM_copy_transposed(benchmark::State& state) {
  sk::Context ctx({.seed = 1});
  auto src = sk::empty(ctx, {kSide, kSide}, sk::DType::f32);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kSide, kSide}, sk::DType::f32);
  const auto view = src.transpose(0, 1);
  bench::LoopClock clock;
  for (auto _ : state) sk::copy(ctx, dst, view);
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 2.0 * kCount * 4,
                          bench::host_copy_bytes_per_second(src.nbytes()));
}

void BM_fill(benchmark::State& state) {
  sk::Context ctx;
  auto t = sk::zeros(ctx, {kCount}, sk::DType::f32);
  bench::LoopClock clock;
  for (auto _ : state) sk::fill(ctx, t, 0.5);
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 1.0 * kCount * 4,
                          bench::host_copy_bytes_per_second(t.nbytes()));
}

void BM_uniform(benchmark::State& state) {
  sk::Context ctx({.seed = 3});
  auto t = sk::zeros(ctx, {kCount}, sk::DType::f32);
  bench::LoopClock clock;
  for (auto _ : state) sk::uniform_(ctx, t, -1, 1);
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 1.0 * kCount * 4,
                          bench::host_copy_bytes_per_second(t.nbytes()));
}

void BM_cast_f32_to_bf16(benchmark::State& state) {
  sk::Context ctx({.seed = 4});
  auto src = sk::empty(ctx, {kCount}, sk::DType::f32);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kCount}, sk::DType::bf16);
  bench::LoopClock clock;
  for (auto _ : state) sk::copy(ctx, dst, src);
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), 6.0 * kCount,
                          bench::host_copy_bytes_per_second(src.nbytes()));
}

}  // namespace

BENCHMARK(BM_memcpy_ceiling)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_copy_contiguous)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_copy_transposed)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_fill)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_uniform)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_cast_f32_to_bf16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
