// comm on a CUDA GPU: the local backend with 2 thread-ranks sharing GPU 0 (device copies plus
// the reduction kernel) and NCCL at world size 1 (its busbw is 0 by definition: nothing leaves
// the rank; algbw shows the cost of the call). Times a batch between stream synchronisations
// (the same loop as the CPU benchmarks). Part of bench_gpu (bench_gpu_main.cu).
#include <benchmark/benchmark.h>

#include <memory>

#include "bench_common_gpu.hpp"
#include "comm_bench.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

namespace comm_gpu {

// NCCL at world size 1 on GPU 0, made when the first NCCL benchmark runs (so that a run
// filtered to other benchmarks never initialises NCCL) and kept for the rest of the run.
struct NcclRank {
  std::unique_ptr<sk::Context> ctx = sk::make_cuda_context(0);
  comm::NcclCommunicator nccl{*ctx, comm::NcclCommunicator::unique_id(), 0, 1};
};

NcclRank& nccl_rank() {
  static NcclRank rank;
  return rank;
}

// Registered before main (as BENCHMARK does): one local and one NCCL benchmark per collective
// and message size.
bool register_benchmarks() {
  for (comm::CollectiveKind kind : sk::bench::kBenchKinds) {
    for (std::int64_t bytes : sk::bench::message_sizes()) {
      benchmark::RegisterBenchmark(
          sk::bench::bench_name("local_gpu", kind, 2).c_str(),
          [=](benchmark::State& state) {
            double seconds = 0;
            comm::run_ranks(
                2,
                [&](sk::Context& ctx, comm::Communicator& c) {
                  const double s = sk::bench::seconds_per_call(ctx, c, kind, bytes,
                                                               sk::bench::iterations_for(bytes));
                  if (c.rank() == 0) seconds = s;
                },
                comm::cuda_run_options(0));
            sk::bench::report_collective(state, kind, bytes, 2, seconds,
                                         sk::bench::device_copy_bytes_per_second(
                                             *nccl_rank().ctx, static_cast<std::size_t>(bytes)));
          })
          ->Arg(bytes)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(
          sk::bench::bench_name("nccl", kind, 1).c_str(),
          [=](benchmark::State& state) {
            auto& rank = nccl_rank();
            const double seconds = sk::bench::seconds_per_call(*rank.ctx, rank.nccl, kind, bytes,
                                                               sk::bench::iterations_for(bytes));
            sk::bench::report_collective(state, kind, bytes, 1, seconds,
                                         sk::bench::device_copy_bytes_per_second(
                                             *rank.ctx, static_cast<std::size_t>(bytes)));
          })
          ->Arg(bytes)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  return true;
}

[[maybe_unused]] const bool registered = register_benchmarks();

}  // namespace comm_gpu
