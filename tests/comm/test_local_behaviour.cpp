// Local backend behaviour beyond results: asynchronous calls that overlap with computation,
// dropped Work, group scopes, barriers, sub-communicators, timeouts and error propagation (a
// missing or failing rank, for every collective).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <latch>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "captured_stderr.hpp"
#include "one_of_each_call.hpp"
#include "shardkit/comm/recorder_dump.hpp"
#include "shardkit/comm/run_ranks.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double elapsed_ms(Clock::time_point since) {
  return std::chrono::duration<double, std::milli>(Clock::now() - since).count();
}

comm::RunRanksOptions with_timeout(std::chrono::milliseconds timeout) {
  comm::RunRanksOptions options;
  options.comm.timeout = timeout;
  return options;
}

}  // namespace

TEST_CASE("a local all_reduce returns at once and completes while the rank computes") {
  std::vector<double> call_ms(2), computed(2);
  std::vector<char> ready_after_call(2), correct(2);
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    if (c.rank() == 1) std::this_thread::sleep_for(150ms);  // a slow peer
    std::vector<float> grads(1 << 16, static_cast<float>(c.rank() + 1));
    const auto start = Clock::now();
    comm::Work work = c.all_reduce(grads);
    call_ms[r] = elapsed_ms(start);
    ready_after_call[r] = work.test();
    double sum = 0;  // "backward of the next layer", overlapping the collective
    for (int i = 0; i < 100000; ++i) sum += i * 0.5;
    computed[r] = sum;
    work.wait();
    correct[r] = std::all_of(grads.begin(), grads.end(), [](float v) { return v == 3.0f; });
  });
  CHECK(call_ms[0] < 100.0);        // did not wait for the slow rank 1
  CHECK(ready_after_call[0] == 0);  // rank 1 had not called yet
  CHECK(computed[0] > 0);
  CHECK(correct[0] == 1);
  CHECK(correct[1] == 1);
}

TEST_CASE("several outstanding local calls can be waited for in any order") {
  std::vector<char> ok(3);
  comm::run_ranks(3, [&](sk::Context&, comm::Communicator& c) {
    // Each bucket and element its own values, the largest on a rank that depends on both: a
    // result delivered to the wrong call, or a call that never ran, shows.
    const auto value = [](int rank, std::size_t bucket, std::size_t i) {
      return double((rank + int(bucket) + int(i)) % 3) + 10.0 * double(bucket) + 0.001 * double(i);
    };
    std::vector<std::vector<double>> buckets(4, std::vector<double>(999));
    for (std::size_t k = 0; k < buckets.size(); ++k)
      for (std::size_t i = 0; i < buckets[k].size(); ++i) buckets[k][i] = value(c.rank(), k, i);
    std::vector<comm::Work> works;
    for (auto& b : buckets) works.push_back(c.all_reduce(b, comm::ReduceOp::max));
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
    bool good = true;
    for (std::size_t k = 0; k < buckets.size(); ++k)
      for (std::size_t i = 0; i < buckets[k].size(); ++i)
        good &= buckets[k][i] == std::max({value(0, k, i), value(1, k, i), value(2, k, i)});
    ok[static_cast<std::size_t>(c.rank())] = good;
  });
  CHECK(ok == std::vector<char>{1, 1, 1});
}

TEST_CASE("then(): what follows a call runs once, after it completed, on the waiting thread") {
  std::vector<int> runs(2), saw_result(2);
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    const auto me = static_cast<std::size_t>(c.rank());
    std::vector<float> data(64, static_cast<float>(c.rank() + 1));
    comm::Work work = comm::then(c.all_reduce(data), [&] {
      ++runs[me];
      saw_result[me] = data[0] == 3.0f && data[63] == 3.0f;
    });
    if (me == 0)
      while (!work.test()) std::this_thread::yield();  // test() completing it runs it too
    work.wait();
    work.wait();  // once only
  });
  CHECK(runs == std::vector<int>{1, 1});
  CHECK(saw_result == std::vector<int>{1, 1});
}

