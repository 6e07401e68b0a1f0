// MPI backend (real processes, host memory), run under mpirun, e.g.
//   mpirun -np 2 --oversubscribe build/benchmarks/comm/bench_comm_mpi
// all_reduce, all_gather and reduce_scatter over 4 KiB .. 256 MiB with nccl-tests' algbw /
// busbw. Every rank runs the same benchmarks in the same order; rank 0 reports.
#include <benchmark/benchmark.h>

#include "comm_bench.hpp"
#include "shardkit/comm/mpi_communicator.hpp"

#if !(defined(SHARDKIT_WITH_MPI) && SHARDKIT_WITH_MPI)
#error "bench_comm_mpi.cpp needs SHARDKIT_WITH_MPI (Meson defines it when MPI is found)"
#endif

namespace sk = shardkit;
namespace comm = shardkit::comm;

namespace {

// Ranks other than 0 measure but print nothing.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  auto session = std::make_shared<comm::MpiSession>(&argc, &argv);
  sk::Context ctx;
  comm::MpiCommunicator world(ctx, session);
  // Every rank measures; rank 0's time is reported, and all ranks take the same so the state
  // loops stay in step.
  sk::bench::register_collectives(
      "mpi", world.size(), [&](comm::CollectiveKind kind, std::int64_t bytes) {
        double seconds =
            sk::bench::seconds_per_call(ctx, world, kind, bytes, sk::bench::iterations_for(bytes));
        world.broadcast(comm::Buffer(&seconds, 1, sk::DType::f64), 0).wait();
        return seconds;
      });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (world.rank() == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  return 0;
}
