// ReduceScatterCoalescer: small reduce_scatter_v calls held back and sent as one; the results
// equal the separate calls bit for bit, with fewer collectives, and the batch goes out at the
// capacity, at a wait, or at flush().
#include <doctest/doctest.h>

#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/parallel/reduce_scatter_coalescer.hpp"

namespace sk = shardkit;

namespace {

// Call k of rank r: counts per owner (zeros included) and values from a seeded stream.
std::vector<std::size_t> counts_of(int k, int world) {
  std::vector<std::size_t> counts;
  for (int r = 0; r < world; ++r) counts.push_back(static_cast<std::size_t>((k * 3 + r * 5) % 7));
  return counts;
}

sk::Tensor send_of(sk::Context& ctx, int k, int rank, const std::vector<std::size_t>& counts) {
  std::int64_t total = 0;
  for (auto c : counts) total += static_cast<std::int64_t>(c);
  sk::Context values({.seed = 100u + 17u * static_cast<unsigned>(k) + static_cast<unsigned>(rank)});
  auto t = sk::empty(values, {total}, sk::DType::f32);
  sk::normal_(values, t, 0.0, 1.0);
  return sk::clone(ctx, t);
}

}  // namespace

TEST_CASE("coalesced reduce-scatters equal the separate calls, in fewer collectives") {
  const int world = 3, calls = 6;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    std::vector<sk::Tensor> sends, alone, together;
    for (int k = 0; k < calls; ++k) {
      const auto counts = counts_of(k, world);
      sends.push_back(send_of(ctx, k, comm.rank(), counts));
      const auto own = static_cast<std::int64_t>(counts[static_cast<std::size_t>(comm.rank())]);
      alone.push_back(sk::zeros(ctx, {own}, sk::DType::f32));
      together.push_back(sk::full(ctx, {own}, sk::DType::f32, -1.0));
      comm.reduce_scatter_v(sends.back(), alone.back(), counts, sk::comm::ReduceOp::avg).wait();
    }
    comm.reset_stats();
    // Room for about three calls' bytes: the sends go out in two batches.
    sk::parallel::ReduceScatterCoalescer coalescer(ctx, comm, 3 * 14 * 4);
    std::vector<sk::comm::Work> works;
    for (int k = 0; k < calls; ++k)
      works.push_back(coalescer.submit(sends[static_cast<std::size_t>(k)],
                                       together[static_cast<std::size_t>(k)], counts_of(k, world),
                                       sk::comm::ReduceOp::avg));
    CHECK_FALSE(works.back().test());  // held: polling does not launch
    for (auto& w : works) w.wait();    // the first wait of the held batch launches it
    const auto calls_made = comm.stats().of(sk::comm::CollectiveKind::reduce_scatter_v).calls;
    CHECK(calls_made == 2);
    for (int k = 0; k < calls; ++k)
      CHECK(sk::to_vector<float>(ctx, together[static_cast<std::size_t>(k)]) ==
            sk::to_vector<float>(ctx, alone[static_cast<std::size_t>(k)]));
  });
}

TEST_CASE("a coalescer flushes on demand, and on a change of reduction or dtype") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ReduceScatterCoalescer coalescer(ctx, comm, 1 << 20);
    const std::vector<std::size_t> counts = {2, 2};
    auto send = sk::full(ctx, {4}, sk::DType::f32, 1.0 + comm.rank());
    auto a = sk::zeros(ctx, {2}, sk::DType::f32), b = sk::zeros(ctx, {2}, sk::DType::f32);
    comm.reset_stats();
    auto first = coalescer.submit(send, a, counts, sk::comm::ReduceOp::avg);
    auto second = coalescer.submit(send, b, counts, sk::comm::ReduceOp::sum);  // flushes `first`
    CHECK(comm.stats().total_calls() == 1);
    coalescer.flush();
    CHECK(comm.stats().total_calls() == 2);
    first.wait();
    second.wait();
    CHECK(sk::to_vector<float>(ctx, a) == std::vector<float>{1.5f, 1.5f});
    CHECK(sk::to_vector<float>(ctx, b) == std::vector<float>{3.0f, 3.0f});
  });
}
