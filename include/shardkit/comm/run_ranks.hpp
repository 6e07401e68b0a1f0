// run_ranks(N, fn): runs fn(ctx, comm) on N threads, one per rank, each with its own Context
// and a LocalCommunicator of one shared world. How tests, benchmarks and samples get N ranks
// without a cluster.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "shardkit/comm/local_communicator.hpp"
#include "shardkit/core/context.hpp"

namespace shardkit::comm {

struct RunRanksOptions {
  Device device = Device::cpu();  // every rank's context; ranks share a GPU
  // The contexts' device-code tables (needed for a CUDA device; the comm table reduces device
  // memory): sk::comm::cuda_run_options from <shardkit/cuda.hpp> fills them.
  CudaKernelTables kernels{};
  CommOptions comm;
  std::uint64_t seed = 0;  // rank r's context is seeded seed + r
  // Each rank's CPU threads; 0: an equal share of default_cpu_threads(), at least 1, so the
  // ranks together use the machine's threads once.
  int cpu_threads_per_rank = 0;
};

// The CPU threads each of `ranks` local ranks gets under `options`.
inline int cpu_threads_per_rank(int ranks, const RunRanksOptions& options = {}) {
  return options.cpu_threads_per_rank > 0 ? options.cpu_threads_per_rank
                                          : std::max(1, default_cpu_threads() / ranks);
}

// Returns when every rank has returned. When a rank throws, the world is aborted at once (the
// others fail fast instead of waiting for the timeout) and, after all ranks end, the first
// error by rank that is not a consequence of that abort is rethrown.
template <class Fn>
void run_ranks(int n, Fn&& fn, const RunRanksOptions& options = {}) {
  check(n >= 1, "run_ranks needs at least 1 rank, got ", n);
  auto world = std::make_shared<LocalWorld>(n, options.kernels.comm);
  const int cpu_threads = cpu_threads_per_rank(n, options);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<char> secondary(static_cast<std::size_t>(n), 0);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto index = static_cast<std::size_t>(r);
      try {
        Context ctx(ContextOptions{options.device, r, options.seed + static_cast<std::uint64_t>(r),
                                   options.kernels, cpu_threads});
        LocalCommunicator comm(ctx, world, r, options.comm);
        fn(ctx, static_cast<Communicator&>(comm));
      } catch (const CommunicatorAborted& e) {
        // A consequence of another rank's failure (reported after the first cause), or of this
        // rank's own -- a Work it dropped, a call out of step: the world is aborted either way,
        // for the others would otherwise wait for this rank until their timeout.
        errors[index] = std::current_exception();
        secondary[index] = 1;
        world->abort(shardkit::detail::concat("rank ", r, " ended: ", e.what()));
      } catch (const std::exception& e) {
        errors[index] = std::current_exception();
        world->abort(shardkit::detail::concat("rank ", r, " failed: ", e.what()));
      } catch (...) {
        errors[index] = std::current_exception();
        world->abort(shardkit::detail::concat("rank ", r, " failed with a non-standard exception"));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t r = 0; r < errors.size(); ++r)
      if (errors[r] && (pass == 1 || !secondary[r])) std::rethrow_exception(errors[r]);
}

}  // namespace shardkit::comm
