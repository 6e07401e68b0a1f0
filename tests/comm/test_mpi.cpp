// MPI backend under mpirun (meson runs it with -np 4): make_communicator from the launcher's
// environment, the collective matrix on the world and on splits of sizes 1, 2 and 3, overlap,
// timeouts, local checks and counters. Part of test_comm, whose main (doctest_mpi_main.cpp) runs
// these cases when mpirun started it (a failure on any rank fails the test), the rest alone.
#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "collective_matrix.hpp"
#include "one_of_each_call.hpp"
#include "shardkit/comm/bootstrap.hpp"
#include "shardkit/comm/mpi_communicator.hpp"

#if !(defined(SHARDKIT_WITH_MPI) && SHARDKIT_WITH_MPI)
#error \
    "test_mpi.cpp needs SHARDKIT_WITH_MPI (Meson defines it through shardkit_dep when MPI is found)"
#endif

namespace sk = shardkit;
namespace comm = shardkit::comm;
using namespace std::chrono_literals;

// Inside a namespace of its own: this file is compiled in one unit with the layer's other
// tests (a unity build), whose anonymous namespaces would otherwise meet this one's.
namespace comm_mpi_cases {

TEST_SUITE_BEGIN("mpi");

namespace {

std::string joined(const std::vector<std::string>& failures) {
  std::string out;
  for (std::size_t i = 0; i < failures.size() && i < 5; ++i) out += failures[i] + "\n";
  return out;
}

// The backend's own behaviour (asynchronous calls, timeouts), without the order check, whose
// exchange would make every call wait for the others.
comm::CommOptions short_timeout(std::chrono::milliseconds timeout) {
  comm::CommOptions options;
  options.timeout = timeout;
  options.validate_order = false;
  return options;
}

}  // namespace

TEST_CASE("make_communicator under mpirun builds the MPI backend with the launcher's ranks") {
  sk::Context ctx;
  auto c = comm::make_communicator(ctx, short_timeout(30s));
  const auto launch = comm::detect_launch();
  CHECK(c->backend() == "mpi");
  CHECK(launch.kind == comm::LaunchKind::mpi);
  CHECK(c->rank() == launch.rank);
  CHECK(c->size() == launch.size);
  CHECK(c->size() == comm::MpiSession::world_size());
}

TEST_CASE("MPI collectives match the reference on the world and on splits of sizes 1, 2, 3") {
  sk::Context ctx;
  auto world = comm::MpiCommunicator::world(ctx, short_timeout(60s));
  comm::testing::MatrixConfig config;
  config.exact_order = false;  // MPI picks its own reduction order
  auto failures = comm::testing::run_all_dtypes(ctx, *world, config);
  CHECK_MESSAGE(failures.empty(), joined(failures));

  // sizes 3 + 1 (ranks 0-2 and 3), then 2 + 2 (even / odd)
  auto three_one = world->split(world->rank() < 3 ? 0 : 1, world->rank());
  REQUIRE(three_one != nullptr);
  CHECK(three_one->size() == (world->rank() < 3 ? 3 : 1));
  failures = comm::testing::run_all_dtypes(ctx, *three_one, config);
  CHECK_MESSAGE(failures.empty(), joined(failures));

  auto pairs = world->split(world->rank() % 2, -world->rank());
  REQUIRE(pairs != nullptr);
  CHECK(pairs->size() == 2);
  CHECK(pairs->rank() == (world->rank() < 2 ? 1 : 0));  // key -rank: the higher rank first
  failures = comm::testing::run_all_dtypes(ctx, *pairs, config);
  CHECK_MESSAGE(failures.empty(), joined(failures));

  CHECK(world->split(-1, 0) == nullptr);
}

TEST_CASE("an MPI all_reduce returns before a late rank arrives and completes afterwards") {
  sk::Context ctx;
  auto c = comm::MpiCommunicator::world(ctx, short_timeout(30s));
  c->barrier();
  if (c->rank() == 0) std::this_thread::sleep_for(200ms);
  std::vector<double> grads(1 << 16, c->rank() + 1.0);
  const auto start = std::chrono::steady_clock::now();
  comm::Work work = c->all_reduce(grads, comm::ReduceOp::avg);
  const double call_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (c->rank() != 0) {
    CHECK(call_ms < 100.0);
    CHECK_FALSE(work.test());  // rank 0 is still asleep
  }
  work.wait();
  const double mean = (c->size() + 1) / 2.0;
  CHECK(std::all_of(grads.begin(), grads.end(), [&](double v) { return v == mean; }));
}

TEST_CASE("a rank that arrives after the timeout turns the MPI barrier into a TimeoutError") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  {
    comm::MpiCommunicator c(ctx, session, MPI_COMM_WORLD, short_timeout(200ms));
    if (c.rank() == c.size() - 1) {
      std::this_thread::sleep_for(600ms);
      c.barrier();  // the others posted long ago: completes at once
    } else {
      const auto start = std::chrono::steady_clock::now();
      std::string message;
      try {
        c.barrier();
      } catch (const sk::TimeoutError& e) {
        message = e.what();
      }
      const double waited =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      CHECK(message.find("barrier #0") != std::string::npos);
      CHECK(message.find("timed out after 200 ms") != std::string::npos);
      CHECK(waited >= 190.0);
      CHECK(waited < 550.0);
      std::vector<float> x(4, 1.0f);
      CHECK_THROWS_AS(c.all_reduce(x).wait(), comm::CommunicatorAborted);
    }
  }  // the destructor completes the orphaned barrier once the late rank joined
  comm::MpiCommunicator after(ctx, session, MPI_COMM_WORLD, short_timeout(30s));
  after.barrier();
}