TEST_CASE("then(): a continuation that failed fails every later wait() and test() too") {
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    std::vector<float> data(8, 1.0f);
    int runs = 0;
    comm::Work work = comm::then(c.all_reduce(data), [&] {
      ++runs;
      throw sk::StateError("dequantising failed");
    });
    CHECK_THROWS_WITH(work.wait(), "dequantising failed");
    CHECK_THROWS_WITH(work.wait(), "dequantising failed");  // not passed off as done
    CHECK_THROWS_WITH((void)work.test(), "dequantising failed");
    CHECK(runs == 1);
  });
}

TEST_CASE("host waits: wait() counts as a collective wait; wait_on_stream() completes uncounted") {
  comm::run_ranks(2, [&](sk::Context& ctx, comm::Communicator& c) {
    std::vector<float> data(64, static_cast<float>(c.rank() + 1));
    const sk::HostWaits start = ctx.host_waits();
    c.all_reduce(data).wait();
    CHECK((ctx.host_waits() - start).collective_waits == 1);
    CHECK(data[0] == 3.0f);
    // Asked after a test() found it complete: still counted (the code asked to block).
    comm::Work polled = c.all_reduce(data);
    while (!polled.test()) std::this_thread::yield();
    polled.wait();
    CHECK((ctx.host_waits() - start).collective_waits == 2);
    CHECK(data[63] == 6.0f);
    // Over host memory the stream-ordered wait is a host wait, complete on return, but is not
    // counted: on a GPU it would not block the host. then() passes it to its call.
    c.all_reduce(data).wait_on_stream();
    CHECK(data[0] == 12.0f);
    int after = 0;
    comm::Work continued = comm::then(c.all_reduce(data), [&] { after = data[5] == 24.0f; });
    continued.wait_on_stream();
    CHECK(after == 1);
    // The wrapper counts nothing itself (its call would), and `after` does not run again.
    continued.wait();
    CHECK(after == 1);
    comm::Work().wait();  // an already complete call belongs to no communicator
    CHECK((ctx.host_waits() - start).collective_waits == 2);
    CHECK((ctx.host_waits() - start).reads == 0);
  });
}

TEST_CASE("SIGUSR1 prints every live communicator's last calls to stderr, and the job goes on") {
  comm::install_recorder_dump(SIGUSR1);
  sk::testing::CapturedStderr captured;  // (for the length of the case)
  std::string text;
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    std::vector<float> data(10, 1.0f);
    c.all_reduce(data).wait();
    {
      auto label = c.label("the test's gather");
      std::vector<float> all(20, 0.0f);
      c.all_gather(std::span<const float>(data), all).wait();
    }
    c.barrier();
    if (c.rank() == 0) {
      std::raise(SIGUSR1);
      for (int i = 0; i < 500 && text.find("rank 1 of 2") == std::string::npos; ++i) {
        std::this_thread::sleep_for(10ms);
        text = captured.text();
      }
    }
    c.barrier();
    c.all_reduce(data).wait();  // still working
  });
  captured.restore();
  CHECK(text.find("shardkit flight recorder, pid ") != std::string::npos);
  CHECK(text.find("communicator (rank 0 of 2)") != std::string::npos);
  CHECK(text.find("communicator (rank 1 of 2)") != std::string::npos);
  CHECK(text.find("all_reduce #0") != std::string::npos);
  CHECK(text.find("the test's gather") != std::string::npos);
}

TEST_CASE("dropping a Work before every rank called cancels the call instead of racing it") {
  std::latch dropped(1);
  std::string rank1_error;
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    std::vector<float> data(100, 1.0f);
    if (c.rank() == 0) {
      { comm::Work abandoned = c.all_reduce(data); }  // e.g. an exception unwound the caller
      dropped.count_down();
      CHECK(std::all_of(data.begin(), data.end(), [](float v) { return v == 1.0f; }));
      return;
    }
    dropped.wait();
    try {
      c.all_reduce(data).wait();
    } catch (const sk::StateError& e) {
      rank1_error = e.what();
    }
  });
  CHECK(rank1_error.find("all_reduce #0") != std::string::npos);
  CHECK(rank1_error.find("rank 0 dropped its Work") != std::string::npos);
}

