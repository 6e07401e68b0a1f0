// comm on a CUDA GPU: the local backend over device memory (ranks share the GPU; device copies
// plus the reduction kernel) against the same fixed-order reference as the CPU, bit for bit;
// stream ordering without wait(); and NCCL at world size 1 (NCCL refuses two ranks on one GPU),
// including a non-blocking init that times out when the second rank never comes; local ranks'
// collectives inside captured steps, meeting on the device.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collective_matrix.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

namespace {

std::string joined(const std::vector<std::string>& failures) {
  std::string out;
  for (std::size_t i = 0; i < failures.size() && i < 5; ++i) out += failures[i] + "\n";
  return out;
}

}  // namespace

TEST_CASE("local collectives over device memory equal the fixed-order reference bit for bit") {
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    std::mutex mutex;
    std::vector<std::string> failures;
    comm::run_ranks(
        n,
        [&](sk::Context& ctx, comm::Communicator& c) {
          REQUIRE(ctx.device().is_cuda());
          auto mine = comm::testing::run_all_dtypes(ctx, c);
          std::lock_guard lock(mutex);
          failures.insert(failures.end(), mine.begin(), mine.end());
        },
        comm::cuda_run_options(0));
    CHECK_MESSAGE(failures.empty(), joined(failures));
  }
}

TEST_CASE("device collectives are stream-ordered: a later kernel sees the result without wait()") {
  std::vector<float> seen(3);
  comm::run_ranks(
      3,
      [&](sk::Context& ctx, comm::Communicator& c) {
        auto grads = sk::full(ctx, {4097}, sk::DType::f32, c.rank() + 1.0);
        {
          comm::Work work = c.all_reduce(grads, comm::ReduceOp::sum);
        }                                                     // dropped: stream order suffices
        auto doubled = sk::cast(ctx, grads, sk::DType::f64);  // queued on the same stream
        seen[static_cast<std::size_t>(c.rank())] =
            static_cast<float>(sk::to_vector<double>(ctx, doubled)[4096]);
      },
      comm::cuda_run_options(0));
  CHECK(seen == std::vector<float>{6.0f, 6.0f, 6.0f});
}

TEST_CASE("wait_on_stream: a device collective's consumers on the stream, no host wait counted") {
  std::vector<double> seen(2);
  comm::run_ranks(
      2,
      [&](sk::Context& ctx, comm::Communicator& c) {
        auto grads = sk::full(ctx, {4097}, sk::DType::f32, c.rank() + 1.0);
        const sk::HostWaits start = ctx.host_waits();
        c.all_reduce(grads, comm::ReduceOp::sum).wait_on_stream();
        auto doubled = sk::cast(ctx, grads, sk::DType::f64);  // queued on the same stream
        CHECK((ctx.host_waits() - start).total() == 0);
        seen[static_cast<std::size_t>(c.rank())] = sk::to_vector<double>(ctx, doubled)[4096];
        c.all_reduce(grads).wait();  // the host wait, counted
        CHECK((ctx.host_waits() - start).collective_waits == 1);
      },
      comm::cuda_run_options(0));
  CHECK(seen == std::vector<double>{3.0, 3.0});
  // NCCL, inside a group (launched at the group's end) and alone.
  auto ctx = sk::make_cuda_context(0);
  comm::NcclCommunicator nccl(*ctx, comm::NcclCommunicator::unique_id(), 0, 1);
  auto a = sk::full(*ctx, {100}, sk::DType::f32, 2.0);
  const sk::HostWaits start = ctx->host_waits();
  comm::Work grouped;
  {
    auto group = nccl.group();
    comm::assign(grouped, nccl.all_reduce(a));
  }
  grouped.wait_on_stream();
  nccl.all_reduce(a, comm::ReduceOp::max).wait_on_stream();
  CHECK((ctx->host_waits() - start).total() == 0);
  CHECK(sk::to_vector<float>(*ctx, a)[99] == 2.0f);
}

