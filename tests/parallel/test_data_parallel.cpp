// DDP, OSS (ZeRO-1) and SDP (ZeRO-2) over the local communicator: after 20 steps every stage's
// parameters equal DDP's, memory per rank follows the stage, and bad use gets clear errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "shardkit/ops/cpu_backend.hpp"

namespace sk = shardkit;
using namespace dp_test;

namespace {

// Every rank's parameters after OSS and SDP equal DDP's, for each optimizer and world size.
void check_sharded_equal_ddp(std::initializer_list<int> worlds, PartitionKind partition) {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    for (int world : worlds) {
      const auto ddp = train(world, Stage::ddp, kind, partition);
      for (int r = 1; r < world; ++r)
        REQUIRE(bitwise_equal(ddp.params[static_cast<std::size_t>(r)], ddp.params[0]));
      for (auto stage : {Stage::oss, Stage::sdp}) {
        const auto sharded = train(world, stage, kind, partition);
        for (int r = 0; r < world; ++r)
          CHECK_MESSAGE(bitwise_equal(sharded.params[static_cast<std::size_t>(r)], ddp.params[0]),
                        sk::optim::optimizer_kind_name(kind), " ", sk::parallel::stage_name(stage),
                        " world ", world, " rank ", r);
      }
    }
  }
}

}  // namespace

TEST_CASE("OSS and SDP equal DDP bitwise after 20 steps (greedy partition)") {
  check_sharded_equal_ddp({1, 2, 3, 4, 8}, PartitionKind::greedy);
}

TEST_CASE(
    "with the flat split (parameters straddle ranks) SGD, AdamW and LARC stay bitwise (LARC's "
    "norms do not depend on the split)") {
  check_sharded_equal_ddp({2, 3, 8}, PartitionKind::flat);
}

// The rules' options that the cases above leave at config_for's: LARC's clip mode, SGD without
// momentum (no state at all) and with Nesterov's, Adam's coupled (L2) decay. Every stage's
// parameters equal DDP's on every rank, with pieces straddling ranks (the flat split); and each
// option changes the run (so it reached the update).
TEST_CASE("LARC's clip mode, plain and Nesterov SGD, Adam's L2 decay: every stage equals DDP") {
  using Config = sk::optim::OptimizerConfig;
  auto with = [](OptimizerKind kind, auto&& change) {
    Config c = config_for(kind);
    change(c);
    return c;
  };
  const std::vector<std::pair<std::string, Config>> variants = {
      {"larc clip", with(OptimizerKind::larc_sgd, [](Config& c) { c.larc.clip = true; })},
      {"sgd without momentum", with(OptimizerKind::sgd,
                                    [](Config& c) {
                                      c.sgd.momentum = 0;
                                      c.sgd.dampening = 0;
                                    })},
      {"sgd nesterov", with(OptimizerKind::sgd,
                            [](Config& c) {
                              c.sgd.nesterov = true;
                              c.sgd.dampening = 0;
                            })},
      {"adam", config_for(OptimizerKind::adam)},
  };
  const std::vector<Config> defaults = {
      config_for(OptimizerKind::larc_sgd), config_for(OptimizerKind::sgd),
      config_for(OptimizerKind::sgd), config_for(OptimizerKind::adamw)};
  for (std::size_t v = 0; v < variants.size(); ++v) {
    const auto& [what, config] = variants[v];
    const auto ddp = train_with(3, Stage::ddp, config, PartitionKind::flat, 8);
    const auto plain = train_with(3, Stage::ddp, defaults[v], PartitionKind::flat, 8);
    CHECK_MESSAGE(!bitwise_equal(ddp.params[0], plain.params[0]), what);
    for (auto stage : {Stage::oss, Stage::sdp}) {
      const auto sharded = train_with(3, stage, config, PartitionKind::flat, 8);
      for (int r = 0; r < 3; ++r)
        CHECK_MESSAGE(bitwise_equal(sharded.params[static_cast<std::size_t>(r)], ddp.params[0]),
                      what, " ", sk::parallel::stage_name(stage), " rank ", r);
    }
  }
}

