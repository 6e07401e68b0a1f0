// qgZ's reduce-scatter (parallel/quantized_reduce_scatter.hpp) over the local communicator:
// the owner's result is the rank-ordered f32 sum of every rank's dequantised run, bit for bit,
// whatever order the ranks arrive in; within the format's bound of the float64 average; the
// error feedback residual is exactly what the wire dropped, and carrying it keeps the running
// sum of what arrived within one step's error of the exact running sum.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/parallel/quantized_reduce_scatter.hpp"

namespace sk = shardkit;

namespace {

// Rank r's gradients for step `step`: normal values, a few blocks of much smaller magnitude
// (so that block scales differ), never zeros.
std::vector<float> gradients(int rank, int step, std::size_t n) {
  std::mt19937 gen(static_cast<std::uint32_t>(1000 * rank + step + 7));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = normal(gen) * ((i / 50) % 3 == 1 ? 1e-3f : 1.0f);
  return g;
}

// Q then D of `values` with the library's own ops (the formats are tested against float64 in
// tests/ops): what one rank's segment becomes on the wire.
std::vector<float> through_wire(sk::Context& ctx, const std::vector<float>& values,
                                std::int64_t block,
                                sk::ops::QuantFormat format = sk::ops::QuantFormat::int8) {
  if (values.empty()) return {};
  const auto n = static_cast<std::int64_t>(values.size());
  const sk::Tensor t = sk::from_vector(ctx, values, {n});
  const sk::Tensor payload =
      sk::zeros(ctx, {sk::ops::quant_payload_bytes(n, block, format)}, sk::DType::u8);
  sk::ops::quantize_blocks(ctx, format, t, block, payload);
  sk::ops::dequantize_blocks(ctx, format, payload, block, t);
  return sk::to_vector<float>(ctx, t);
}

// The largest code of an integer format (int8 127, int4 7).
double code_max(sk::ops::QuantFormat format) {
  return format == sk::ops::QuantFormat::int4 ? 7.0 : 127.0;
}

struct Layout {
  std::vector<std::size_t> counts;
  std::vector<std::size_t> offsets;
  std::size_t total = 0;
};

Layout layout_of(std::vector<std::size_t> counts) {
  Layout l;
  l.counts = std::move(counts);
  for (const std::size_t c : l.counts) {
    l.offsets.push_back(l.total);
    l.total += c;
  }
  return l;
}

}  // namespace

