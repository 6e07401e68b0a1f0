// RankedAlgorithms: one direction's cuDNN convolution algorithms for a plan, best first, and
// the two steps around them -- choosing the candidates from cuDNN's ranking
// (ranked_within_limit) and running a call with the current one, moving to the next where cuDNN
// refuses it (run_ranked). Host code over cuDNN's status codes: tested without a GPU
// (tests/core/test_error.cpp); the plans that use it are in cuda_libraries.hpp.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "shardkit/core/cudnn_check.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::autograd::cuda {

// One direction's algorithms for a plan, best first, each with the workspace it needs: the
// first is used until cuDNN refuses it at a call (its rankings predict, they do not run
// anything), then the next for good -- what PyTorch's convolutions do with their ranked list.
template <class Algo>
struct RankedAlgorithms {
  std::vector<std::pair<Algo, std::size_t>> candidates;  // never empty once the plan is made
  std::size_t at = 0;
  Algo algo() const { return candidates[at].first; }
  std::size_t bytes() const { return candidates[at].second; }
  // Gives the current one up for the next; false (keeping it) when none is left.
  bool next() {
    if (at + 1 >= candidates.size()) return false;
    ++at;
    return true;
  }
};

// The algorithms cuDNN ranked that ran and fit the workspace limit, in order, with their
// workspace: the deterministic ones first when `deterministic` (Libraries::deterministic), then
// the others; each algorithm once (a ranking may list one per math type). A heuristic's entry
// is a prediction (for its own math type), so each candidate's workspace is also asked of cuDNN
// for the descriptors the call will use (`workspace(algo, &bytes)`, a cudnnGet*WorkspaceSize):
// a candidate those descriptors do not support is left out, and the larger size is kept.
template <class Perf, class Workspace>
auto ranked_within_limit(const Perf* ranked, int count, std::size_t limit, const char* what,
                         bool deterministic, Workspace&& workspace) {
  RankedAlgorithms<decltype(ranked[0].algo)> out;
  for (const bool only_deterministic : {deterministic, false})
    for (int i = 0; i < count; ++i) {
      if (ranked[i].status != CUDNN_STATUS_SUCCESS ||
          (only_deterministic && ranked[i].determinism != CUDNN_DETERMINISTIC))
        continue;
      const bool listed =
          std::any_of(out.candidates.begin(), out.candidates.end(),
                      [&](const auto& candidate) { return candidate.first == ranked[i].algo; });
      std::size_t bytes = 0;
      if (listed || workspace(ranked[i].algo, &bytes) != CUDNN_STATUS_SUCCESS) continue;
      bytes = std::max(bytes, ranked[i].memory);
      if (bytes <= limit) out.candidates.emplace_back(ranked[i].algo, bytes);
    }
  if (out.candidates.empty())
    fail<NotAvailable>("cuDNN offers no ", what, " algorithm for this shape within ", limit,
                       " workspace bytes; raise workspace_limit");
  return out;
}

// Runs `call(algo, workspace_bytes)` (a cuDNN convolution call) with the plan's current
// algorithm of one direction; where cuDNN refuses it at the call as unsupported, failing inside
// or in execution, the next candidate takes its place in the plan for good and the call runs
// again. A bad parameter is ours, not the algorithm's: it throws at once, as does the first
// refusal when no candidate is left.
template <class Algo, class Call>
void run_ranked(RankedAlgorithms<Algo>& algorithms, const char* what, Call&& call) {
  cudnnStatus_t first = CUDNN_STATUS_SUCCESS;
  for (;;) {
    const cudnnStatus_t status = call(algorithms.algo(), algorithms.bytes());
    if (status == CUDNN_STATUS_SUCCESS) return;
    if (first == CUDNN_STATUS_SUCCESS) first = status;
    const int category = CUDNN_STATUS_CATEGORY(static_cast<int>(status));
    const bool the_algorithm = category == CUDNN_STATUS_NOT_SUPPORTED ||
                               category == CUDNN_STATUS_INTERNAL_ERROR ||
                               category == CUDNN_STATUS_EXECUTION_FAILED;
    if (!the_algorithm || !algorithms.next())
      shardkit::detail::cudnn_check(the_algorithm ? first : status, what, __FILE__, __LINE__);
    (void)cudaGetLastError();  // (a refused launch may leave an error behind)
  }
}

}  // namespace shardkit::autograd::cuda

#endif  // SK_WITH_CUDA
