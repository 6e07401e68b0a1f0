// One blocking call of each collective on throwaway buffers, sized from the communicator, for
// the tests of what survivors see when a rank is missing (local threads and MPI processes).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"

namespace shardkit::comm::testing {

// A call's buffers, owned by the caller: a call that timed out leaves them in the backend's
// hands (MPI writes into them once the late rank joins, before the communicator's destructor
// returns), so they must outlive the call, not just its scope.
struct CallBuffers {
  std::vector<float> x, y;
  std::vector<std::size_t> counts;
};

using BlockingCall = std::function<void(Communicator&, CallBuffers&)>;

// {name as the error messages spell it, the call}; every rank must run the same entry.
inline std::vector<std::pair<std::string, BlockingCall>> one_of_each_call() {
  // Uneven counts for the v-forms: 2, 3, 1, 2, 3, 1, ...
  const auto counts_for = [](const Communicator& c) {
    constexpr std::size_t kPattern[] = {2, 3, 1};
    std::vector<std::size_t> counts(static_cast<std::size_t>(c.size()));
    for (std::size_t r = 0; r < counts.size(); ++r) counts[r] = kPattern[r % 3];
    return counts;
  };
  const auto total = [](const std::vector<std::size_t>& counts) {
    std::size_t sum = 0;
    for (const auto n : counts) sum += n;
    return sum;
  };
  const auto size = [](const Communicator& c) { return static_cast<std::size_t>(c.size()); };
  return {
      {"all_reduce",
       [](Communicator& c, CallBuffers& b) {
         b.x.assign(6, 1.0f);
         c.all_reduce(b.x).wait();
       }},
      {"reduce",
       [](Communicator& c, CallBuffers& b) {
         b.x.assign(6, 1.0f);
         b.y.assign(6, 0.0f);
         c.reduce(b.x, b.y, 0).wait();
       }},
      {"broadcast",
       [](Communicator& c, CallBuffers& b) {
         b.x.assign(6, 1.0f);
         c.broadcast(b.x, 0).wait();
       }},
      {"all_gather",
       [=](Communicator& c, CallBuffers& b) {
         b.x.assign(2, 1.0f);
         b.y.assign(2 * size(c), 0.0f);
         c.all_gather(b.x, b.y).wait();
       }},
      {"reduce_scatter",
       [=](Communicator& c, CallBuffers& b) {
         b.x.assign(2 * size(c), 1.0f);
         b.y.assign(2, 0.0f);
         c.reduce_scatter(b.x, b.y).wait();
       }},
      {"all_gather_v",
       [=](Communicator& c, CallBuffers& b) {
         b.counts = counts_for(c);
         b.x.assign(total(b.counts), 1.0f);
         c.all_gather_v(b.x, b.counts).wait();
       }},
      {"reduce_scatter_v",
       [=](Communicator& c, CallBuffers& b) {
         b.counts = counts_for(c);
         b.x.assign(total(b.counts), 1.0f);
         b.y.assign(b.counts[static_cast<std::size_t>(c.rank())], 0.0f);
         c.reduce_scatter_v(b.x, b.y, b.counts).wait();
       }},
      {"all_to_all_v",
       [=](Communicator& c, CallBuffers& b) {
         b.counts = counts_for(c);
         b.x.assign(total(b.counts), 1.0f);
         b.y.assign(b.counts[static_cast<std::size_t>(c.rank())] * size(c), 0.0f);
         c.all_to_all_v(b.x, b.y, b.counts).wait();
       }},
      {"barrier", [](Communicator& c, CallBuffers&) { c.barrier(); }},
  };
}

}  // namespace shardkit::comm::testing
