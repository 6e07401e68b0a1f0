// Processes launched side by side on the CPU (mpirun): one verdict on the config. Each process
// checks its own machine (check_ranks_fit) -- with a rank's step measured once, by rank 0 while
// the others wait (step_memory.hpp's measure_step_memory_once) -- and a refusal or failure of
// any process stops all: a process stopping alone would leave the others waiting for it in their
// next collective.
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

// Another rank stopped before training: it refused the config (a ConfigError) or failed; its
// message is its own (said once, by that rank).
struct RefusedElsewhere : ConfigError {
  RefusedElsewhere(int rank, bool refused)
      : ConfigError("rank " + std::to_string(rank) +
                    (refused ? " refused the config" : " failed before training") +
                    " (its message is in the job's output); no rank started"),
        refusing_rank(rank) {}
  int refusing_rank;
};

// Runs `fn` on every rank of `comm` and agrees on how it ended: where any rank threw, the
// lowest such rank rethrows its exception and the others throw RefusedElsewhere naming it, so
// that no rank goes on to a collective the others will not make. What `fn` returns where none
// threw.
template <class Fn>
auto agreed(sk::Context& ctx, sk::comm::Communicator& comm, Fn&& fn) {
  decltype(fn()) result{};
  std::exception_ptr stopped;
  bool refused = false;
  try {
    result = fn();
  } catch (const ConfigError&) {
    stopped = std::current_exception();
    refused = true;
  } catch (...) {
    stopped = std::current_exception();
  }
  // The lowest stopping rank r as the largest 2 (size - r) + (1 where it refused the config); 0
  // from the ranks that went through.
  std::vector<double> code{stopped ? 2.0 * (comm.size() - comm.rank()) + (refused ? 1.0 : 0.0)
                                   : 0.0};
  all_reduce_host(ctx, comm, std::span<double>(code), sk::comm::ReduceOp::max);
  if (code[0] == 0) return result;
  const int coded = static_cast<int>(code[0]);
  const int first = comm.size() - coded / 2;
  if (first == comm.rank()) std::rethrow_exception(stopped);
  throw RefusedElsewhere(first, coded % 2 == 1);
}

}  // namespace swav
