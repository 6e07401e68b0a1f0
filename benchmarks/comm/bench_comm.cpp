// Local backend (N thread-ranks of one process, host memory): all_reduce, all_gather and
// reduce_scatter over 4 KiB .. 256 MiB with nccl-tests' algbw / busbw.
#include <benchmark/benchmark.h>

#include "comm_bench.hpp"
#include "shardkit/comm/run_ranks.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

int main(int argc, char** argv) {
  for (int ranks : {2, 4})
    sk::bench::register_collectives(
        "local", ranks, [ranks](comm::CollectiveKind kind, std::int64_t bytes) {
          double seconds = 0;
          comm::run_ranks(ranks, [&](sk::Context& ctx, comm::Communicator& c) {
            const double s =
                sk::bench::seconds_per_call(ctx, c, kind, bytes, sk::bench::iterations_for(bytes));
            if (c.rank() == 0) seconds = s;
          });
          return seconds;
        });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
