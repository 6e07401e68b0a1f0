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
#include <exception>
#include <utility>
#include <vector>

#include "shardkit/core/cudnn_check.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::autograd::cuda {

// One direction's algorithms for a plan, best first, each with the workspace it needs: the
// current one is used until cuDNN refuses it at a call (its rankings predict, they do not run
// anything), then the first of the others that the call takes, for good -- what PyTorch's
// convolutions do with their ranked list.
template <class Algo>
struct RankedAlgorithms {
  std::vector<std::pair<Algo, std::size_t>> candidates;  // never empty once the plan is made
  std::size_t at = 0;
  Algo algo() const { return candidates[at].first; }
  std::size_t bytes() const { return candidates[at].second; }
};

// The algorithms cuDNN ranked that ran and fit the workspace limit, in order, with their
// workspace, each algorithm once (a ranking may list one per math type). When `deterministic`
// (Libraries::deterministic) only the deterministic ones, as torch.backends.cudnn.deterministic
// -- unless cuDNN ranks none for the shape, then the others (a captured step's replay may then
// differ in its last bits). A heuristic's entry is a prediction (for its own math type), so
// each candidate's workspace is also asked of cuDNN for the descriptors the call will use
// (`workspace(algo, &bytes)`, a cudnnGet*WorkspaceSize): a candidate those descriptors do not
// support is left out, and the larger size is kept.
template <class Perf, class Workspace>
auto ranked_within_limit(const Perf* ranked, int count, std::size_t limit, const char* what,
                         bool deterministic, Workspace&& workspace) {
  RankedAlgorithms<decltype(ranked[0].algo)> out;
  for (const bool only_deterministic : {deterministic, false}) {
    if (!out.candidates.empty()) break;
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
  }
  if (out.candidates.empty())
    fail<NotAvailable>("cuDNN offers no ", what, " algorithm for this shape within ", limit,
                       " workspace bytes; raise workspace_limit");
  return out;
}

// Runs `call(algo, workspace_bytes)` (a cuDNN convolution call) with the plan's current
// algorithm of one direction. Where cuDNN refuses it -- as unsupported, failing inside, or in
// execution -- the next candidates are tried in order, and the first that the call takes
// becomes the plan's for good. What cannot be the algorithm's throws at once: a bad parameter
// (ours), and inside a CUDA graph capture (`capturing`) any failure but "not supported" --
// refused on the host before anything was launched -- since a failed launch invalidates the
// capture for every later one. When every candidate fails, the first failure is thrown (with
// cuDNN's account of it) and the plan stays as it was.
template <class Algo, class Call>
void run_ranked(RankedAlgorithms<Algo>& algorithms, const char* what, bool capturing, Call&& call) {
  std::exception_ptr first;
  for (std::size_t i = algorithms.at; i < algorithms.candidates.size(); ++i) {
    const auto& [algo, bytes] = algorithms.candidates[i];
    const cudnnStatus_t status = call(algo, bytes);
    if (status == CUDNN_STATUS_SUCCESS) {
      algorithms.at = i;
      return;
    }
    const int category = CUDNN_STATUS_CATEGORY(static_cast<int>(status));
    const bool the_algorithm = category == CUDNN_STATUS_NOT_SUPPORTED ||
                               (!capturing && (category == CUDNN_STATUS_INTERNAL_ERROR ||
                                               category == CUDNN_STATUS_EXECUTION_FAILED));
    try {
      shardkit::detail::cudnn_check(status, what, __FILE__, __LINE__);  // (clears CUDA's error)
    } catch (...) {
      if (!the_algorithm) throw;
      if (!first) first = std::current_exception();
    }
  }
  std::rethrow_exception(first);
}

}  // namespace shardkit::autograd::cuda

#endif  // SK_WITH_CUDA