// Calls in flight when another call's timeout aborted the communicator fail at once, waited
// for or dropped: each waited its own full timeout, and as much again when its Work was dropped
// (a backward's buckets against a dead rank: minutes each).
TEST_CASE("after an MPI timeout the other calls in flight fail at once, waited for or dropped") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  std::vector<std::vector<float>> buffers(3, std::vector<float>(4, 1.0f));  // (outlive c)
  {
    comm::MpiCommunicator c(ctx, session, MPI_COMM_WORLD, short_timeout(200ms));
    if (c.rank() == c.size() - 1) {
      std::this_thread::sleep_for(900ms);
      for (auto& b : buffers) c.all_reduce(b).wait();  // (the others posted long ago)
    } else {
      std::vector<comm::Work> works;
      for (auto& b : buffers) works.push_back(c.all_reduce(b));
      CHECK_THROWS_AS(works[0].wait(), sk::TimeoutError);
      const auto start = std::chrono::steady_clock::now();
      CHECK_THROWS_AS(works[1].wait(), comm::CommunicatorAborted);
      works.clear();
      CHECK(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count() < 150.0);
    }
  }  // (the destructor completes the orphaned calls once the late rank joined them)
  comm::MpiCommunicator after(ctx, session, MPI_COMM_WORLD, short_timeout(30s));
  after.barrier();
}

TEST_CASE(
    "every MPI collective: a survivor waiting on a missing rank gets a TimeoutError within "
    "timeout + 1 s naming the call") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  constexpr auto kTimeout = 300ms;
  for (const auto& [name, call] : comm::testing::one_of_each_call()) {
    CAPTURE(name);
    const int size = comm::MpiSession::world_size();
    // The missing rank is one the others need data from: the root of a broadcast, the last
    // rank otherwise. A reduce blocks only its root (the others' sends may complete alone); every
    // other collective blocks every survivor.
    const int missing = name == "broadcast" ? 0 : size - 1;
    const bool is_missing = comm::MpiSession::world_rank() == missing;
    comm::testing::CallBuffers buffers;  // outlives the communicator, which completes the call
    {
      // (The missing rank's own wait is long: once it joins, it needs the others' progress.)
      comm::MpiCommunicator probe(ctx, session, MPI_COMM_WORLD,
                                  short_timeout(is_missing ? 30000ms : kTimeout));
      const bool must_time_out = name != "reduce" || probe.rank() == 0;
      if (is_missing) {
        // Stuck elsewhere for longer than the others' timeout; then it joins the call, so the
        // others' orphaned requests complete.
        std::this_thread::sleep_for(kTimeout + 400ms);
        call(probe, buffers);
      } else {
        const auto start = std::chrono::steady_clock::now();
        std::string message;
        try {
          call(probe, buffers);
        } catch (const sk::TimeoutError& e) {
          message = e.what();
        }
        const double waited =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count();
        CAPTURE(message);
        if (must_time_out) {
          CHECK(message.rfind(name + " #0 on rank ", 0) == 0);
          CHECK(message.find("(mpi) timed out after 300 ms") != std::string::npos);
          CHECK(waited >= 290.0);
          CHECK(waited < 300.0 + 1000.0);
          std::vector<float> x(4, 1.0f);
          CHECK_THROWS_AS(probe.all_reduce(x).wait(), comm::CommunicatorAborted);
        }
      }
    }  // each survivor's destructor completes its orphaned request once the late rank joined
    comm::MpiCommunicator after(ctx, session, MPI_COMM_WORLD, short_timeout(30s));
    after.barrier();
  }
}