TEST_CASE(
    "qgZ reduce-scatter: the rank-ordered f32 sum of dequantised runs, in any arrival order") {
  const std::int64_t block = 32;
  for (auto format : {sk::ops::QuantFormat::int8, sk::ops::QuantFormat::int4})
    for (int world : {1, 3, 4}) {
      // Uneven owners, one empty, blocks cut short at every segment's end.
      std::vector<std::size_t> counts;
      for (int r = 0; r < world; ++r)
        counts.push_back(r == 1 && world > 2 ? 0 : static_cast<std::size_t>(70 + 41 * r));
      const Layout l = layout_of(counts);
      for (const auto op : {sk::comm::ReduceOp::avg, sk::comm::ReduceOp::sum})
        for (int order = 0; order < 2; ++order) {
          CAPTURE(sk::ops::quant_format_name(format));
          CAPTURE(world);
          CAPTURE(sk::comm::reduce_op_name(op));
          CAPTURE(order);
          sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
            const int me = comm.rank();
            const auto own = static_cast<std::size_t>(me);
            // Ranks arrive in rank order, then in reverse: the result must not move.
            const int delay = order == 0 ? me : world - 1 - me;
            std::this_thread::sleep_for(std::chrono::milliseconds(3 * delay));
            const auto mine = gradients(me, 0, l.total);
            const sk::Tensor send =
                sk::from_vector(ctx, mine, {static_cast<std::int64_t>(l.total)});
            const sk::Tensor out =
                sk::empty(ctx, {static_cast<std::int64_t>(counts[own])}, sk::DType::f32);
            sk::parallel::start_quantized_reduce_scatter(ctx, comm, send, counts, block, op, out,
                                                         sk::Tensor(), format)
                .wait();
            const auto got = sk::to_vector<float>(ctx, out);
            // The reference: each rank's segment for this owner through the wire, summed in f32 in
            // rank order, divided once.
            std::vector<float> want(counts[own], 0.0f);
            std::vector<double> exact(counts[own], 0.0), bound(counts[own], 0.0);
            for (int q = 0; q < world; ++q) {
              const auto theirs = gradients(q, 0, l.total);
              const std::vector<float> segment(
                  theirs.begin() + static_cast<long>(l.offsets[own]),
                  theirs.begin() + static_cast<long>(l.offsets[own] + counts[own]));
              const auto back = through_wire(ctx, segment, block, format);
              for (std::size_t i = 0; i < counts[own]; ++i) {
                want[i] = q == 0 ? back[i] : want[i] + back[i];
                exact[i] += segment[i];
              }
              for (std::size_t b0 = 0; b0 < counts[own]; b0 += static_cast<std::size_t>(block)) {
                float amax = 0.0f;
                const std::size_t b1 = std::min(counts[own], b0 + static_cast<std::size_t>(block));
                for (std::size_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(segment[i]));
                for (std::size_t i = b0; i < b1; ++i) bound[i] += amax / code_max(format) / 2.0;
              }
            }
            const double divisor = op == sk::comm::ReduceOp::avg ? world : 1;
            for (auto& w : want)
              if (op == sk::comm::ReduceOp::avg) w /= static_cast<float>(world);
            REQUIRE(got.size() == want.size());
            CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
            for (std::size_t i = 0; i < got.size(); ++i) {
              const double slack =
                  1e-6 * (std::fabs(exact[i]) + bound[i] * code_max(format)) / divisor;
              CHECK(std::fabs(got[i] - exact[i] / divisor) <= bound[i] / divisor + slack);
            }
            // A quarter (int8) or an eighth (int4) of f32's bytes and the scales (a wire per owner,
            // padded to 16 bytes).
            const auto& stats = comm.stats().of(sk::comm::CollectiveKind::all_to_all_v);
            CHECK(stats.calls == 1);
            CHECK(stats.payload_bytes == [&] {
              std::uint64_t bytes = 0;
              for (const auto c : counts)
                bytes += static_cast<std::uint64_t>(
                    sk::ops::quant_payload_bytes(static_cast<std::int64_t>(c), block, format));
              return bytes;
            }());
          });
        }
    }
}

