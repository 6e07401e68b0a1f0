// Processes launched side by side on the CPU (mpirun): one verdict on the config. Each process
// checks its own machine (check_ranks_fit) -- with a rank's step measured once, by rank 0 while
// the others wait (step_memory.hpp's measure_step_memory_once) -- and a refusal by any process is
// the refusal of all: a process refusing alone would leave the others waiting for it in their
// first collective.
#pragma once

#include <exception>
#include <span>
#include <string>
#include <vector>

#include "config_tree.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/context.hpp"
#include "swav_loss.hpp"

namespace swav {

// Another rank refused the config; its message is that rank's (said once, by that rank).
struct RefusedElsewhere : ConfigError {
  explicit RefusedElsewhere(int rank)
      : ConfigError("rank " + std::to_string(rank) +
                    " refused the config (its message above); no rank started"),
        refusing_rank(rank) {}
  int refusing_rank;
};

// Runs `check` (which refuses with a ConfigError) on every rank of `comm` and agrees on the
// verdict: the lowest refusing rank rethrows its refusal, the others throw RefusedElsewhere.
// What `check` returns where no rank refused.
template <class Check>
auto agreed_check(sk::Context& ctx, sk::comm::Communicator& comm, Check&& check) {
  decltype(check()) result{};
  std::exception_ptr refused;
  try {
    result = check();
  } catch (const ConfigError&) {
    refused = std::current_exception();
  }
  // The lowest refusing rank r as the largest size - r (0 from the ranks that did not refuse).
  std::vector<double> lowest{refused ? double(comm.size() - comm.rank()) : 0.0};
  all_reduce_host(ctx, comm, std::span<double>(lowest), sk::comm::ReduceOp::max);
  const int first = comm.size() - static_cast<int>(lowest[0]);
  if (first == comm.rank()) std::rethrow_exception(refused);
  if (first < comm.size()) throw RefusedElsewhere(first);
  return result;
}

}  // namespace swav