comm::CommOptions validated(std::chrono::milliseconds timeout) {
  comm::CommOptions options;
  options.timeout = timeout;
  options.validate_order = true;
  return options;
}

// What each rank's first call throws, "" when it returns.
std::string first_error(const std::function<void()>& call) {
  try {
    call();
  } catch (const sk::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// A rank whose order check is off (an environment variable the launcher did not pass to its
// host) would pair its real calls with the others' exchanges: refused where the communicator is
// made, on every rank, naming the setting.
TEST_CASE("ranks that disagree on the order check are refused when the communicator is made") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  comm::CommOptions options = validated(30s);
  options.validate_order = world_rank != 2;
  const std::string error =
      first_error([&] { comm::MpiCommunicator refused(ctx, session, MPI_COMM_WORLD, options); });
  CHECK(error.find(world_rank == 2 ? "is off on rank 2 but on on another rank"
                                   : "but off on another rank") != std::string::npos);
  CHECK(error.find("mpirun -x SHARDKIT_VALIDATE_COLLECTIVES") != std::string::npos);
  comm::MpiCommunicator agreed(ctx, session, MPI_COMM_WORLD, validated(30s));  // still usable
  agreed.barrier();
}

TEST_CASE("the order check refuses a rank's different call on every rank, naming both calls") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  std::vector<float> data(12, 1.0f), gathered(48, 0.0f);
  std::vector<double> wide(12, 1.0);
  struct Case {
    const char* name;
    std::function<void(comm::Communicator&)> everyone, last_rank;
    const char* theirs;  // how the others see the last rank's call
    const char* mine;    // how the last rank names its own
  };
  const std::vector<Case> cases = {
      {"an extra all_gather", [&](comm::Communicator& c) { c.all_reduce(data).wait(); },
       [&](comm::Communicator& c) {
         c.all_gather(comm::Buffer(std::span(data)), comm::Buffer(std::span(gathered))).wait();
       },
       "is all_gather #0 of 48 f32", "this rank's is all_gather #0 of 48 f32"},
      {"another size", [&](comm::Communicator& c) { c.all_reduce(data).wait(); },
       [&](comm::Communicator& c) { c.all_reduce(std::span(data).first(8)).wait(); },
       "is all_reduce #0 of 8 f32 (sum)", "this rank's is all_reduce #0 of 8 f32 (sum)"},
      {"another dtype", [&](comm::Communicator& c) { c.all_reduce(data).wait(); },
       [&](comm::Communicator& c) { c.all_reduce(wide).wait(); },
       "is all_reduce #0 of 12 f64 (sum)", "this rank's is all_reduce #0 of 12 f64 (sum)"},
      // A unit skipped on one rank: its next call has the same shape but another label.
      {"a skipped unit",
       [&](comm::Communicator& c) {
         auto label = c.label("fsdp unit 1: gather");
         c.all_reduce(data).wait();
       },
       [&](comm::Communicator& c) {
         auto label = c.label("fsdp unit 2: gather");
         c.all_reduce(data).wait();
       },
       "is all_reduce #0 of 12 f32 (sum) under another label",
       "this rank's is all_reduce #0 of 12 f32 (sum) ('fsdp unit 2: gather')"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    comm::MpiCommunicator probe(ctx, session, MPI_COMM_WORLD, validated(30s));
    const int last = probe.size() - 1;
    const auto start = std::chrono::steady_clock::now();
    const std::string error = first_error([&] {
      if (probe.rank() == last)
        c.last_rank(probe);
      else
        c.everyone(probe);
    });
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CAPTURE(error);
    CHECK(ms < 10000.0);  // refused at once, never a hang
    if (probe.rank() == last) {
      CHECK(error.find("rank 0's collective #0 is ") != std::string::npos);
      CHECK(error.find(c.mine) != std::string::npos);
    } else {
      CHECK(error.find("rank " + std::to_string(last) + "'s collective #0 " + c.theirs) !=
            std::string::npos);
      CHECK(error.find("every rank must issue the same collectives in the same order") !=
            std::string::npos);
    }
    // Nothing was issued: the communicator still works, and agrees.
    std::vector<float> one(1, 1.0f);
    probe.all_reduce(one).wait();
    CHECK(one[0] == static_cast<float>(probe.size()));
  }
}

TEST_CASE("a rank blocked on a peer that never comes names the call and its last calls") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  constexpr auto kTimeout = 300ms;
  std::vector<float> data(6, 1.0f);
  {
    const bool late = comm::MpiSession::world_rank() == comm::MpiSession::world_size() - 1;
    comm::MpiCommunicator probe(ctx, session, MPI_COMM_WORLD,
                                validated(late ? std::chrono::milliseconds(1000) : kTimeout));
    probe.all_reduce(data).wait();
    {
      auto label = probe.label("fsdp unit 4: reduce-scatter");
      probe.broadcast(data, 0).wait();
    }
    if (late) {
      // Stuck elsewhere, then it joins: its check completes the others' orphaned exchange, and
      // its barrier, which no one else issues any more, times out in turn.
      std::this_thread::sleep_for(kTimeout + 400ms);
      CHECK_THROWS_AS(probe.barrier(), sk::TimeoutError);
    } else {
      std::string message;
      try {
        probe.barrier();
      } catch (const sk::TimeoutError& e) {
        message = e.what();
      }
      CAPTURE(message);
      CHECK(message.find("the order check of barrier #2") == 0);
      CHECK(message.find("timed out after 300 ms") != std::string::npos);
      CHECK(message.find("this rank's last calls, oldest first: all_reduce #0 of 6 f32 (sum); "
                         "broadcast #1 of 6 f32 from root 0 ('fsdp unit 4: reduce-scatter'); "
                         "barrier #2") != std::string::npos);
    }
  }  // the survivors' destructors complete the orphaned check once the late rank joined
  comm::MpiCommunicator after(ctx, session, MPI_COMM_WORLD, short_timeout(30s));
  after.barrier();
}