TEST_CASE("qgZ error feedback: the residual is what the wire dropped, and it is sent later") {
  const std::int64_t block = 64;
  const int world = 3, steps = 12;
  const Layout l = layout_of({150, 97, 203});
  for (auto format : {sk::ops::QuantFormat::int8, sk::ops::QuantFormat::int4})
    sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      CAPTURE(sk::ops::quant_format_name(format));
      const int me = comm.rank();
      const auto own = static_cast<std::size_t>(me);
      const auto n = static_cast<std::int64_t>(l.total);
      const sk::Tensor residual = sk::zeros(ctx, {n}, sk::DType::f32);
      std::vector<float> carried(l.total, 0.0f);  // this test's own copy of the residual
      std::vector<double> sent_sum(l.counts[own], 0.0), exact_sum(l.counts[own], 0.0);
      std::vector<double> plain_sum(l.counts[own], 0.0);
      double worst_with = 0, worst_without = 0, amax_all = 0;
      for (int step = 0; step < steps; ++step) {
        // Gradients that repeat a small bias every step: what plain quantisation rounds away
        // the same way each time, and error feedback must deliver over the steps.
        auto mine = gradients(me, step, l.total);
        for (std::size_t i = 0; i < l.total; ++i) mine[i] += 0.003f;
        const sk::Tensor send = sk::from_vector(ctx, mine, {n});
        const sk::Tensor out =
            sk::empty(ctx, {static_cast<std::int64_t>(l.counts[own])}, sk::DType::f32);
        sk::parallel::start_quantized_reduce_scatter(ctx, comm, send, l.counts, block,
                                                     sk::comm::ReduceOp::sum, out, residual, format)
            .wait();
        // The residual: (g + e) - D(Q(g + e)), f32 for f32, per owner's run.
        std::vector<float> corrected(l.total);
        for (std::size_t i = 0; i < l.total; ++i) corrected[i] = mine[i] + carried[i];
        for (std::size_t r = 0; r < l.counts.size(); ++r) {
          const std::vector<float> seg(
              corrected.begin() + static_cast<long>(l.offsets[r]),
              corrected.begin() + static_cast<long>(l.offsets[r] + l.counts[r]));
          const auto back = through_wire(ctx, seg, block, format);
          for (std::size_t i = 0; i < seg.size(); ++i) carried[l.offsets[r] + i] = seg[i] - back[i];
        }
        const auto got_residual = sk::to_vector<float>(ctx, residual);
        CHECK(std::memcmp(got_residual.data(), carried.data(), l.total * sizeof(float)) == 0);
        // Running sums at the owner: with feedback, what arrived trails the exact sum by the last
        // step's residuals only; without it (plain rounding, computed here) the bias' rounding
        // error adds up step after step.
        const auto got = sk::to_vector<float>(ctx, out);
        for (int q = 0; q < world; ++q) {
          auto theirs = gradients(q, step, l.total);
          for (auto& x : theirs) x += 0.003f;
          const std::vector<float> seg(
              theirs.begin() + static_cast<long>(l.offsets[own]),
              theirs.begin() + static_cast<long>(l.offsets[own] + l.counts[own]));
          const auto plain = through_wire(ctx, seg, block, format);
          for (std::size_t i = 0; i < seg.size(); ++i) {
            exact_sum[i] += seg[i];
            plain_sum[i] += plain[i];
            amax_all = std::max(amax_all, std::fabs(double(seg[i])));
          }
        }
        for (std::size_t i = 0; i < got.size(); ++i) sent_sum[i] += got[i];
      }
      for (std::size_t i = 0; i < sent_sum.size(); ++i) {
        worst_with = std::max(worst_with, std::fabs(sent_sum[i] - exact_sum[i]));
        worst_without = std::max(worst_without, std::fabs(plain_sum[i] - exact_sum[i]));
      }
      // One step's residuals of every rank: at most half a step of the largest block each.
      const double one_step = world * (amax_all + 0.01) / code_max(format) / 2.0 * 1.01;
      CAPTURE(worst_with);
      CAPTURE(worst_without);
      CHECK(worst_with <= one_step);
      CHECK(worst_without > 2 * worst_with);  // without feedback the error builds up
    });
}

TEST_CASE("qgZ reduce-scatter: bad arguments are named") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const sk::Tensor send = sk::zeros(ctx, {10}, sk::DType::f32);
    const std::vector<std::size_t> counts{5, 5};
    const sk::Tensor wrong = sk::zeros(ctx, {4}, sk::DType::f32);
    CHECK_THROWS_WITH((void)sk::parallel::start_quantized_reduce_scatter(
                          ctx, comm, send, counts, 8, sk::comm::ReduceOp::avg, wrong),
                      doctest::Contains("out must be f32 of counts[rank] = 5 elements"));
    const sk::Tensor out = sk::zeros(ctx, {5}, sk::DType::f32);
    CHECK_THROWS_WITH((void)sk::parallel::start_quantized_reduce_scatter(
                          ctx, comm, send, counts, 8, sk::comm::ReduceOp::max, out),
                      doctest::Contains("op max is not a sum"));
    CHECK_THROWS_WITH((void)sk::parallel::start_quantized_reduce_scatter(
                          ctx, comm, send, {6, 6}, 8, sk::comm::ReduceOp::avg,
                          sk::zeros(ctx, {6}, sk::DType::f32)),
                      doctest::Contains("send holds 10 elements but the counts add up to 12"));
  });
}
