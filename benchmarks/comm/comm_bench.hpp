// Shared pieces of the collective benchmarks: message sizes 4 KiB .. 256 MiB, the timed loop
// (nccl-tests style: a warm-up call, then a batch of back-to-back calls between barriers,
// divided by the batch size), and the counters: algbw = S / t and busbw = algbw x nccl-tests'
// factor (2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter), S being the
// message size as comm_stats.hpp defines it (all_gather: the gathered output; reduce_scatter:
// the input). GBps / pct_of_copy (bench_common.hpp) report the bus bytes against a copy of the
// memory the ranks use (host memcpy; device-to-device for the GPU rows).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::bench {

namespace comm = shardkit::comm;

inline const std::vector<std::int64_t>& message_sizes() {
  static const std::vector<std::int64_t> sizes = {4 << 10,  64 << 10, 1 << 20,
                                                  16 << 20, 64 << 20, 256 << 20};
  return sizes;
}

// Enough calls to move about 1 GiB per measurement, between 3 and 200.
inline int iterations_for(std::int64_t bytes) {
  return static_cast<int>(std::clamp<std::int64_t>((std::int64_t{1} << 30) / bytes, 3, 200));
}

inline constexpr comm::CollectiveKind kBenchKinds[] = {comm::CollectiveKind::all_reduce,
                                                       comm::CollectiveKind::all_gather,
                                                       comm::CollectiveKind::reduce_scatter};

// Seconds per call of `kind` with message size `bytes` (f32) on this rank. `sync` waits for the
// rank's device work (a no-op on the CPU); device timing then covers the whole batch.
inline double seconds_per_call(Context& ctx, comm::Communicator& c, comm::CollectiveKind kind,
                               std::int64_t bytes, int iterations) {
  const std::int64_t n = c.size();
  const std::int64_t total = std::max<std::int64_t>(bytes / 4 / n * n, n);  // divisible by n
  const std::int64_t piece = total / n;
  Tensor big = full(ctx, {total}, DType::f32, 1.0, MemoryCategory::communication);
  Tensor other = full(ctx, {kind == comm::CollectiveKind::all_reduce ? total : piece}, DType::f32,
                      1.0, MemoryCategory::communication);
  auto call = [&] {
    switch (kind) {
      case comm::CollectiveKind::all_reduce:
        return c.all_reduce(big, other, comm::ReduceOp::sum);
      case comm::CollectiveKind::all_gather:
        return c.all_gather(other, big);
      default:
        return c.reduce_scatter(big, other, comm::ReduceOp::sum);
    }
  };
  call().wait();
  ctx.synchronize();
  c.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) call().wait();
  ctx.synchronize();
  c.barrier();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
         iterations;
}

// Feeds the measured time to Google Benchmark (manual time) and adds the counters; pct_of_copy
// is the bus bytes' rate against `copy_ceiling` (bytes read + written per second) of the memory
// the collective moves: a host memcpy for the host backends, a device copy for the GPU's.
inline void report_collective(benchmark::State& state, comm::CollectiveKind kind,
                              std::int64_t bytes, int ranks, double seconds, double copy_ceiling) {
  for (auto _ : state) state.SetIterationTime(seconds);
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  state.counters["ranks"] = ranks;
  state.counters["size_bytes"] = static_cast<double>(bytes);
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * comm::bus_factor(kind, ranks).value();
  report_bandwidth(
      state, seconds,
      static_cast<double>(bytes) * std::max(comm::bus_factor(kind, ranks).value(), 1e-9),
      copy_ceiling);
}

inline std::string bench_name(std::string_view backend, comm::CollectiveKind kind, int ranks) {
  return std::string(backend) + "/" + std::string(comm::collective_name(kind)) +
         "/ranks:" + std::to_string(ranks);
}

// Registers one benchmark per collective kind and message size for `backend` at `ranks` ranks;
// `seconds_per(kind, bytes)` runs the collective on every rank and returns the time per call
// that rank 0 measured.
template <class SecondsPer>
void register_collectives(std::string_view backend, int ranks, SecondsPer seconds_per) {
  for (comm::CollectiveKind kind : kBenchKinds)
    for (std::int64_t bytes : message_sizes())
      benchmark::RegisterBenchmark(
          bench_name(backend, kind, ranks).c_str(),
          [=](benchmark::State& state) {
            report_collective(state, kind, bytes, ranks, seconds_per(kind, bytes),
                              host_copy_bytes_per_second(static_cast<std::size_t>(bytes)));
          })
          ->Arg(bytes)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
}

}  // namespace shardkit::bench
