// Traffic counters (nccl-tests' bus bytes, and the ZeRO volume ratios of docs/semantics.md), launch
// detection from the environment, and make_communicator without a launcher.
#include <doctest/doctest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shardkit/comm/bootstrap.hpp"
#include "shardkit/comm/run_ranks.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

TEST_CASE("bus factors are nccl-tests' and vanish on one rank") {
  CHECK(comm::bus_factor(comm::CollectiveKind::all_reduce, 4).value() == doctest::Approx(1.5));
  CHECK(comm::bus_factor(comm::CollectiveKind::all_gather, 4).value() == doctest::Approx(0.75));
  CHECK(comm::bus_factor(comm::CollectiveKind::reduce_scatter, 8).value() ==
        doctest::Approx(0.875));
  CHECK(comm::bus_factor(comm::CollectiveKind::broadcast, 8).value() == doctest::Approx(1.0));
  CHECK(comm::bus_factor(comm::CollectiveKind::all_reduce, 1).value() == 0.0);
  CHECK(comm::bus_bytes(comm::CollectiveKind::all_reduce, 4000, 3) == 5333);  // floor(8000 / 3)
}

TEST_CASE("counters record calls, message bytes and bus bytes per collective kind") {
  std::vector<comm::CommStats> stats(4);
  comm::run_ranks(4, [&](sk::Context&, comm::Communicator& c) {
    std::vector<float> grads(1000, 1.0f), piece(10, 1.0f), gathered(40), scattered(10);
    std::vector<sk::Half> half(100, sk::Half(1.0f));
    c.all_reduce(grads).wait();
    c.all_gather(piece, gathered).wait();
    c.reduce_scatter(gathered, scattered).wait();
    c.broadcast(half, 0).wait();
    const std::vector<std::size_t> counts{1, 2, 3, 4};
    c.all_gather_v(grads, counts).wait();
    c.barrier();
    stats[static_cast<std::size_t>(c.rank())] = c.stats();
  });
  for (const auto& s : stats) {
    using K = comm::CollectiveKind;
    CHECK(s.of(K::all_reduce).calls == 1);
    CHECK(s.of(K::all_reduce).payload_bytes == 4000);
    CHECK(s.of(K::all_reduce).bus_bytes == 6000);  // 2 (n-1)/n
    CHECK(s.of(K::all_gather).payload_bytes == 160);
    CHECK(s.of(K::all_gather).bus_bytes == 120);
    CHECK(s.of(K::reduce_scatter).payload_bytes == 160);
    CHECK(s.of(K::reduce_scatter).bus_bytes == 120);
    CHECK(s.of(K::broadcast).payload_bytes == 200);
    CHECK(s.of(K::broadcast).bus_bytes == 200);
    CHECK(s.of(K::all_gather_v).payload_bytes == 40);
    CHECK(s.of(K::all_gather_v).bus_bytes == 30);
    CHECK(s.of(K::barrier).calls == 1);
    CHECK(s.total_calls() == 6);
    CHECK(s.total_bus_bytes() == 6000 + 120 + 120 + 200 + 30);
  }
}

TEST_CASE("counted volumes reproduce the ZeRO paper: ZeRO-3 sends 1.5x what DDP sends") {
  // Psi gradients/parameters, N = 4 ranks, fp32. DDP: one all-reduce of the gradients.
  // ZeRO-3: all-gather parameters for forward and for backward, reduce-scatter gradients.
  constexpr std::size_t kPsi = 4096;
  std::vector<std::uint64_t> ddp(4), zero3(4);
  comm::run_ranks(4, [&](sk::Context&, comm::Communicator& c) {
    std::vector<float> full(kPsi, 1.0f), shard(kPsi / 4, 1.0f);
    c.all_reduce(full).wait();
    ddp[static_cast<std::size_t>(c.rank())] = c.stats().total_bus_bytes();
    c.reset_stats();
    c.all_gather(shard, full).wait();
    c.all_gather(shard, full).wait();
    c.reduce_scatter(full, shard).wait();
    zero3[static_cast<std::size_t>(c.rank())] = c.stats().total_bus_bytes();
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(ddp[r] == 2 * kPsi * 4 * 3 / 4);  // 2 Psi (N-1)/N elements of 4 bytes
    CHECK(zero3[r] * 2 == ddp[r] * 3);
  }
}

namespace {

comm::EnvLookup fake_env(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const char* name) -> std::optional<std::string> {
    auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace

TEST_CASE("detect_launch reads mpirun, PMI, torchrun-style variables, or nothing") {
  auto alone = comm::detect_launch(fake_env({}));
  CHECK(alone.kind == comm::LaunchKind::single);
  CHECK(alone.size == 1);

  auto ompi = comm::detect_launch(fake_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                            {"OMPI_COMM_WORLD_SIZE", "8"},
                                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                            {"RANK", "5"},
                                            {"WORLD_SIZE", "6"}}));
  CHECK(ompi.kind == comm::LaunchKind::mpi);  // mpirun wins over leftover RANK variables
  CHECK(ompi.rank == 3);
  CHECK(ompi.size == 8);
  CHECK(ompi.local_rank == 1);

  auto pmi = comm::detect_launch(fake_env({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}}));
  CHECK(pmi.kind == comm::LaunchKind::mpi);
  CHECK(pmi.rank == 2);

  auto torchrun =
      comm::detect_launch(fake_env({{"RANK", "5"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}}));
  CHECK(torchrun.kind == comm::LaunchKind::env);
  CHECK(torchrun.rank == 5);
  CHECK(torchrun.size == 16);
  CHECK(torchrun.local_rank == 1);
}

TEST_CASE("detect_launch names the variable and value it cannot use") {
  CHECK_THROWS_WITH_AS(comm::detect_launch(fake_env({{"RANK", "two"}, {"WORLD_SIZE", "4"}})),
                       doctest::Contains("RANK='two' is not a non-negative integer"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(comm::detect_launch(fake_env({{"RANK", "4"}, {"WORLD_SIZE", "4"}})),
                       doctest::Contains("rank 4 of 4 ranks"), sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(comm::detect_launch(fake_env({{"RANK", "0"}})),
                       doctest::Contains("set both"), sk::InvalidArgument);
}

TEST_CASE("make_communicator: one local rank alone, a clear refusal of multi-rank CPU env") {
  sk::Context ctx;
  auto alone = comm::make_communicator(ctx, {}, fake_env({}));
  CHECK(alone->backend() == "local");
  CHECK(alone->size() == 1);
  std::vector<float> x{1.5f, -2.0f}, y(2);
  alone->all_reduce(x, y, comm::ReduceOp::avg).wait();
  CHECK(y == x);

  auto one = comm::make_communicator(ctx, {}, fake_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  CHECK(one->size() == 1);

  CHECK_THROWS_WITH_AS(
      (void)comm::make_communicator(ctx, {}, fake_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}})),
      doctest::Contains("launch with mpirun"), sk::NotAvailable);
}