TEST_CASE("NCCL at world size 1: every collective, groups, split, barrier and counters") {
  auto ctx = sk::make_cuda_context(0);
  const ncclUniqueId id = comm::NcclCommunicator::unique_id();
  comm::NcclCommunicator nccl(*ctx, id, 0, 1);
  CHECK(nccl.backend() == "nccl");
  CHECK(nccl.size() == 1);
  comm::testing::MatrixConfig config;
  config.exact_order = false;
  config.reduced_precision_wire = true;
  const auto failures = comm::testing::run_all_dtypes(*ctx, nccl, config);
  CHECK_MESSAGE(failures.empty(), joined(failures));

  auto a = sk::full(*ctx, {100}, sk::DType::f32, 2.0);
  auto b = sk::full(*ctx, {50}, sk::DType::bf16, 3.0);
  std::vector<comm::Work> works;
  {
    auto group = nccl.group();
    works.push_back(nccl.all_reduce(a));
    works.push_back(nccl.all_reduce(b, comm::ReduceOp::max));
  }
  for (auto& w : works) w.wait();
  CHECK(sk::to_vector<float>(*ctx, a)[99] == 2.0f);
  nccl.barrier();

  auto child = nccl.split(0, 0);
  REQUIRE(child != nullptr);
  CHECK(child->size() == 1);
  CHECK(nccl.split(-1, 0) == nullptr);
  CHECK(nccl.stats().of(comm::CollectiveKind::barrier).calls == 1);
  CHECK(nccl.stats().total_bus_bytes() == 0);  // nothing leaves a single rank

  std::vector<float> host(4, 1.0f);
  CHECK_THROWS_WITH_AS(nccl.all_reduce(host).wait(), doctest::Contains("NCCL moves device memory"),
                       sk::InvalidArgument);
}

TEST_CASE("make_communicator with RANK=0 WORLD_SIZE=1 on a GPU context builds NCCL") {
  auto ctx = sk::make_cuda_context(0);
  auto c = comm::make_communicator(*ctx, {}, [](const char* name) -> std::optional<std::string> {
    if (std::string(name) == "RANK") return "0";
    if (std::string(name) == "WORLD_SIZE") return "1";
    return std::nullopt;
  });
  CHECK(c->backend() == "nccl");
  auto x = sk::full(*ctx, {10}, sk::DType::f16, 1.5);
  c->all_reduce(x, comm::ReduceOp::avg).wait();
  CHECK(sk::to_vector<sk::Half>(*ctx, x)[3].to_float() == 1.5f);
}

TEST_CASE("NCCL init waiting for a rank that never comes times out and aborts") {
  auto ctx = sk::make_cuda_context(0);
  const ncclUniqueId id = comm::NcclCommunicator::unique_id();
  comm::CommOptions options;
  options.timeout = std::chrono::milliseconds(500);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(comm::NcclCommunicator(*ctx, id, 0, 2, options),
                       doctest::Contains("NCCL init of rank 0 of 2"), sk::TimeoutError);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
}

TEST_CASE("NCCL's order check: exchanges queued without a host wait, read back, slots reused") {
  // One GPU holds one NCCL rank, so no peer can disagree here: this runs the check's plumbing
  // (the upload, the all-gather alone and in a group, the read-back, the comparison) at world
  // size 1; the verdict's logic is the one MPI's check uses (test_local_behaviour).
  auto ctx = sk::make_cuda_context(0);
  comm::NcclCommunicator nccl(*ctx, comm::NcclCommunicator::unique_id(), 0, 1);
  comm::detail::NcclOrderCheck check(*ctx, 1, "rank 0 of 1 (nccl)",
                                     std::make_shared<comm::FlightRecorder>());
  const auto settle = [](ncclResult_t status) { REQUIRE(status == ncclSuccess); };
  comm::CallRecord call;
  call.kind = comm::CollectiveKind::all_gather;
  call.count = 4096;
  const auto start = ctx->host_waits();
  for (int i = 0; i < 100; ++i) {
    call.seq = static_cast<std::uint64_t>(i);
    check.exchange(call, nccl.handle(), false, settle);
  }
  {
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int i = 100; i < 104; ++i) {
      call.seq = static_cast<std::uint64_t>(i);
      check.exchange(call, nccl.handle(), true, settle);
    }
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    check.end_group();
  }
  CHECK((ctx->host_waits() - start).total() == 0);
  ctx->synchronize();
  CHECK(check.harvest().empty());
  CHECK(check.pending() == 0);
  CHECK(check.slots() == 104);
  for (int i = 104; i < 204; ++i) {
    call.seq = static_cast<std::uint64_t>(i);
    check.exchange(call, nccl.handle(), false, settle);
  }
  ctx->synchronize();
  CHECK(check.harvest().empty());
  CHECK(check.slots() == 104);  // compared slots were reused

  // The communicator itself: at one rank the base class skips the check, so the calls with
  // validate_order on behave as without it.
  comm::CommOptions options;
  options.validate_order = true;
  comm::NcclCommunicator checked(*ctx, comm::NcclCommunicator::unique_id(), 0, 1, options);
  auto a = sk::full(*ctx, {100}, sk::DType::f32, 2.0);
  checked.all_reduce(a).wait();
  CHECK(sk::to_vector<float>(*ctx, a)[99] == 2.0f);
}