// A rank that fails with a Work in flight drops it as it unwinds (a backward's buckets): the
// ranks waiting on that call get the drop as a consequence of its failure, and run_ranks reports
// the failing rank's own error -- it reported the lowest waiting rank's "dropped its Work".
TEST_CASE("run_ranks reports the failing rank's error when it dropped a Work in flight") {
  std::string message;
  try {
    comm::run_ranks(3, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> x(8, 1.0f);
      if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      if (c.rank() == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        const comm::Work in_flight = c.all_reduce(x);
        sk::fail<sk::InvalidArgument>("rank 2's own error");
      }
      c.all_reduce(x).wait();
    });
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK(message.find("rank 2's own error") != std::string::npos);
}

// A rank that ends on a communicator error of its own making (here the cancelled call of a Work
// its peer dropped) aborts the world like any failing rank: the peer, already in its next call,
// fails at once naming the cause, where it waited for its timeout and then blamed rank 1 for
// never calling.
TEST_CASE("a rank ending on a communicator error aborts the world; its peers do not wait") {
  comm::CommOptions slow;
  slow.timeout = 60s;
  comm::RunRanksOptions options;
  options.comm = slow;
  std::string message;
  const auto start = Clock::now();
  try {
    comm::run_ranks(
        2,
        [](sk::Context&, comm::Communicator& c) {
          std::vector<float> x(8, 1.0f), y(8, 1.0f);
          if (c.rank() == 0) {
            { comm::Work dropped = c.all_reduce(x); }  // cancels all_reduce #0
            c.all_reduce(y).wait();                    // rank 1 never gets here
          } else {
            std::this_thread::sleep_for(50ms);
            c.all_reduce(x).wait();  // the cancelled call: PeerFailed, and rank 1 ends
          }
        },
        options);
  } catch (const std::exception& e) {
    message = e.what();
  }
  CHECK(Clock::now() - start < 30s);
  CHECK(message.find("rank 0 dropped its Work") != std::string::npos);
  CHECK(message.find("timed out") == std::string::npos);
}

TEST_CASE("a timeout of milliseconds::max() waits without end instead of expiring at once") {
  comm::RunRanksOptions options;
  options.comm.timeout = std::chrono::milliseconds::max();
  std::vector<float> results(2);
  comm::run_ranks(
      2,
      [&](sk::Context&, comm::Communicator& c) {
        if (c.rank() == 1) std::this_thread::sleep_for(50ms);
        std::vector<float> x(4, 1.0f);
        c.all_reduce(x).wait();
        results[static_cast<std::size_t>(c.rank())] = x[3];
      },
      options);
  CHECK(results == std::vector<float>{2.0f, 2.0f});
}

TEST_CASE("aborting with an empty reason still aborts: later calls fail") {
  comm::run_ranks(2, [&](sk::Context&, comm::Communicator& c) {
    auto& local = dynamic_cast<comm::LocalCommunicator&>(c);
    local.abort("");
    std::vector<float> x(4, 1.0f);
    CHECK_THROWS_AS(c.all_reduce(x).wait(), comm::CommunicatorAborted);
  });
}

TEST_CASE("group scopes batch calls; barrier and split refuse to run inside one") {
  std::vector<char> ok(4);
  comm::run_ranks(4, [&](sk::Context&, comm::Communicator& c) {
    // (b differs by rank and element: its average is no rank's input)
    std::vector<float> a(33, 1.0f), b(17), gathered(4 * 5);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(c.rank()) * 2.0f + float(i);
    std::vector<float> piece(5, static_cast<float>(c.rank()));
    std::vector<comm::Work> works;
    {
      auto group = c.group();
      works.push_back(c.all_reduce(a));
      works.push_back(c.all_reduce(b, comm::ReduceOp::avg));
      works.push_back(c.all_gather(piece, gathered));
      CHECK_THROWS_AS(c.barrier(), sk::StateError);
      CHECK_THROWS_AS((void)c.split(0, 0), sk::StateError);
    }
    for (auto& w : works) w.wait();
    bool good = std::all_of(a.begin(), a.end(), [](float v) { return v == 4.0f; }) && [&] {
      for (std::size_t i = 0; i < b.size(); ++i)  // (0 + 2 + 4 + 6) / 4 + i
        if (b[i] != 3.0f + float(i)) return false;
      return true;
    }();
    for (int i = 0; i < 20; ++i)
      good &= gathered[static_cast<std::size_t>(i)] == static_cast<float>(i / 5);
    ok[static_cast<std::size_t>(c.rank())] = good;
  });
  CHECK(ok == std::vector<char>{1, 1, 1, 1});
}

