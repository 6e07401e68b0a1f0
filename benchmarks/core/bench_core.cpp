// Core tensor operations on the host against a memcpy on the same number of threads, measured
// just before each benchmark: contiguous and strided copies, fill, Philox uniform and normal
// fills, casts between f32 and bf16/f16; on 1 thread and on every hardware thread. Bytes are
// the minimum each must move. benchmarks/run tabulates them.
#include "bench_common.hpp"

#include <map>
#include <memory>

#include <shardkit/shardkit.hpp>

namespace sk = shardkit;
namespace bench = shardkit::bench;

namespace {

constexpr std::int64_t kSide = 4096;  // 2^24 floats: 64 MiB, well beyond the caches
constexpr std::int64_t kCount = kSide * kSide;

// One context per thread count, so each benchmark runs on the threads its name says.
sk::Context& context(int threads) {
  static std::map<int, std::unique_ptr<sk::Context>> cache;
  auto& slot = cache[threads];
  if (!slot)
    slot = std::make_unique<sk::Context>(sk::ContextOptions{.seed = 1, .cpu_threads = threads});
  return *slot;
}

int threads_of(const benchmark::State& state) { return static_cast<int>(state.range(0)); }

// Runs `op` as the benchmark loop; `bytes` is what it must move at least, reported against a
// memcpy of the same size on the same number of threads, measured just before.
template <class Op>
void run(benchmark::State& state, double bytes, std::size_t copy_bytes, Op&& op) {
  const double ceiling = bench::host_copy_bytes_per_second(copy_bytes, threads_of(state));
  op();  // warm-up
  bench::LoopClock clock;
  for (auto _ : state) {
    op();
    benchmark::ClobberMemory();
  }
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), bytes, ceiling);
}

void BM_copy_contiguous(benchmark::State& state) {
  auto& ctx = context(threads_of(state));
  auto src = sk::empty(ctx, {kCount}, sk::DType::f32);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kCount}, sk::DType::f32);
  run(state, 2.0 * kCount * 4, src.nbytes(), [&] { sk::copy(ctx, dst, src); });
}

void BM_copy_transposed(benchmark::State& state) {
  auto& ctx = context(threads_of(state));
  auto src = sk::empty(ctx, {kSide, kSide}, sk::DType::f32);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kSide, kSide}, sk::DType::f32);
  const auto view = src.transpose(0, 1);
  run(state, 2.0 * kCount * 4, src.nbytes(), [&] { sk::copy(ctx, dst, view); });
}

void BM_fill(benchmark::State& state) {
  auto& ctx = context(threads_of(state));
  auto t = sk::zeros(ctx, {kCount}, sk::DType::f32);
  run(state, 1.0 * kCount * 4, t.nbytes(), [&] { sk::fill(ctx, t, 0.5); });
}

void BM_uniform(benchmark::State& state) {
  auto& ctx = context(threads_of(state));
  auto t = sk::zeros(ctx, {kCount}, sk::DType::f32);
  run(state, 1.0 * kCount * 4, t.nbytes(), [&] { sk::uniform_(ctx, t, -1, 1); });
}

void BM_normal(benchmark::State& state) {
  auto& ctx = context(threads_of(state));
  auto t = sk::zeros(ctx, {kCount}, sk::DType::f32);
  run(state, 1.0 * kCount * 4, t.nbytes(), [&] { sk::normal_(ctx, t, 0, 1); });
}

// Tensor casts (sk::cast / sk::copy between dtypes), as autograd's mixed precision uses them.
void BM_cast(benchmark::State& state, sk::DType from, sk::DType to) {
  auto& ctx = context(threads_of(state));
  auto src = sk::empty(ctx, {kCount}, from);
  sk::uniform_(ctx, src, -1, 1);
  auto dst = sk::zeros(ctx, {kCount}, to);
  const double bytes =
      static_cast<double>(kCount) * static_cast<double>(sk::dtype_size(from) + sk::dtype_size(to));
  run(state, bytes, src.nbytes(), [&] { sk::copy(ctx, dst, src); });
}

void BM_cast_f32_to_bf16(benchmark::State& state) {
  BM_cast(state, sk::DType::f32, sk::DType::bf16);
}
void BM_cast_f32_to_f16(benchmark::State& state) { BM_cast(state, sk::DType::f32, sk::DType::f16); }
void BM_cast_f16_to_f32(benchmark::State& state) { BM_cast(state, sk::DType::f16, sk::DType::f32); }

// threads: 1 and every hardware thread (SHARDKIT_NUM_THREADS).
void threads(benchmark::internal::Benchmark* b) {
  const int all = sk::default_cpu_threads();
  b->ArgNames({"threads"})->Arg(1);
  if (all > 1) b->Arg(all);
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_copy_contiguous)->Apply(threads);
BENCHMARK(BM_copy_transposed)->Apply(threads);
BENCHMARK(BM_fill)->Apply(threads);
BENCHMARK(BM_uniform)->Apply(threads);
BENCHMARK(BM_normal)->Apply(threads);
BENCHMARK(BM_cast_f32_to_bf16)->Apply(threads);
BENCHMARK(BM_cast_f32_to_f16)->Apply(threads);
BENCHMARK(BM_cast_f16_to_f32)->Apply(threads);
BENCHMARK_MAIN();