TEST_CASE("memory per rank follows the stage: state and gradients shrink to the owned share") {
  const int world = 4;
  const auto plan = sk::shard::ShardPlan(model_specs(), world, PartitionKind::greedy);
  const auto ddp = train(world, Stage::ddp, OptimizerKind::adamw, PartitionKind::greedy, 2);
  const auto oss = train(world, Stage::oss, OptimizerKind::adamw, PartitionKind::greedy, 2);
  const auto sdp = train(world, Stage::sdp, OptimizerKind::adamw, PartitionKind::greedy, 2);
  const auto params_bytes = plan.layout().padded_numel() * 4;  // frozen ones included
  const auto grads_bytes = plan.trainable_end() * 4;
  for (int r = 0; r < world; ++r) {
    const auto R = static_cast<std::size_t>(r);
    const auto owned = plan.numel(r) * 4;
    using C = sk::MemoryCategory;
    CHECK(ddp.memory[R].current_of(C::parameters) == params_bytes);
    CHECK(ddp.memory[R].current_of(C::gradients) == grads_bytes);
    CHECK(ddp.memory[R].current_of(C::optimizer_state) == 2 * plan.trainable_end() * 4);
    CHECK(oss.memory[R].current_of(C::gradients) == grads_bytes);
    CHECK(oss.memory[R].current_of(C::optimizer_state) == 2 * owned);
    CHECK(sdp.memory[R].current_of(C::gradients) == owned);
    CHECK(sdp.memory[R].current_of(C::optimizer_state) == 2 * owned);
    CHECK(sdp.memory[R].current_of(C::communication) == 0);  // bucket buffers are transient
  }
}

TEST_CASE("bad use gets clear errors") {
  auto expect = [](auto&& fn, const std::string& part) {
    try {
      fn();
      FAIL("no throw");
    } catch (const sk::Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
    }
  };
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd));
    dp.ready(0);
    expect([&] { dp.ready(0); }, "marked ready twice in one backward");
    expect([&] { dp.finish(); }, "'block.0.weight' was never marked ready");
    expect([&] { dp.step(0.1f); }, "optimizer step while a backward is open");
    dp.zero_grad();  // (closes the backward left open)
    expect([&] { dp.step(0.1f); }, "optimizer step before the gradients are finished");
    expect([&] { (void)dp.grad(3); }, "'frozen.scale'): the parameter is frozen");
    sk::parallel::ParallelOptions zero;
    zero.buckets.bucket_bytes = 0;
    expect([&] { DataParallel(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), zero); },
           "bucket size is 0 bytes");
    // A 16-bit wire of the other 16-bit format loses range or precision silently.
    sk::parallel::ParallelOptions mixed;
    mixed.precision.param_dtype = sk::DType::bf16;
    mixed.precision.reduce_dtype = sk::DType::f16;
    expect([&] { DataParallel(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), mixed); },
           "gradients computed in bf16 cannot be reduced in f16 (that loses range");
  });
  expect(
      [&] {
        sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          auto specs = model_specs();
          if (comm.rank() == 1) specs[2].shape = {65};
          DataParallel dp(ctx, comm, specs, config_for(OptimizerKind::sgd));
        });
      },
      "the parameter list differs between ranks");
}

// no_sync scopes nest as PyTorch's do (the setting before a scope comes back at its end), and a
// backward cut short inside one leaves its own exception -- the scope's end used to switch sync
// back on regardless, and to throw from its destructor mid-unwinding (std::terminate).
TEST_CASE("no_sync: nested scopes keep sync off; an exception inside one propagates") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), {});
    dp.zero_grad();
    {
      auto outer = dp.no_sync();
      { auto inner = dp.no_sync(); }
      CHECK_FALSE(dp.sync_enabled());
      const auto before = comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls;
      fake_backward(dp, ctx, comm.rank(), 0);
      dp.finish();
      CHECK(comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls == before);
    }
    CHECK(dp.sync_enabled());
    const auto first = [&] {
      for (std::size_t i = 0; i < dp.params().size(); ++i)
        if (dp.plan().layout()[i].trainable) return i;
      return std::size_t{0};
    }();
    CHECK_THROWS_WITH(
        [&] {
          auto scope = dp.no_sync();
          dp.ready(first);  // a backward under way
          throw sk::StateError("the backward failed");
        }(),
        "the backward failed");
    // The scope's setting came back (switching refused mid-backward, it stayed off for good)
    // and zero_grad() closed the backward cut short: the next one synchronises as before.
    CHECK(dp.sync_enabled());
    dp.zero_grad();
    const auto calls = comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls;
    fake_backward(dp, ctx, comm.rank(), 1);
    dp.finish();
    CHECK(comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls > calls);
    dp.step(0.1f);
  });
}

