// Local backend, host memory: every collective and form x f32/f64/f16/bf16 x world sizes
// 1, 2, 3, 4, 8 x counts that do not divide evenly, bit-equal to the fixed rank-order reference;
// and each rank's share of a call (what a captured step's rank carries out) against the whole.
#include <doctest/doctest.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "collective_matrix.hpp"
#include "shardkit/comm/local_host_ops.hpp"
#include "shardkit/comm/local_validation.hpp"
#include "shardkit/comm/rank_share.hpp"
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

// Inside a captured step each rank of a device world carries out its own share of a call
// (comm/rank_share.hpp) between two waits. Here the same shares run on host memory in the same
// two phases -- every rank writes (into scratch where staged), then every rank copies back --
// and must write exactly what the whole plan writes, for every collective and in-place form.
namespace {

struct ShareCase {
  const char* name;
  comm::CollectiveKind kind;
  bool in_place;
  bool staged;  // what rank_share must decide for rank 0
};

// Each rank's memory: `size` floats, with send and recv laid out as the case's form asks.
std::vector<comm::LocalPost> share_case_posts(const ShareCase& c, int n, std::size_t count,
                                              std::vector<std::vector<float>>& memory,
                                              const std::vector<std::size_t>& counts) {
  using comm::CollectiveKind;
  std::size_t total = 0;
  for (std::size_t v : counts) total += v;
  std::vector<comm::LocalPost> posts(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    auto& mem = memory[static_cast<std::size_t>(r)];
    const std::size_t whole = count * static_cast<std::size_t>(n);
    mem.resize(2 * whole + 2 * total + 8);
    for (std::size_t i = 0; i < mem.size(); ++i)
      mem[i] = static_cast<float>(((r + 3) * 7919 + i * 104729) % 1000) / 37.0f - 13.0f;
    comm::LocalPost& p = posts[static_cast<std::size_t>(r)];
    p.kind = c.kind;
    p.root = 1;
    p.op = comm::ReduceOp::sum;
    auto buffer = [&](std::size_t offset, std::size_t elements) {
      return comm::Buffer(mem.data() + offset, elements, sk::DType::f32);
    };
    const auto rank_offset = static_cast<std::size_t>(r) * count;
    switch (c.kind) {
      case CollectiveKind::all_reduce:
      case CollectiveKind::reduce:
        p.send = buffer(0, count);
        p.recv = c.in_place ? p.send : buffer(whole, count);
        break;
      case CollectiveKind::broadcast:
        p.send = p.recv = buffer(0, count);
        break;
      case CollectiveKind::all_gather:
        p.recv = buffer(whole, whole);
        p.send = c.in_place ? buffer(whole + rank_offset, count) : buffer(0, count);
        break;
      case CollectiveKind::reduce_scatter:
        p.send = buffer(0, whole);
        p.recv = c.in_place ? buffer(rank_offset, count) : buffer(whole, count);
        break;
      case CollectiveKind::all_gather_v:
        p.counts = counts;
        p.send = p.recv = buffer(0, total);
        break;
      case CollectiveKind::reduce_scatter_v:
        p.counts = counts;
        p.send = buffer(0, total);
        p.recv = buffer(total, counts[static_cast<std::size_t>(r)]);
        break;
      case CollectiveKind::all_to_all_v:
        p.counts = counts;
        p.send = buffer(0, total);
        p.recv = buffer(total, counts[static_cast<std::size_t>(r)] * static_cast<std::size_t>(n));
        break;
      case CollectiveKind::barrier:
        break;
    }
  }
  return posts;
}

}  // namespace