// Local ranks sharing the GPU, each capturing its step (StepGraph): the ranks' graphs meet on
// the device (comm/device_rendezvous.hpp). Every replay must equal the eager calls bit for bit
// on fresh inputs -- in-place all_reduce (staged through scratch), all_gather into a buffer,
// in-place reduce_scatter, broadcast, an f16 all_reduce -- with no host wait in the step.

namespace {

// Rank r's collectives of step `it`, eagerly or through its StepGraph; returns what it saw.
std::vector<float> run_collective_steps(sk::Context& ctx, comm::Communicator& c, bool graphed,
                                        int steps) {
  const int n = c.size(), r = c.rank();
  auto grads = sk::empty(ctx, {1000}, sk::DType::f32);
  auto piece = sk::empty(ctx, {333}, sk::DType::f32);
  auto gathered = sk::empty(ctx, {n * 333}, sk::DType::f32);
  auto scattered = sk::empty(ctx, {n * 256}, sk::DType::f32);
  auto halves = sk::empty(ctx, {517}, sk::DType::f16);
  std::optional<sk::StepGraph> graph;
  if (graphed) graph.emplace(ctx, "collectives");
  auto step = [&] {
    c.all_reduce(grads).wait_on_stream();
    c.all_gather(piece, gathered).wait_on_stream();
    c.reduce_scatter(scattered, scattered.slice(0, r * 256, (r + 1) * 256)).wait_on_stream();
    c.broadcast(piece, 1).wait_on_stream();
    c.all_reduce(halves, comm::ReduceOp::avg).wait_on_stream();
  };
  std::vector<float> seen;
  for (int it = 0; it < steps; ++it) {
    auto values = [&](std::int64_t count, int salt) {
      std::vector<float> v(static_cast<std::size_t>(count));
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = std::sin(0.37f * static_cast<float>(i) + 1.7f * r + 0.9f * it + salt) * 3.1f;
      return v;
    };
    sk::copy(ctx, grads, sk::from_vector(ctx, values(1000, 1), {1000}));
    sk::copy(ctx, piece, sk::from_vector(ctx, values(333, 2), {333}));
    sk::copy(ctx, scattered, sk::from_vector(ctx, values(n * 256, 3), {n * 256}));
    sk::copy(ctx, halves, sk::from_vector(ctx, values(517, 4), {517}));
    const sk::HostWaits before = ctx.host_waits();
    if (graph)
      graph->run("step", step);
    else
      step();
    CHECK((ctx.host_waits() - before).total() == 0);
    for (const sk::Tensor& t :
         {grads, piece, gathered, scattered, sk::cast(ctx, halves, sk::DType::f32)}) {
      const auto v = sk::to_vector<float>(ctx, t);
      seen.insert(seen.end(), v.begin(), v.end());
    }
  }
  if (graph) {
    CHECK(graph->stats().captures == 1);
    CHECK(graph->stats().replays == steps - 3);
  }
  return seen;
}

}  // namespace

TEST_CASE("local collectives inside captured steps: replays equal eager calls bit for bit") {
  // The device waits take microseconds; a short timeout turns a wait that never ends (ranks'
  // graphs the device does not run side by side) into this test's failure, not a lost lease.
  comm::CommOptions options;
  options.timeout = std::chrono::seconds(10);
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<std::vector<float>> eager(static_cast<std::size_t>(n)),
        graphed(static_cast<std::size_t>(n));
    for (bool use_graph : {false, true})
      comm::run_ranks(
          n,
          [&](sk::Context& ctx, comm::Communicator& c) {
            auto seen = run_collective_steps(ctx, c, use_graph, 7);
            (use_graph ? graphed : eager)[static_cast<std::size_t>(c.rank())] = std::move(seen);
          },
          comm::cuda_run_options(0, options));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(eager[static_cast<std::size_t>(r)] == graphed[static_cast<std::size_t>(r)]);
    }
  }
}

namespace {

// After replays together, two ranks' captured steps part: rank 0 runs `rank0`, which must end
// in a TimeoutError (its message kept in errors[0]); rank 1 runs `rank1`, waits until rank 0 is
// done however it leaves (another error must fail the case, not leave rank 1 waiting), then
// makes an eager call, which the world aborted with the verdict refuses (errors[1]).
void part_ranks(comm::Communicator& c, const sk::Tensor& grads, std::atomic<bool>& rank0_done,
                std::vector<std::string>& errors, const std::function<void()>& rank0,
                const std::function<void()>& rank1) {
  const auto i = static_cast<std::size_t>(c.rank());
  if (c.rank() == 0) {
    struct Done {
      std::atomic<bool>& flag;
      ~Done() { flag = true; }
    } done{rank0_done};
    try {
      rank0();
    } catch (const sk::TimeoutError& e) {
      errors[i] = e.what();
    }
    return;
  }
  rank1();
  while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  try {
    c.all_reduce(grads).wait_on_stream();
  } catch (const comm::CommunicatorAborted& e) {
    errors[i] = e.what();
  }
}

}  // namespace

