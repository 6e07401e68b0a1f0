// Core tensor kernels on the GPU against the device-to-device copy ceiling measured in the same
// run (cudaMemcpyAsync): fill, strided copy, Philox uniform fill, f32 -> bf16 cast.
// Timed with CUDA events (manual time). Part of bench_gpu (bench_gpu_main.cu).
#include "bench_common_gpu.hpp"

#include <cstdio>

namespace sk = shardkit;
namespace bench = shardkit::bench;

namespace core_gpu {

constexpr std::int64_t kSide = 16384;  // 2^28 floats: 1 GiB per buffer, far beyond the L2
constexpr std::int64_t kCount = kSide * kSide;

struct Buffers {
  std::unique_ptr<sk::Context> ctx = sk::make_cuda_context(0, 0, 5);
  sk::Tensor a = sk::empty(*ctx, {kSide, kSide}, sk::DType::f32);
  sk::Tensor b = sk::empty(*ctx, {kSide, kSide}, sk::DType::f32);
  sk::Tensor half = sk::empty(*ctx, {kSide, kSide}, sk::DType::bf16);
  Buffers() {
    sk::uniform_(*ctx, a, -1, 1);
    sk::uniform_(*ctx, b, -1, 1);
  }
  double ceiling() { return bench::device_copy_bytes_per_second(*ctx, a.nbytes()); }
};

Buffers& buffers() {
  static Buffers instance;
  return instance;
}

void BM_gpu_memcpy_ceiling(benchmark::State& state) {
  auto& s = buffers();
  const double seconds = bench::time_on_stream(state, *s.ctx, [&] {
    SK_CUDA_CHECK(cudaMemcpyAsync(s.b.data_ptr(), s.a.data_ptr(), s.a.nbytes(),
                                  cudaMemcpyDeviceToDevice, s.ctx->stream()));
  });
  bench::report_bandwidth(state, seconds, 8.0 * kCount, s.ceiling());
}

void BM_gpu_fill(benchmark::State& state) {
  auto& s = buffers();
  const double seconds = bench::time_on_stream(state, *s.ctx, [&] { sk::fill(*s.ctx, s.b, 0.25); });
  bench::report_bandwidth(state, seconds, 4.0 * kCount, s.ceiling());
}

void BM_gpu_copy_transposed(benchmark::State& state) {
  auto& s = buffers();
  const auto view = s.a.transpose(0, 1);
  const double seconds = bench::time_on_stream(state, *s.ctx, [&] { sk::copy(*s.ctx, s.b, view); });
  bench::report_bandwidth(state, seconds, 8.0 * kCount, s.ceiling());
}

void BM_gpu_uniform(benchmark::State& state) {
  auto& s = buffers();
  const double seconds =
      bench::time_on_stream(state, *s.ctx, [&] { sk::uniform_(*s.ctx, s.b, -1, 1); });
  bench::report_bandwidth(state, seconds, 4.0 * kCount, s.ceiling());
}

void BM_gpu_tensor_cast_f32_to_bf16(benchmark::State& state) {
  auto& s = buffers();
  const double seconds =
      bench::time_on_stream(state, *s.ctx, [&] { sk::copy(*s.ctx, s.half, s.a); });
  bench::report_bandwidth(state, seconds, 6.0 * kCount, s.ceiling());
}

BENCHMARK(BM_gpu_memcpy_ceiling)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_fill)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_copy_transposed)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_uniform)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_gpu_tensor_cast_f32_to_bf16)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace core_gpu
