// Core tensor kernels on the GPU against the device-to-device copy ceiling measured in the same
// run (cudaMemcpyAsync): fill, strided copy, Philox uniform fill, f32 -> bf16 cast.
// Timed with CUDA events (manual time). Exits 0 with a note when no GPU is usable.
#include "bench_common.hpp"

#include <cstdio>

#include "kernels/shardkit_cuda.cuh"

namespace sk = shardkit;
namespace bench = shardkit::bench;

namespace {

constexpr std::int64_t kSide = 16384;  // 2^28 floats: 1 GiB per buffer, far beyond the L2
constexpr std::int64_t kCount = kSide * kSide;

// Times `op` with CUDA events on the context's stream, one iteration per benchmark iteration.
template <class Op>
void time_on_stream(benchmark::State& state, sk::Context& ctx, Op&& op) {
  cudaEvent_t start, stop;
  SK_CUDA_CHECK(cudaEventCreate(&start));
  SK_CUDA_CHECK(cudaEventCreate(&stop));
  op();  // warm-up
  for (auto _ : state) {
    SK_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    op();
    SK_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    SK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
  }
  SK_CUDA_CHECK(cudaEventDestroy(start));
  SK_CUDA_CHECK(cudaEventDestroy(stop));
}

// Device copy ceiling (bytes read + written per second), measured once per run.
double device_copy_ceiling(sk::Context& ctx, const sk::Tensor& a, const sk::Tensor& b) {
  static double ceiling = 0;
  if (ceiling > 0) return ceiling;
  cudaEvent_t start, stop;
  SK_CUDA_CHECK(cudaEventCreate(&start));
  SK_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 11; ++i) {
    SK_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    SK_CUDA_CHECK(cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), a.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream()));
    SK_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    SK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) times.push_back(ms);
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  ceiling = 2.0 * static_cast<double>(a.nbytes()) / (times[times.size() / 2] / 1e3);
  SK_CUDA_CHECK(cudaEventDestroy(start));
  SK_CUDA_CHECK(cudaEventDestroy(stop));
  return ceiling;
}

struct Buffers {
  std::unique_ptr<sk::Context> ctx = sk::make_cuda_context(0, 0, 5);
  sk::Tensor a = sk::empty(*ctx, {kSide, kSide}, sk::DType::f32);
  sk::Tensor b = sk::empty(*ctx, {kSide, kSide}, sk::DType::f32);
  sk::Tensor half = sk::empty(*ctx, {kSide, kSide}, sk::DType::bf16);
  Buffers() {
    sk::uniform_(*ctx, a, -1, 1);
    sk::uniform_(*ctx, b, -1, 1);
  }
  double ceiling() { return device_copy_ceiling(*ctx, a, b); }
};

Buffers& buffers() {
  static Buffers instance;
  return instance;
}

void BM_gpu_memcpy_ceiling(benchmark::State& state) {
  auto& s = buffers();
  time_on_stream(state, *s.ctx, [&] {
    SK_CUDA_CHECK(cudaMemcpyAsync(s.b.data_ptr(), s.a.data_ptr(), s.a.nbytes(), cudaMemcpyDeviceToDevice, s.ctx->stream()));
  });
  bench::report_bandwidth(state, 8.0 * kCount, s.ceiling());
}

void BM_gpu_fill(benchmark::State& state) {
  auto& s = buffers();
  time_on_stream(state, *s.ctx, [&] { sk::fill(*s.ctx, s.b, 0.25); });
  bench::report_bandwidth(state, 4.0 * kCount, s.ceiling());
}

void BM_gpu_copy_transposed(benchmark::State& state) {
  auto& s = buffers();
  const auto view = s.a.transpose(0, 1);
  time_on_stream(state, *s.ctx, [&] { sk::copy(*s.ctx, s.b, view); });
  bench::report_bandwidth(state, 8.0 * kCount, s.ceiling());
}

void BM_gpu_uniform(benchmark::State& state) {
  auto& s = buffers();
  time_on_stream(state, *s.ctx, [&] { sk::uniform_(*s.ctx, s.b, -1, 1); });
  bench::report_bandwidth(state, 4.0 * kCount, s.ceiling());
}

void BM_gpu_cast_f32_to_bf16(benchmark::State& state) {
  auto& s = buffers();
  time_on_stream(state, *s.ctx, [&] { sk::copy(*s.ctx, s.half, s.a); });
  bench::report_bandwidth(state, 6.0 * kCount, s.ceiling());
}

}  // namespace

BENCHMARK(BM_gpu_memcpy_ceiling)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_fill)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_copy_transposed)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_uniform)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_cast_f32_to_bf16)->UseManualTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  if (sk::cuda_device_count() == 0) {
    std::printf("no usable CUDA GPU: GPU benchmarks not run\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