// Two local ranks' captured steps part after replays together, and the verdict is raised on
// the host, never a hung GPU:
// - rank 0 goes on replaying, rank 1 does not: the ranks' host threads meet before each run of a
//   graph with the world's collectives (LocalCommunicator::meet_around_graph_run), so rank 0's
//   run is refused there, before its graph could wait on the device;
// - both run a graph but not the same one (rank 0 a step of two all_reduces, rank 1 one of
//   one): rank 0's graph waits on the device for arrivals that never come, gives up after the
//   world's timeout, and the verdict is raised at rank 0's next host wait.
// Either way the world is aborted with the verdict, which rank 1's next call reports.
TEST_CASE("local ranks whose captured steps part: the verdict is raised on the host") {
  bool stops = false;
  std::vector<std::string> expected;
  SUBCASE("a rank that stops replaying: the other's run is refused before its launch") {
    stops = true;
    expected = {"graph run meeting", "timed out after 400 ms: rank(s) 1 never called it"};
  }
  SUBCASE("ranks replaying different captured steps: the device's waits time out") {
    expected = {"rank 0 waited more than 400 ms for the others on the device",
                "replay its captured steps the same number of times"};
  }
  comm::CommOptions options;
  options.timeout = std::chrono::milliseconds(400);
  std::vector<std::string> errors(2);
  std::atomic<bool> rank0_done{false};
  comm::run_ranks(
      2,
      [&](sk::Context& ctx, comm::Communicator& c) {
        auto grads = sk::full(ctx, {4096}, sk::DType::f32, c.rank() + 1.0);
        sk::StepGraph graph(ctx, "all_reduce");
        auto once = [&] { c.all_reduce(grads).wait_on_stream(); };
        auto twice = [&] {
          c.all_reduce(grads).wait_on_stream();
          c.all_reduce(grads).wait_on_stream();
        };
        for (int it = 0; it < 4; ++it) graph.run("once", once);  // warm-up, capture, replay
        ctx.synchronize();  // both ranks met at every call so far
        CHECK(sk::to_vector<float>(ctx, grads)[4095] == 24.0f);  // 1 + 2, then doubled 3 times
        if (stops) {
          part_ranks(
              c, grads, rank0_done, errors, [&] { graph.run("once", once); },  // never joined
              [] {});
          return;
        }
        for (int it = 0; it < 4; ++it) graph.run("twice", twice);
        part_ranks(
            c, grads, rank0_done, errors,
            [&] {
              graph.run("twice", twice);  // its second all_reduce finds nobody on the device
              ctx.synchronize();          // the device gave up waiting; the verdict is raised here
            },
            [&] { graph.run("once", once); });
      },
      comm::cuda_run_options(0, options));
  for (const std::string& error : errors)
    for (const std::string& part : expected)
      CHECK_MESSAGE(error.find(part) != std::string::npos, error);
}

// cudaFree waits for all of the device's work. Were the ranks not to meet around each run of
// their graphs, rank 0's next replay would wait on the device for rank 1's, while rank 1's host
// waited in cudaFree for rank 0's graph: stuck until the world's timeout.
TEST_CASE("a rank's host call that waits for the whole device between replays: no deadlock") {
  comm::CommOptions options;
  options.timeout = std::chrono::seconds(10);
  comm::run_ranks(
      2,
      [&](sk::Context& ctx, comm::Communicator& c) {
        auto grads = sk::empty(ctx, {1000}, sk::DType::f32);
        sk::StepGraph graph(ctx, "all_reduce");
        for (int it = 0; it < 8; ++it) {
          sk::fill(ctx, grads, c.rank() + it);
          graph.run("step", [&] { c.all_reduce(grads).wait_on_stream(); });
          if (c.rank() == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 goes ahead
            void* block = nullptr;
            REQUIRE(cudaMalloc(&block, 1 << 20) == cudaSuccess);
            REQUIRE(cudaFree(block) == cudaSuccess);
          }
          CHECK(sk::to_vector<float>(ctx, grads)[999] == static_cast<float>(2 * it + 1));
        }
        CHECK(graph.stats().replays == 5);
      },
      comm::cuda_run_options(0, options));
}