// A call the backend refuses on one rank (its memory is not the host's) is refused before its
// fingerprint is exchanged: the others wait in the check, and the rank's corrected call meets
// them there, numbered as theirs. (Exchanged first, the refused call's fingerprint paired with
// the others' and they went on into the real call, with which the rank's next exchange then
// paired: a mismatch of MPI calls that timed out instead of a sum.)
TEST_CASE(
    "with the order check, a call the MPI backend refuses on one rank keeps the ranks in "
    "step") {
  sk::Context ctx;
  auto session = std::make_shared<comm::MpiSession>();
  comm::MpiCommunicator c(ctx, session, MPI_COMM_WORLD, validated(20s));
  std::vector<float> data(6, 1.0f);
  if (c.rank() == 1) {
    comm::Buffer device(data.data(), data.size(), sk::DType::f32, sk::Device::cuda(0));
    CHECK_THROWS_WITH_AS(c.all_reduce(device).wait(), doctest::Contains("moves host memory"),
                         sk::InvalidArgument);
  }
  c.all_reduce(data).wait();
  CHECK(data[0] == static_cast<float>(c.size()));
  CHECK(c.recent_calls() == "this rank's last calls, oldest first: all_reduce #0 of 6 f32 (sum)");
  c.barrier();
}

// Host memory that runs out on request: the f16 reduction's f32 staging then fails after the
// call began.
class RunningOutAllocator final : public sk::Allocator {
 public:
  bool exhausted = false;
  sk::Device device() const override { return sk::Device::cpu(); }

