// GPU benchmark helpers: timing with CUDA events (manual time) and the device copy ceiling
// measured in the same run.
#pragma once

#include <algorithm>
#include <map>
#include <vector>

#include "bench_common.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace shardkit::bench {

// Times `op` with CUDA events on the context's stream, one op per benchmark iteration, after
// one warm-up call; returns the mean seconds per iteration (for report_bandwidth).
template <class Op>
double time_on_stream(benchmark::State& state, Context& ctx, Op&& op) {
  cudaEvent_t start, stop;
  SK_CUDA_CHECK(cudaEventCreate(&start));
  SK_CUDA_CHECK(cudaEventCreate(&stop));
  op();
  // Every timed iteration starts on an idle stream: left running, the warm-up would hide the
  // first iteration's host launches behind its kernels (launch-bound rows read faster).
  ctx.synchronize();
  double total_seconds = 0;
  for (auto _ : state) {
    SK_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    op();
    SK_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    SK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms / 1e3);
    total_seconds += ms / 1e3;
  }
  SK_CUDA_CHECK(cudaEventDestroy(start));
  SK_CUDA_CHECK(cudaEventDestroy(stop));
  return total_seconds /
         static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
}

// Device-to-device copy bandwidth of `bytes` (read + write counted), median of 10 timed copies
// after a warm-up; cached per size for the run.
inline double device_copy_bytes_per_second(Context& ctx, std::size_t bytes) {
  static std::map<std::size_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  auto a = empty(ctx, {static_cast<std::int64_t>(bytes)}, DType::u8);
  auto b = empty(ctx, {static_cast<std::int64_t>(bytes)}, DType::u8);
  cudaEvent_t start, stop;
  SK_CUDA_CHECK(cudaEventCreate(&start));
  SK_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 11; ++i) {
    SK_CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
    SK_CUDA_CHECK(
        cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
    SK_CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
    SK_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SK_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0) times.push_back(ms);
  }
  SK_CUDA_CHECK(cudaEventDestroy(start));
  SK_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return cache[bytes] = 2.0 * static_cast<double>(bytes) / (times[times.size() / 2] / 1e3);
}

}  // namespace shardkit::bench
