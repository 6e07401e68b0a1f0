// Local backend, host memory: every collective and form x f32/f64/f16/bf16 x world sizes
// 1, 2, 3, 4, 8 x counts that do not divide evenly, bit-equal to the fixed rank-order reference.
#include <doctest/doctest.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "collective_matrix.hpp"
#include "shardkit/comm/run_ranks.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

namespace {

std::vector<std::string> run_matrix_on_local_world(int n) {
  std::mutex mutex;
  std::vector<std::string> failures;
  comm::run_ranks(n, [&](sk::Context& ctx, comm::Communicator& c) {
    auto mine = comm::testing::run_all_dtypes(ctx, c);
    std::lock_guard lock(mutex);
    failures.insert(failures.end(), mine.begin(), mine.end());
  });
  return failures;
}

}  // namespace

TEST_CASE("local collectives over host memory equal the fixed-order reference bit for bit") {
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    const auto failures = run_matrix_on_local_world(n);
    std::string first_failures;
    for (std::size_t i = 0; i < failures.size() && i < 5; ++i) first_failures += failures[i] + "\n";
    CHECK_MESSAGE(failures.empty(), first_failures);
  }
}

TEST_CASE("local all_reduce is bitwise reproducible from run to run") {
  auto run_once = [] {
    std::vector<std::vector<float>> results(8);
    comm::run_ranks(8, [&](sk::Context&, comm::Communicator& c) {
      auto values = comm::testing::inputs<float>(c.rank(), 10007, 42);
      c.all_reduce(values, comm::ReduceOp::avg).wait();
      results[static_cast<std::size_t>(c.rank())] = values;
    });
    return results;
  };
  const auto first = run_once();
  const auto second = run_once();
  for (std::size_t r = 0; r < 8; ++r) {
    CHECK(std::memcmp(first[r].data(), second[r].data(), first[r].size() * sizeof(float)) == 0);
    CHECK(std::memcmp(first[r].data(), first[0].data(), first[r].size() * sizeof(float)) == 0);
  }
}
