// ThreadPool: every task runs exactly once whatever the thread count, blocks are contiguous and
// fixed by (tasks, threads), errors come back to the caller, and nested or concurrent calls run
// serially instead of deadlocking.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <shardkit/core/context.hpp>
#include <shardkit/core/thread_pool.hpp>

namespace sk = shardkit;

TEST_CASE("ThreadPool::parallel_for runs every task once, on 1 to 7 threads") {
  for (int threads = 1; threads <= 7; ++threads) {
    sk::ThreadPool pool(threads);
    CHECK(pool.size() == threads);
    for (std::int64_t tasks : {0, 1, 2, 3, 7, 8, 100, 1001}) {
      std::vector<std::atomic<int>> runs(static_cast<std::size_t>(tasks));
      pool.parallel_for(tasks, [&](std::int64_t i) { runs[static_cast<std::size_t>(i)]++; });
      for (std::int64_t i = 0; i < tasks; ++i) {
        INFO(threads, " threads, ", tasks, " tasks, task ", i);
        CHECK(runs[static_cast<std::size_t>(i)] == 1);
      }
    }
  }
}

TEST_CASE("ThreadPool::parallel_for gives each thread one contiguous block, the caller the first") {
  sk::ThreadPool pool(4);
  std::vector<std::thread::id> owner(10);
  for (int repeat = 0; repeat < 20; ++repeat) {
    pool.parallel_for(10, [&](std::int64_t i) {
      owner[static_cast<std::size_t>(i)] = std::this_thread::get_id();
    });
    // Blocks of [0,2) [2,5) [5,7) [7,10): tasks * t / used.
    CHECK(owner[0] == std::this_thread::get_id());
    CHECK(owner[1] == owner[0]);
    CHECK(owner[2] != owner[0]);
    CHECK(owner[3] == owner[2]);
    CHECK(owner[4] == owner[2]);
    CHECK(owner[5] != owner[2]);
    CHECK(owner[6] == owner[5]);
    CHECK(owner[7] != owner[5]);
    CHECK(owner[9] == owner[7]);
  }
}

TEST_CASE("ThreadPool::parallel_for rethrows a task's error after every block ended") {
  sk::ThreadPool pool(3);
  std::atomic<int> ran{0};
  auto failing = [&](std::int64_t i) {
    ran++;
    if (i == 7) throw std::runtime_error("task 7 failed");
  };
  CHECK_THROWS_WITH_AS(pool.parallel_for(9, failing), "task 7 failed", std::runtime_error);
  // Block [6, 9) stops at its failing task; the other blocks ran to the end.
  CHECK(ran == 8);
  // The pool still works afterwards.
  std::atomic<int> sum{0};
  pool.parallel_for(100, [&](std::int64_t i) { sum += static_cast<int>(i); });
  CHECK(sum == 4950);
}

TEST_CASE("ThreadPool: a call from inside a task, or beside a running call, runs serially") {
  sk::ThreadPool pool(3);
  std::atomic<int> inner_runs{0};
  pool.parallel_for(3, [&](std::int64_t) {
    const auto me = std::this_thread::get_id();
    pool.parallel_for(5, [&](std::int64_t) {
      CHECK(std::this_thread::get_id() == me);
      inner_runs++;
    });
  });
  CHECK(inner_runs == 15);

  std::atomic<long> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int repeat = 0; repeat < 50; ++repeat)
        pool.parallel_for(64, [&](std::int64_t i) { total += i; });
    });
  for (auto& t : callers) t.join();
  CHECK(total == 4L * 50 * (63 * 64 / 2));
}

TEST_CASE("ThreadPool and the CPU thread count: bad values are refused naming the fix") {
  CHECK_THROWS_WITH_AS(sk::ThreadPool(0), "a ThreadPool needs 1 to 4096 threads, got 0", sk::Error);
  CHECK_THROWS_WITH_AS(sk::Context(sk::ContextOptions{.cpu_threads = -2}),
                       doctest::Contains("ContextOptions::cpu_threads is -2"), sk::Error);
  // (Refused where the option is given, not at the first host op's pool.)
  CHECK_THROWS_WITH_AS(sk::Context(sk::ContextOptions{.cpu_threads = 5000}),
                       doctest::Contains("ContextOptions::cpu_threads is 5000; use a thread "
                                         "count from 1 to 4096"),
                       sk::Error);
  sk::Context three(sk::ContextOptions{.cpu_threads = 3});
  CHECK(three.cpu_threads() == 3);
  CHECK(three.cpu_pool().size() == 3);

  const char* saved = std::getenv("SHARDKIT_NUM_THREADS");
  const std::string restore = saved ? saved : "";
  ::setenv("SHARDKIT_NUM_THREADS", "5", 1);
  CHECK(sk::default_cpu_threads() == 5);
  CHECK(sk::Context().cpu_threads() == 5);
  ::setenv("SHARDKIT_NUM_THREADS", "many", 1);
  CHECK_THROWS_WITH_AS(sk::default_cpu_threads(),
                       "SHARDKIT_NUM_THREADS is 'many'; set it to a thread count from 1 to 4096",
                       sk::Error);
  if (saved)
    ::setenv("SHARDKIT_NUM_THREADS", restore.c_str(), 1);
  else
    ::unsetenv("SHARDKIT_NUM_THREADS");
}

TEST_CASE(
    "without SHARDKIT_NUM_THREADS, processes a launcher put on this machine share its cores") {
  const char* names[] = {"SHARDKIT_NUM_THREADS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                         "MPI_LOCALNRANKS"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* name : names) {
    if (const char* value = std::getenv(name)) saved.emplace_back(name, value);
    ::unsetenv(name);
  }
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  CHECK(sk::launcher_local_processes() == 1);
  CHECK(sk::default_cpu_threads() == hardware);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);  // torchrun
  CHECK(sk::launcher_local_processes() == 2);
  CHECK(sk::default_cpu_threads() == std::max(1, hardware / 2));
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4096", 1);  // mpirun, checked first; at least 1 thread
  CHECK(sk::default_cpu_threads() == 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "two", 1);  // not a count: the next launcher's word
  CHECK(sk::launcher_local_processes() == 2);
  ::setenv("SHARDKIT_NUM_THREADS", "3", 1);  // the user's word wins
  CHECK(sk::default_cpu_threads() == 3);
  for (const char* name : names) ::unsetenv(name);
  for (const auto& [name, value] : saved) ::setenv(name.c_str(), value.c_str(), 1);
}