TEST_CASE("no rank leaves a local barrier before every rank reached it") {
  std::atomic<int> arrived{0};
  std::vector<int> seen(5);
  comm::run_ranks(5, [&](sk::Context&, comm::Communicator& c) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * c.rank()));
    arrived.fetch_add(1);
    c.barrier();
    seen[static_cast<std::size_t>(c.rank())] = arrived.load();
  });
  CHECK(seen == std::vector<int>(5, 5));
}

TEST_CASE("split makes sub-communicators ranked by key, with their own traffic and counters") {
  struct Seen {
    int size = 0, rank = 0, sum = 0, nested_size = 0, nested_sum = 0;
    bool excluded_null = false;
    std::uint64_t child_calls = 0, parent_calls = 0;
    float parent_after = 0;
  };
  std::vector<Seen> seen(8);
  comm::run_ranks(8, [&](sk::Context&, comm::Communicator& c) {
    Seen& s = seen[static_cast<std::size_t>(c.rank())];
    // colours 0, 1, 2 by rank % 3 (sizes 3, 3, 2); key -rank reverses the order
    auto child = c.split(c.rank() % 3, -c.rank());
    REQUIRE(child != nullptr);
    s.size = child->size();
    s.rank = child->rank();
    std::vector<double> value{static_cast<double>(c.rank())};
    child->all_reduce(value).wait();
    s.sum = static_cast<int>(value[0]);
    // a split of the split, and a negative colour that opts out
    auto nested = child->split(child->rank() == 0 ? -1 : 0, child->rank());
    s.excluded_null = child->rank() == 0 ? nested == nullptr : nested != nullptr;
    if (nested) {
      std::vector<double> one{1.0};
      nested->all_reduce(one).wait();
      s.nested_size = nested->size();
      s.nested_sum = static_cast<int>(one[0]);
    }
    s.child_calls = child->stats().of(comm::CollectiveKind::all_reduce).calls;
    std::vector<float> parent_value{1.0f};
    c.all_reduce(parent_value).wait();  // the parent still works
    s.parent_after = parent_value[0];
    s.parent_calls = c.stats().of(comm::CollectiveKind::all_reduce).calls;
  });
  for (int r = 0; r < 8; ++r) {
    const Seen& s = seen[static_cast<std::size_t>(r)];
    CAPTURE(r);
    const int color = r % 3;
    std::vector<int> members;
    for (int q = 0; q < 8; ++q)
      if (q % 3 == color) members.push_back(q);
    CHECK(s.size == static_cast<int>(members.size()));
    // key = -rank: the highest old rank becomes rank 0
    const auto position = std::find(members.begin(), members.end(), r) - members.begin();
    CHECK(s.rank == static_cast<int>(members.size()) - 1 - static_cast<int>(position));
    int sum = 0;
    for (int q : members) sum += q;
    CHECK(s.sum == sum);
    CHECK(s.excluded_null);
    if (s.rank != 0) {
      CHECK(s.nested_size == static_cast<int>(members.size()) - 1);
      CHECK(s.nested_sum == s.nested_size);
    }
    CHECK(s.child_calls == 1);
    CHECK(s.parent_calls == 1);
    CHECK(s.parent_after == 8.0f);
  }
}

