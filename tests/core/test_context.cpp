// Contexts: device and rank, per-context memory accounting, resources, independence of contexts.
#include <doctest/doctest.h>

#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;

TEST_CASE("a CPU context owns its allocator, statistics and random stream") {
  sk::Context ctx({.rank = 3, .seed = 11});
  CHECK(ctx.device() == sk::Device::cpu());
  CHECK(ctx.rank() == 3);
  CHECK(ctx.seed() == 11);
  CHECK(&ctx.allocator() == &ctx.host_allocator());
  auto grads = sk::empty(ctx, {256}, sk::DType::f32, sk::MemoryCategory::gradients);
  CHECK(ctx.memory_stats().current(sk::MemoryCategory::gradients) == 1024);
  CHECK(ctx.take_random_blocks(10) == 0);
  CHECK(ctx.take_random_blocks(5) == 10);
}

TEST_CASE("contexts are independent: N ranks as N threads see only their own memory") {
  constexpr int kRanks = 4;
  std::vector<std::int64_t> peaks(kRanks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank)
    threads.emplace_back([&, rank] {
      sk::Context ctx({.rank = rank});
      auto t =
          sk::empty(ctx, {1000 * (rank + 1)}, sk::DType::f32, sk::MemoryCategory::optimizer_state);
      sk::fill(ctx, t, rank);
      peaks[static_cast<std::size_t>(rank)] = ctx.memory_stats().peak_total();
    });
  for (auto& thread : threads) thread.join();
  for (int rank = 0; rank < kRanks; ++rank)
    CHECK(peaks[static_cast<std::size_t>(rank)] == 4000 * (rank + 1));
}

TEST_CASE("resources are made once per context and per type") {
  struct Handle {
    int value;
  };
  sk::Context ctx;
  int made = 0;
  auto make = [&] {
    ++made;
    return std::make_shared<Handle>(Handle{42});
  };
  CHECK(ctx.resource<Handle>(make).value == 42);
  ctx.resource<Handle>(make).value = 7;
  CHECK(ctx.resource<Handle>(make).value == 7);
  CHECK(made == 1);
  sk::Context other;
  CHECK(other.resource<Handle>(make).value == 42);
  CHECK(made == 2);
}

// Deferred checks (what the CUDA cross-entropy's label check uses): run at the next
// synchronize(), once per key however often registered, all of them even when one throws, the
// first error raised; then gone.
TEST_CASE("deferred checks run at the next synchronize, once, and raise the first error") {
  sk::Context ctx;
  std::vector<std::string> ran;
  ctx.defer_check("a", [&] { ran.push_back("a"); });
  ctx.defer_check("a", [&] { ran.push_back("a again"); });  // already pending: kept as it was
  ctx.defer_check("b", [&] {
    ran.push_back("b");
    sk::fail<sk::InvalidArgument>("b found bad input");
  });
  ctx.defer_check("c", [&] {
    ran.push_back("c");
    sk::fail<sk::StateError>("c found bad state");
  });
  CHECK(ran.empty());
  CHECK_THROWS_WITH_AS(ctx.synchronize(), doctest::Contains("b found bad input"),
                       sk::InvalidArgument);
  CHECK(ran == std::vector<std::string>{"a", "b", "c"});
  ctx.synchronize();  // nothing pending
  CHECK(ran.size() == 3);
  ctx.defer_check("a", [&] { ran.push_back("a once more"); });
  ctx.synchronize();
  CHECK(ran.back() == "a once more");
}

TEST_CASE("cuda_device_count() is 0 without a GPU, and a CUDA context then fails clearly") {
  if (sk::cuda_device_count() > 0) return;  // covered by the GPU tests instead
  CHECK_FALSE(sk::cuda_available());
  try {
    sk::Context ctx({.device = sk::Device::cuda(0)});
    FAIL("no throw");
  } catch (const sk::NotAvailable& e) {
    const std::string text = e.what();
    CHECK(text.find("cuda:0") != std::string::npos);
    CHECK(text.find(sk::kWithCuda ? "0 usable CUDA GPU" : "built without CUDA") !=
          std::string::npos);
  }
}
