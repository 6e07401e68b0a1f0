// comm on a CUDA GPU: the local backend with 2 thread-ranks sharing GPU 0 (device copies plus
// the reduction kernel) and NCCL at world size 1 (its busbw is 0 by definition: nothing leaves
// the rank; algbw shows the cost of the call). Times a batch between stream synchronisations
// (the same loop as the CPU benchmarks); prints a note and exits 0 without a GPU.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "comm_bench.hpp"
#include "kernels/shardkit_cuda.cuh"

namespace sk = shardkit;
namespace comm = shardkit::comm;

int main(int argc, char** argv) {
  if (sk::cuda_device_count() == 0) {
    std::printf("no usable CUDA GPU: nothing to benchmark\n");
    return 0;
  }
  auto nccl_ctx = sk::make_cuda_context(0);
  comm::NcclCommunicator nccl(*nccl_ctx, comm::NcclCommunicator::unique_id(), 0, 1);
  for (comm::CollectiveKind kind : sk::bench::kBenchKinds) {
    for (std::int64_t bytes : sk::bench::message_sizes()) {
      benchmark::RegisterBenchmark(sk::bench::bench_name("local_gpu", kind, 2).c_str(),
                                   [=](benchmark::State& state) {
                                     double seconds = 0;
                                     comm::run_ranks(
                                         2,
                                         [&](sk::Context& ctx, comm::Communicator& c) {
                                           const double s = sk::bench::seconds_per_call(
                                               ctx, c, kind, bytes,
                                               sk::bench::iterations_for(bytes));
                                           if (c.rank() == 0) seconds = s;
                                         },
                                         comm::cuda_run_options(0));
                                     sk::bench::report_collective(state, kind, bytes, 2, seconds);
                                   })
          ->Arg(bytes)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(sk::bench::bench_name("nccl", kind, 1).c_str(),
                                   [&, kind, bytes](benchmark::State& state) {
                                     const double seconds = sk::bench::seconds_per_call(
                                         *nccl_ctx, nccl, kind, bytes,
                                         sk::bench::iterations_for(bytes));
                                     sk::bench::report_collective(state, kind, bytes, 1, seconds);
                                   })
          ->Arg(bytes)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