// An optimizer setting the rule refuses is refused when the engine is made, on every rank: at
// the first step it was refused only where a rank held pieces, after the step count moved.
TEST_CASE("the optimizer's options are refused when the engine is made") {
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto nesterov = config_for(OptimizerKind::sgd);
    nesterov.sgd.nesterov = true;  // with config_for's dampening 0.1
    CHECK_THROWS_WITH(DataParallel(ctx, comm, model_specs(), nesterov, {}),
                      doctest::Contains("nesterov needs momentum > 0 and dampening 0"));
    auto adam = config_for(OptimizerKind::adamw);
    adam.adam.beta1 = 1.0f;
    CHECK_THROWS_WITH(DataParallel(ctx, comm, model_specs(), adam, {}),
                      doctest::Contains("Adam beta1 must be in [0, 1)"));
  });
}

TEST_CASE("gradient accumulation: no_sync backwards, then one synchronised backward") {
  // Two micro-batches accumulated under no_sync + one synced equals three summed gradients:
  // compare with a run whose single backward adds the same three contributions, in the same
  // order -- bit for bit (a no_sync that reduced anyway sums the ranks' averages, which differs
  // in rounding only), and with no collective started inside the scope.
  const int world = 3;
  for (auto stage : {Stage::ddp, Stage::sdp}) {
    std::vector<std::vector<float>> accumulated(world), direct(world);
    for (int variant = 0; variant < 2; ++variant) {
      sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = stage;
        options.buckets.bucket_bytes = 4096;
        DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), options);
        for (std::size_t i = 0; i < dp.params().size(); ++i) sk::fill(ctx, dp.param(i), 0.25);
        dp.zero_grad();
        if (variant == 0) {
          {
            auto scope = dp.no_sync();
            const auto before = comm.stats().total_calls();
            for (int micro = 0; micro < 2; ++micro) {
              fake_backward(dp, ctx, comm.rank(), micro);
              dp.finish();
            }
            CHECK(comm.stats().total_calls() == before);
          }
          fake_backward(dp, ctx, comm.rank(), 2);
          dp.finish();
        } else {
          // One backward adding the three contributions into the same gradient buffers.
          const auto& layout = dp.plan().layout();
          for (int micro = 0; micro < 3; ++micro)
            for (std::size_t i = 0; i < layout.size(); ++i) {
              if (!layout[i].trainable) continue;
              sk::Context noise_ctx(
                  {.seed = 1000003ull * static_cast<std::uint64_t>(comm.rank() + 1) +
                           7919ull * static_cast<std::uint64_t>(micro) + i});
              auto noise = sk::empty(noise_ctx, dp.param(i).shape(), sk::DType::f32);
              sk::normal_(noise_ctx, noise, 0.0, 1.0);
              const auto g = dp.grad(i);
              const float* n = noise.data<float>();
              for (std::int64_t e = 0; e < g.numel(); ++e)
                g.data<float>()[e] += 0.5f * 0.25f + n[e];
            }
          for (std::size_t i = layout.size(); i-- > 0;)
            if (layout[i].trainable) dp.ready(i);
          dp.finish();
        }
        dp.step(0.1f);
        auto& out = (variant == 0 ? accumulated : direct)[static_cast<std::size_t>(comm.rank())];
        for (std::size_t i = 0; i < dp.params().size(); ++i) {
          const auto v = sk::to_vector<float>(ctx, dp.param(i));
          out.insert(out.end(), v.begin(), v.end());
        }
      });
    }
    for (int r = 0; r < world; ++r)
      CHECK(bitwise_equal(accumulated[static_cast<std::size_t>(r)],
                          direct[static_cast<std::size_t>(r)]));
  }
}