TEST_CASE("a rank that never arrives turns into a TimeoutError naming the call and the rank") {
  std::vector<std::string> errors(3);
  std::vector<double> waited(3);
  comm::run_ranks(
      3,
      [&](sk::Context&, comm::Communicator& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        std::vector<float> data(10, 1.0f);
        if (c.rank() == 2) {  // stuck elsewhere for longer than the timeout
          std::this_thread::sleep_for(500ms);
          try {
            c.all_reduce(data).wait();
          } catch (const comm::CommunicatorAborted& e) {
            errors[r] = e.what();
          }
          return;
        }
        const auto start = Clock::now();
        try {
          c.all_reduce(data).wait();
        } catch (const sk::TimeoutError& e) {
          errors[r] = e.what();
        } catch (const comm::CommunicatorAborted& e) {  // the other waiter timed out first
          errors[r] = std::string("aborted: ") + e.what();
        }
        waited[r] = elapsed_ms(start);
      },
      with_timeout(200ms));
  int timeouts = 0;
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(errors[r].find("all_reduce #0") != std::string::npos);
    CHECK(errors[r].find("rank(s) 2 never called it") != std::string::npos);
    timeouts += errors[r].rfind("aborted: ", 0) != 0;
    CHECK(waited[r] >= 150.0);
    CHECK(waited[r] < 450.0);  // well before rank 2 shows up
  }
  CHECK(timeouts >= 1);
  CHECK(errors[2].find("aborted") != std::string::npos);
  CHECK(errors[2].find("timed out") != std::string::npos);
}

TEST_CASE(
    "a barrier with a missing rank times out too, lists the last calls, and aborts the "
    "sub-communicators") {
  std::vector<std::string> errors(2);
  comm::run_ranks(
      2,
      [&](sk::Context&, comm::Communicator& c) {
        auto child = c.split(0, c.rank());
        if (c.rank() == 1) {
          std::this_thread::sleep_for(400ms);
          return;
        }
        try {
          c.barrier();
        } catch (const sk::TimeoutError& e) {
          errors[0] = e.what();
        }
        std::vector<float> x(3, 1.0f);
        CHECK_THROWS_AS(child->all_reduce(x).wait(), comm::CommunicatorAborted);
      },
      with_timeout(200ms));
  CHECK(errors[0].find("barrier #1") != std::string::npos);
  CHECK(errors[0].find("rank(s) 1") != std::string::npos);
  // The flight recorder: what this rank issued before it blocked.
  CHECK(errors[0].find("this rank's last calls, oldest first: split #0; barrier #1") !=
        std::string::npos);
}

TEST_CASE("run_ranks rethrows the failing rank's own error and does not wait for the timeout") {
  const auto start = Clock::now();
  std::string message;
  try {
    comm::run_ranks(4, [&](sk::Context&, comm::Communicator& c) {
      if (c.rank() == 2) sk::fail<sk::InvalidArgument>("rank 2 found a bad batch");
      std::vector<float> x(8, 1.0f);
      c.all_reduce(x).wait();  // would wait 5 minutes for rank 2 without the abort
    });
  } catch (const sk::InvalidArgument& e) {
    message = e.what();
  }
  CHECK(message == "rank 2 found a bad batch");
  CHECK(elapsed_ms(start) < 2000.0);
}