TEST_CASE("each rank's share of a collective, run in two phases, writes what the whole plan does") {
  using comm::CollectiveKind;
  const std::vector<ShareCase> cases = {
      {"all_reduce", CollectiveKind::all_reduce, false, false},
      {"all_reduce in place", CollectiveKind::all_reduce, true, true},
      {"reduce", CollectiveKind::reduce, false, false},
      {"reduce in place", CollectiveKind::reduce, true, false},  // rank 0 is no root: no writes
      {"broadcast", CollectiveKind::broadcast, true, false},
      {"all_gather", CollectiveKind::all_gather, false, false},
      {"all_gather in place", CollectiveKind::all_gather, true, false},
      {"reduce_scatter", CollectiveKind::reduce_scatter, false, false},
      {"reduce_scatter in place", CollectiveKind::reduce_scatter, true, true},
      {"all_gather_v", CollectiveKind::all_gather_v, true, false},
      {"reduce_scatter_v", CollectiveKind::reduce_scatter_v, false, false},
      {"all_to_all_v", CollectiveKind::all_to_all_v, false, false},
  };
  for (int n : {2, 3, 5}) {
    for (const ShareCase& c : cases) {
      CAPTURE(n);
      CAPTURE(c.name);
      const std::size_t count = 37;
      std::vector<std::size_t> counts;
      for (int r = 0; r < n; ++r) counts.push_back(static_cast<std::size_t>(5 + 3 * r));
      std::vector<std::vector<float>> whole(static_cast<std::size_t>(n));
      std::vector<std::vector<float>> shared(static_cast<std::size_t>(n));
      const auto whole_posts = share_case_posts(c, n, count, whole, counts);
      const auto shared_posts = share_case_posts(c, n, count, shared, counts);
      REQUIRE(whole == shared);
      comm::run_plan_on_host(comm::plan_transfers(whole_posts));

      const comm::TransferPlan plan = comm::plan_transfers(shared_posts);
      std::vector<comm::RankShare> shares;
      std::vector<std::vector<std::byte>> scratch(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) shares.push_back(comm::rank_share(plan, shared_posts, r));
      CHECK(shares[0].staged == c.staged);
      for (int r = 0; r < n; ++r) {  // phase 1: every rank writes, nobody has copied back
        const auto i = static_cast<std::size_t>(r);
        const comm::Buffer& recv = shared_posts[i].recv;
        if (!shares[i].staged) {
          comm::run_plan_on_host(shares[i].plan);
          continue;
        }
        scratch[i].resize(recv.count * recv.element_size());
        comm::run_plan_on_host(comm::staged_into(shares[i], recv, scratch[i].data()));
      }
      for (int r = 0; r < n; ++r) {  // phase 2: every rank has read; staged ranks copy back
        const auto i = static_cast<std::size_t>(r);
        for (const auto& [offset, bytes] : shares[i].written)
          std::memcpy(shared_posts[i].recv.bytes() + offset, scratch[i].data() + offset, bytes);
      }
      CHECK(whole == shared);
    }
  }
}

TEST_CASE("a call captured on one rank and eager on another is refused, naming both") {
  std::vector<float> a(8, 1.0f), b(8, 2.0f);
  std::vector<comm::LocalPost> posts(2);
  posts[0].kind = posts[1].kind = comm::CollectiveKind::all_reduce;
  posts[0].send = posts[0].recv = comm::Buffer(a);
  posts[1].send = posts[1].recv = comm::Buffer(b);
  posts[0].in_capture = true;
  CHECK_THROWS_WITH_AS(comm::validate_local_posts(posts, "all_reduce #4"),
                       doctest::Contains("rank 1 issued it eagerly but rank 0 inside a captured "
                                         "step; capture the step on every rank"),
                       sk::InvalidArgument);
  posts[1].in_capture = true;
  CHECK_NOTHROW(comm::validate_local_posts(posts, "all_reduce #4"));
}

// The ranks' meeting around a captured step's run (a barrier posted with in_capture, by
// LocalCommunicator::meet_around_graph_run) pairs with no user's barrier.
TEST_CASE("a graph run's meeting on one rank and a barrier on another are refused, naming both") {
  std::vector<comm::LocalPost> posts(2);
  posts[0].kind = posts[1].kind = comm::CollectiveKind::barrier;
  CHECK_NOTHROW(comm::validate_local_posts(posts, "barrier #3"));
  posts[1].in_capture = true;
  CHECK_THROWS_WITH_AS(
      comm::validate_local_posts(posts, "barrier #3"),
      doctest::Contains("rank 1 is at the meeting around a captured step's run but rank 0 at a "
                        "barrier; every rank of the world must run its captured steps together"),
      sk::InvalidArgument);
  posts[0].in_capture = true;
  CHECK_NOTHROW(comm::validate_local_posts(posts, "graph run meeting #3"));
}