TEST_CASE("synchronised accumulation adds each backward's average: A + avg(g), every stage alike") {
  // Two synchronised backwards without zero_grad between them. Every stage must hold
  // avg(g1) + avg(g2) -- what FSDP's sharded accumulation computes -- bitwise the same, and
  // within rounding of the hand-computed sum of the averages.
  const int world = 3;
  std::vector<std::vector<float>> per_stage;
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
    for (auto partition : {PartitionKind::greedy, PartitionKind::flat}) {
      // Every rank's parameters: oss and sdp rebuild them from each owner's update.
      std::vector<std::vector<float>> per_rank(world);
      sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = stage;
        options.partition = partition;
        options.buckets.bucket_bytes = 2048;
        DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), options);
        init_differently(dp, ctx, 0);
        dp.zero_grad();
        for (int micro = 0; micro < 2; ++micro) {
          fake_backward(dp, ctx, comm.rank(), micro);
          dp.finish();
        }
        dp.step(0.1f);
        per_rank[static_cast<std::size_t>(comm.rank())] = all_params(dp, ctx);
      });
      for (std::size_t r = 1; r < per_rank.size(); ++r)
        CHECK(bitwise_equal(per_rank[r], per_rank[0]));
      per_stage.push_back(per_rank[0]);
    }
  }
  for (std::size_t k = 1; k < per_stage.size(); ++k)
    CHECK(bitwise_equal(per_stage[k], per_stage[0]));

  // The same update from gradients averaged by hand: w - lr * (avg(g1) + avg(g2) + wd * w) on
  // the first SGD step (momentum buffer = gradient).
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd));
    init_differently(dp, ctx, 0);
    const auto w = all_params(dp, ctx);
    const auto& layout = dp.plan().layout();
    std::vector<float> expected;
    for (std::size_t i = 0; i < layout.size(); ++i) {
      const auto wi = sk::to_vector<float>(ctx, dp.param(i));
      std::vector<double> g(wi.size(), 0.0);
      for (int micro = 0; micro < 2; ++micro) {
        std::vector<double> avg(wi.size(), 0.0);
        for (int r = 0; r < world; ++r) {
          sk::Context noise_ctx({.seed = 1000003ull * static_cast<std::uint64_t>(r + 1) +
                                         7919ull * static_cast<std::uint64_t>(micro) + i});
          auto noise = sk::empty(noise_ctx, dp.param(i).shape(), sk::DType::f32);
          sk::normal_(noise_ctx, noise, 0.0, 1.0);
          for (std::size_t e = 0; e < wi.size(); ++e)
            avg[e] += (0.5 * wi[e] + noise.data<float>()[e]) / world;
        }
        for (std::size_t e = 0; e < wi.size(); ++e) g[e] += avg[e];
      }
      for (std::size_t e = 0; e < wi.size(); ++e)
        expected.push_back(
            layout[i].trainable ? static_cast<float>(wi[e] - 0.1 * (g[e] + 1e-4 * wi[e])) : wi[e]);
    }
    CHECK(w.size() == expected.size());
    // (f32 rounding of two averages; an overwritten first backward would be off by O(1))
    CHECK(max_relative_difference(per_stage[0], expected) < 1e-4);
  });
}

TEST_CASE("broadcast_fp16: f16 on the wire, the owner's f32 master stays exact") {
  const int world = 3;
  const auto exact = train(world, Stage::ddp, OptimizerKind::sgd, PartitionKind::greedy, 1);
  std::vector<std::vector<float>> got(world);
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ParallelOptions options;
    options.stage = Stage::oss;
    options.partition = PartitionKind::greedy;  // whole parameters: each has one owner
    options.broadcast_fp16 = true;
    options.buckets.bucket_bytes = 2048;
    DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), options);
    init_differently(dp, ctx, comm.rank());
    dp.broadcast_parameters(0);
    dp.zero_grad();
    fake_backward(dp, ctx, comm.rank(), 0);
    dp.finish();
    dp.step(0.05f);
    const auto& plan = dp.plan();
    const auto& layout = plan.layout();
    for (std::size_t i = 0; i < layout.size(); ++i) {
      const auto mine = sk::to_vector<float>(ctx, dp.param(i));
      // The spec-order offset of parameter i in `exact`.
      std::size_t at = 0;
      for (std::size_t j = 0; j < i; ++j) at += static_cast<std::size_t>(layout[j].numel);
      const bool own = layout[i].trainable && plan.rank_of_element(layout[i].offset) == comm.rank();
      for (std::size_t e = 0; e < mine.size(); ++e) {
        const float reference = exact.params[0][at + e];
        if (!layout[i].trainable || own)
          CHECK(mine[e] == reference);  // the owner's master: exact f32 (frozen: untouched)
        else
          CHECK(mine[e] == sk::half_bits_to_float(sk::float_to_half_bits(reference)));  // f16 wire
      }
    }
    got[static_cast<std::size_t>(comm.rank())] = sk::to_vector<float>(ctx, dp.params().flat());
  });
  CHECK(got[0] != got[1]);  // each rank is exact on its own range only
}