TEST_CASE(
    "every collective: survivors of a missing or failing rank get an error within "
    "timeout + 1 s, naming the call and the rank") {
  constexpr int kWorld = 3;
  constexpr auto kTimeout = 200ms;
  const auto calls = comm::testing::one_of_each_call();
  for (const auto& [name, call] : calls) {
    CAPTURE(name);
    // Rank 2 never arrives (it returns without calling): the others time out or are aborted
    // by the first that did, within the timeout plus a second, and the message names the
    // call and the missing rank.
    std::vector<std::string> errors(kWorld);
    std::vector<double> waited(kWorld);
    comm::run_ranks(
        kWorld,
        [&](sk::Context&, comm::Communicator& c) {
          const auto r = static_cast<std::size_t>(c.rank());
          if (c.rank() == 2) return;
          const auto start = Clock::now();
          comm::testing::CallBuffers buffers;
          try {
            call(c, buffers);
          } catch (const sk::TimeoutError& e) {
            errors[r] = e.what();
          } catch (const comm::CommunicatorAborted& e) {
            errors[r] = e.what();
          }
          waited[r] = elapsed_ms(start);
        },
        with_timeout(kTimeout));
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(errors[r]);
      CHECK(errors[r].find(name) != std::string::npos);
      CHECK(errors[r].find("rank(s) 2") != std::string::npos);
      CHECK(waited[r] < 200.0 + 1000.0);
    }
    // Rank 1 fails before the call: run_ranks aborts the world at once and rethrows rank 1's
    // own error, not the survivors' aborts.
    const auto start = Clock::now();
    std::string message;
    try {
      comm::run_ranks(kWorld, [&](sk::Context&, comm::Communicator& c) {
        if (c.rank() == 1) sk::fail<sk::StateError>("rank 1 ran out of data");
        comm::testing::CallBuffers buffers;
        call(c, buffers);
      });
    } catch (const sk::StateError& e) {
      message = e.what();
    }
    CHECK(message == "rank 1 ran out of data");
    CHECK(elapsed_ms(start) < 1000.0);
  }
}

TEST_CASE(
    "the order check's verdict over gathered fingerprints names the first rank and both calls") {
  // What MPI's check (after its all-gather) and NCCL's (after its read-back) decide with.
  comm::CallRecord mine;
  mine.seq = 7;
  mine.kind = comm::CollectiveKind::all_reduce;
  mine.count = 12;
  mine.reduces = true;
  mine.label = "unit 'layer2': gradient reduction";
  comm::CallRecord other = mine;
  other.kind = comm::CollectiveKind::all_gather;
  other.count = 48;
  other.reduces = false;
  std::vector<std::uint64_t> all;
  for (const auto& call : {mine, mine, other, other}) {
    const auto f = call.fingerprint();
    all.insert(all.end(), f.begin(), f.end());
  }
  CHECK(comm::first_mismatch(std::span(all).first(12), mine.fingerprint()) == -1);
  REQUIRE(comm::first_mismatch(all, mine.fingerprint()) == 2);
  const std::string message =
      comm::mismatch_message("all_reduce on rank 0 of 4 (nccl)", mine, 2, all, "no call before");
  CHECK(message.find("all_reduce on rank 0 of 4 (nccl): rank 2's collective #7 is all_gather #7 "
                     "of 48 f32") == 0);
  CHECK(message.find("but this rank's is all_reduce #7 of 12 f32 (sum) ('unit 'layer2': "
                     "gradient reduction')") != std::string::npos);
  CHECK(message.find("no call before") != std::string::npos);
  // Another label alone differs too, and says so.
  other = mine;
  other.label = "unit 'layer3': gradient reduction";
  const auto f = other.fingerprint();
  std::copy(f.begin(), f.end(), all.begin() + 6);
  CHECK(comm::first_mismatch(all, mine.fingerprint()) == 1);
  CHECK(comm::mismatch_message("w", mine, 1, all, "").find("under another label") !=
        std::string::npos);
}

// A barrier met by another rank's all_reduce is refused on both ranks, and both calls are used
// up by the meeting: the ranks are still in step. The rank that waited inside its barrier
// marked its communicator out of step, so its next call was refused while its peer waited for
// it until the timeout.
TEST_CASE("a call refused on every rank alike leaves the ranks in step and usable") {
  comm::RunRanksOptions options;
  options.comm.timeout = std::chrono::milliseconds(2000);
  const auto start = std::chrono::steady_clock::now();
  comm::run_ranks(
      2,
      [](sk::Context&, comm::Communicator& c) {
        std::vector<float> f(4, 1.0f);
        CHECK_THROWS_WITH_AS(c.rank() == 0 ? c.barrier() : c.all_reduce(f).wait(),
                             doctest::Contains("every rank must issue the same collectives"),
                             sk::InvalidArgument);
        std::vector<float> one{1.0f};
        c.all_reduce(one).wait();
        CHECK(one[0] == 2.0f);
      },
      options);
  CHECK(
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() <
      1500.0);
}
