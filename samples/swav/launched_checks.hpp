// Processes launched side by side on the CPU (mpirun): one verdict on the config. Each process
// checks its own machine (check_ranks_fit) -- with a rank's step measured once, by rank 0, and
// given to the others (from_rank0) -- and a refusal or failure of any process stops all: a
// process stopping alone would leave the others waiting for it in their next collective.
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
struct StoppedElsewhere : ConfigError {
  StoppedElsewhere(int rank, bool refused)
      : ConfigError("rank " + std::to_string(rank) +
                    (refused ? " refused the config" : " failed before training") +
                    " (its message is in the job's output); no rank started"),
        stopped_rank(rank) {}
  int stopped_rank;
};

// Runs `fn` on every rank of `comm` and agrees on how it ended: where any rank threw, the
// lowest such rank rethrows its exception and the others throw StoppedElsewhere naming it, so
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
  throw StoppedElsewhere(first, coded % 2 == 1);
}

// Values rank 0 has (`values`; the other ranks pass as many, any), or the exception it met making
// them (`failed`, rethrown there, a StoppedElsewhere on the others), given to every rank.
inline std::vector<double> from_rank0(sk::Context& ctx, sk::comm::Communicator& comm,
                                      std::vector<double> values, std::exception_ptr failed) {
  std::vector<double> shared = agreed(ctx, comm, [&] {
    if (failed) std::rethrow_exception(failed);
    return comm.rank() == 0 ? values : std::vector<double>(values.size(), 0.0);
  });
  all_reduce_host(ctx, comm, std::span<double>(shared), sk::comm::ReduceOp::sum);  // rank 0's
  return shared;
}

}  // namespace swav