TEST_CASE("gradients reduced in f16 or bf16 stay close to the f32 reduction") {
  const int world = 4;
  const auto reference = train(world, Stage::sdp, OptimizerKind::sgd, PartitionKind::greedy, 5);
  for (auto wire : {sk::DType::f16, sk::DType::bf16}) {
    for (auto stage : {Stage::ddp, Stage::sdp}) {
      std::vector<std::vector<float>> got(world);
      sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = stage;
        options.buckets.bucket_bytes = 2048;
        options.precision.reduce_dtype = wire;  // f32 gradients, a 16-bit wire
        DataParallel dp(ctx, comm, model_specs(), config_for(OptimizerKind::sgd), options);
        init_differently(dp, ctx, comm.rank());
        dp.broadcast_parameters(0);
        for (int s = 0; s < 5; ++s) {
          dp.zero_grad();
          fake_backward(dp, ctx, comm.rank(), s);
          dp.finish();
          dp.step(0.05f * (1.0f - 0.02f * static_cast<float>(s)));
        }
        auto& mine = got[static_cast<std::size_t>(comm.rank())];
        for (std::size_t i = 0; i < dp.params().size(); ++i) {
          const auto v = sk::to_vector<float>(ctx, dp.param(i));
          mine.insert(mine.end(), v.begin(), v.end());
        }
      });
      // Norm-wise: one rounding of each averaged gradient to 11 (f16) or 8 (bf16) bits.
      const double tolerance = wire == sk::DType::f16 ? 1e-3 : 1e-2;
      for (int r = 0; r < world; ++r) {
        const auto& a = got[static_cast<std::size_t>(r)];
        const auto& b = reference.params[0];
        double num = 0, den = 0;
        for (std::size_t e = 0; e < a.size(); ++e) {
          num += (static_cast<double>(a[e]) - b[e]) * (static_cast<double>(a[e]) - b[e]);
          den += static_cast<double>(b[e]) * b[e];
        }
        const double diff = std::sqrt(num / den);
        CHECK_MESSAGE(diff <= tolerance, sk::dtype_name(wire), " ", sk::parallel::stage_name(stage),
                      " ", diff);
        CHECK(diff > 0);  // the wire really was narrower
      }
    }
  }
}

TEST_CASE("no_weight_decay: the named parameters train as without decay, the others as with it") {
  // Each parameter's gradient depends on its own values only (fake_backward) and LARC's ratio on
  // its own norms, so a run with a no-decay group must equal, parameter by parameter, a run with
  // decay for all (the others) and one with decay for none (the group) -- bit for bit, on every
  // stage and world size.
  const std::vector<std::string> group = {"embed.weight", "block.0.bias", "head.bias", "tiny"};
  const auto specs = model_specs();
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd}) {
    auto with = config_for(kind);
    with.sgd.weight_decay = 0.05f;  // large enough that leaving it out shows in every element
    auto without = with;
    without.sgd.weight_decay = 0;
    auto grouped = with;
    grouped.no_weight_decay = group;
    for (int world : {1, 2, 3}) {
      const auto all = train_with(world, Stage::ddp, with, PartitionKind::greedy, 8);
      const auto none = train_with(world, Stage::ddp, without, PartitionKind::greedy, 8);
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
        const auto got = train_with(world, stage, grouped, PartitionKind::greedy, 8);
        std::size_t at = 0;
        for (const auto& spec : specs) {
          const auto n = static_cast<std::size_t>(sk::shape_numel(spec.shape));
          const bool exempt = std::find(group.begin(), group.end(), spec.name) != group.end();
          const auto& want = exempt ? none.params[0] : all.params[0];
          const std::vector<float> a(got.params[0].begin() + at, got.params[0].begin() + at + n),
              b(want.begin() + at, want.begin() + at + n);
          CHECK_MESSAGE(bitwise_equal(a, b), sk::optim::optimizer_kind_name(kind), " ",
                        sk::parallel::stage_name(stage), " world ", world, " ", spec.name,
                        exempt ? " (no decay)" : " (decay)");
          if (spec.trainable && !exempt) {  // the decay really is there for the others
            const std::vector<float> c(none.params[0].begin() + at,
                                       none.params[0].begin() + at + n);
            CHECK_FALSE(bitwise_equal(a, c));
          }
          at += n;
        }
      }
    }
  }
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto config = config_for(OptimizerKind::sgd);
    config.no_weight_decay = {"block.7.bias"};
    CHECK_THROWS_WITH(DataParallel(ctx, comm, model_specs(), config, {}),
                      doctest::Contains("no_weight_decay names 'block.7.bias', which is not a "
                                        "trainable parameter; trainable ones: embed.weight"));
    config = config_for(OptimizerKind::adamw);
    config.no_weight_decay = {"head.bias"};
    CHECK_THROWS_WITH(DataParallel(ctx, comm, model_specs(), config, {}),
                      doctest::Contains("sgd and larc_sgd only, not adamw"));
  });
}