 protected:
  void* do_allocate(std::size_t bytes) override {
    return exhausted ? nullptr : ::operator new(bytes, std::nothrow);
  }
  void do_deallocate(void* pointer, std::size_t) noexcept override { ::operator delete(pointer); }
};

// Past its checks a call has begun on every rank (and been exchanged by the order check): a
// rank whose backend then fails cannot take part in it, and its next call would pair with it.
// So every later call on that rank refuses, naming the call that failed; the others time out
// in the call it skipped.
TEST_CASE(
    "a call that fails on one rank after it began puts that rank's communicator out of "
    "step") {
  auto allocator = std::make_shared<RunningOutAllocator>();
  sk::ContextOptions options;
  options.allocator = allocator;
  sk::Context ctx(options);
  auto session = std::make_shared<comm::MpiSession>();
  std::vector<sk::Half> data(8, sk::Half(1.0f));
  {
    comm::MpiCommunicator c(ctx, session, MPI_COMM_WORLD, validated(1500ms));
    if (c.rank() == 1) {
      allocator->exhausted = true;
      CHECK_THROWS_AS(c.all_reduce(data).wait(), sk::OutOfMemory);
      allocator->exhausted = false;
      CHECK_THROWS_WITH_AS(c.all_reduce(data).wait(),
                           doctest::Contains("the ranks are out of step (all_reduce #0 of 8 f16 "
                                             "(sum) failed on rank 1 after it began (out of "
                                             "memory"),
                           comm::CommunicatorAborted);
    } else {
      CHECK_THROWS_AS(c.all_reduce(data).wait(), sk::TimeoutError);
    }
  }
  comm::MpiCommunicator after(ctx, session, MPI_COMM_WORLD, short_timeout(30s));
  after.barrier();
}

// Run only by check_mpi_dead_rank.py (doctest --no-skip): a process that dies for real. Open MPI
// (without the fault-tolerance extension) cannot report a dead peer to the survivors: its
// launcher ends the whole job, which is what this checks from outside, long before the
// survivors' own timeout.
TEST_CASE("a rank killed during training ends the job through the launcher" * doctest::skip()) {
  sk::Context ctx;
  auto c = comm::MpiCommunicator::world(ctx, short_timeout(60s));
  std::vector<float> grads(1 << 12, 1.0f);
  c->all_reduce(grads).wait();  // a first step that completes
  if (c->rank() == 1) std::raise(SIGKILL);
  c->all_reduce(grads).wait();  // never completes: rank 1 is gone
  FAIL("an all_reduce completed without rank 1");
}

TEST_CASE("the MPI backend rejects what it can check locally, by name") {
  sk::Context ctx;
  auto c = comm::MpiCommunicator::world(ctx, short_timeout(30s));
  std::vector<float> data(10, 1.0f), small(10);
  const std::string bad_root = "root " + std::to_string(c->size()) + " is out of range";
  CHECK_THROWS_WITH_AS(c->broadcast(data, c->size()).wait(), doctest::Contains(bad_root.c_str()),
                       sk::InvalidArgument);
  const std::string too_small = "recv holds 10 f32 elements but needs size() x send.count = " +
                                std::to_string(10 * c->size());
  CHECK_THROWS_WITH_AS(c->all_gather(data, small).wait(), doctest::Contains(too_small.c_str()),
                       sk::InvalidArgument);
  comm::Buffer device(data.data(), data.size(), sk::DType::f32, sk::Device::cuda(0));
  CHECK_THROWS_WITH_AS(c->all_reduce(device).wait(), doctest::Contains("moves host memory"),
                       sk::InvalidArgument);
  c->all_reduce(data).wait();  // still usable
  CHECK(data[0] == static_cast<float>(c->size()));
  CHECK(c->stats().of(comm::CollectiveKind::all_reduce).calls == 1);
  const auto n = static_cast<std::uint64_t>(c->size());
  CHECK(c->stats().of(comm::CollectiveKind::all_reduce).bus_bytes == 40 * 2 * (n - 1) / n);
}

TEST_SUITE_END();

}  // namespace comm_mpi_cases
