// Mixed precision under every stage: with a bf16 or f16 compute copy (gradients in it, f32
// masters in the optimizer), OSS, SDP and FSDP equal DDP of the same precision bit for bit --
// masters, compute copies and optimizer state; masters start exact; model state per rank
// follows the ZeRO paper's (2 + 2 + K)Ψ accounting; checkpoints move between precisions; bad
// policies are named.
#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace dp_test;
using sk::parallel::FsdpEngine;
using sk::parallel::MixedPrecision;

namespace {

// Every trainable parameter of model_specs() (the frozen one left out: FSDP units hold
// trainable parameters only), in three units.
std::vector<sk::shard::ParamSpec> trainable_specs() {
  std::vector<sk::shard::ParamSpec> out;
  for (const auto& s : model_specs())
    if (s.trainable) out.push_back(s);
  return out;
}

std::vector<sk::parallel::FsdpUnitParams> units_of(const std::vector<sk::shard::ParamSpec>& specs) {
  std::vector<sk::parallel::FsdpUnitParams> units(3);
  for (std::size_t i = 0; i < specs.size(); ++i)
    units[i * 3 / specs.size()].params.push_back(specs[i]);
  for (std::size_t u = 0; u < units.size(); ++u) units[u].name = "unit" + std::to_string(u);
  return units;
}

// Exact f32 initial values of parameter i (the same on every rank: rank 0's hold anyway).
void init_value(sk::Context& ctx, std::size_t i, const sk::Tensor& view) {
  sk::Context values({.seed = 900 + i});
  auto t = sk::empty(values, view.shape(), sk::DType::f32);
  sk::uniform_(values, t, -0.5, 0.5);
  sk::copy(ctx, view, t);
}

// A "backward" in the compute precision: g = (0.5·w + noise(rank, step, i)) · scale from the
// compute copy, rounded into the gradient storage; `poison` puts an inf in element 0.
void add_gradient(sk::Context& ctx, const sk::Tensor& param, const sk::Tensor& grad, int rank,
                  int step, std::size_t i, double scale = 1, bool poison = false) {
  sk::Context noise_ctx({.seed = 1000003ull * static_cast<std::uint64_t>(rank + 1) +
                                 7919ull * static_cast<std::uint64_t>(step) + i});
  auto noise = sk::empty(noise_ctx, param.shape(), sk::DType::f32);
  sk::normal_(noise_ctx, noise, 0.0, 1.0);
  const auto w = sk::to_vector<float>(ctx, sk::cast(ctx, param, sk::DType::f32));
  std::vector<float> g(w.size());
  const float* n = noise.data<float>();
  for (std::size_t e = 0; e < g.size(); ++e) g[e] = static_cast<float>((0.5 * w[e] + n[e]) * scale);
  if (poison) g[0] = std::numeric_limits<float>::infinity();
  sk::add_(ctx, grad, sk::from_vector(ctx, g, param.shape()));
}

// Dynamic loss scaling in a run: the scaler's options, and one rank's gradient poisoned (an
// inf) at one step.
struct Scaling {
  bool enabled = false;
  sk::optim::LossScalerOptions options;
  int poison_rank = -1;
  int poison_step = -1;
  int omit_step = -1;  // no backward, no step at all, the scale backed off (the reference)
};

struct PrecisionOutcome {
  std::vector<bool> stepped;  // per step: taken (true) or skipped, on rank 0
  double final_scale = 0;     // rank 0's
  // Every rank took and skipped the same steps and ended at rank 0's scale (a rank that stepped
  // alone would diverge from the others' replicas).
  bool ranks_agree = false;
  std::vector<float> masters;  // rank 0: every parameter's f32 master, table order by name
  std::vector<float> compute;  // rank 0: the compute copies (as f32), parameter order
  sk::optim::OptimizerState state;
  sk::MemorySnapshot memory;  // rank 0, after the last step
};

// Rank 0's masters, by parameter (streamed from their owners).
template <class Optimizer>
std::vector<float> gather_masters(sk::Context& ctx, sk::comm::Communicator& comm,
                                  const Optimizer& optimizer, bool by_name = false) {
  const auto& table = optimizer.table();
  std::vector<std::vector<float>> by_param(table.params().size());
  for (std::size_t p = 0; p < by_param.size(); ++p)
    by_param[p].resize(static_cast<std::size_t>(table.params()[p].numel));
  sk::optim::stream_pieces(
      ctx, comm, table, optimizer.master_params(), 0,
      [&](const sk::shard::StatePiece& piece, std::int64_t offset, const float* values,
          std::int64_t count) {
        std::copy_n(values, count, by_param[piece.param].begin() + piece.param_begin + offset);
      });
  // Table order; or by name (FSDP's units order a module's parameters otherwise than DDP).
  std::vector<std::size_t> order(by_param.size());
  for (std::size_t p = 0; p < order.size(); ++p) order[p] = p;
  if (by_name)
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return table.params()[a].name < table.params()[b].name;
    });
  std::vector<float> out;
  for (auto p : order) out.insert(out.end(), by_param[p].begin(), by_param[p].end());
  return out;
}

// `quantized_grads`: fsdp's gradients reduced as int8 blocks (qgZ), with error feedback when
// `error_feedback`; in hybrid groups of `group` ranks when it is > 0 (the exchange across
// groups quantised too).
PrecisionOutcome run_mixed(sk::parallel::Stage stage, OptimizerKind kind, int world,
                           MixedPrecision precision, int steps, Scaling scaling = {},
                           bool quantized_grads = false, bool error_feedback = false,
                           int group = 0) {
  PrecisionOutcome out;
  const auto specs = trainable_specs();
  std::vector<std::vector<bool>> stepped_by_rank(static_cast<std::size_t>(world));
  std::vector<double> scale_by_rank(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& world_comm) {
    const int rank = world_comm.rank();
    auto& stepped_here = stepped_by_rank[static_cast<std::size_t>(rank)];
    // The optimizer's state is read over the engine's shard group (the world without a mesh).
    sk::comm::Communicator* state_comm = &world_comm;
    sk::optim::DynamicLossScaler scaler(scaling.options);
    auto omitted = [&](int s) {
      if (s != scaling.omit_step) return false;
      // The scale backs off as after an overflow (a non-finite value checked, then the update).
      scaler.check_grads(ctx, nullptr, {sk::full(ctx, {1}, sk::DType::f32, INFINITY)});
      scaler.update(ctx);
      stepped_here.push_back(false);
      return true;
    };
    auto scale_of = [&] { return scaling.enabled ? scaler.scale() : 1.0; };
    auto poisoned = [&](int s, std::size_t i) {
      return rank == scaling.poison_rank && s == scaling.poison_step && i == 1;
    };
    auto take_step = [&](auto& engine, int s) {
      if (scaling.enabled)
        engine.step(lr_at(kind, s), scaler);
      else
        engine.step(lr_at(kind, s));
      const bool stepped = !scaling.enabled || !scaler.found_inf();  // (a host read: tests only)
      stepped_here.push_back(stepped);
    };
    auto record = [&](auto& engine, auto&& compute_values) {
      auto masters = gather_masters(ctx, *state_comm, engine.optimizer());
      auto state = sk::optim::consolidate_optimizer_state(engine.optimizer(), *state_comm, 0);
      auto compute = compute_values();
      scale_by_rank[static_cast<std::size_t>(rank)] = scaler.scale();
      if (rank != 0) return;
      out.masters = std::move(masters);
      out.state = std::move(state);
      out.compute = std::move(compute);
      out.memory = ctx.memory_stats().snapshot();
      out.final_scale = scaler.scale();
    };
    if (stage == sk::parallel::Stage::fsdp) {
      sk::parallel::ParallelOptions options;
      options.stage = sk::parallel::Stage::fsdp;
      options.buckets.bucket_bytes = 1024;
      options.precision = precision;
      options.fsdp.quantized_grads = quantized_grads;
      options.fsdp.grad_error_feedback = error_feedback;
      std::unique_ptr<sk::comm::HybridMesh> mesh;
      if (group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(world_comm, group);
      const auto engine_ptr = mesh ? std::make_unique<FsdpEngine>(ctx, *mesh, units_of(specs),
                                                                  config_for(kind), options)
                                   : std::make_unique<FsdpEngine>(ctx, world_comm, units_of(specs),
                                                                  config_for(kind), options);
      FsdpEngine& engine = *engine_ptr;
      state_comm = &engine.communicator();
      engine.set_full_params([&](std::size_t i, const sk::Tensor& v) { init_value(ctx, i, v); });
      for (int s = 0; s < steps; ++s) {
        if (omitted(s)) continue;
        engine.zero_grad();
        for (std::size_t u = engine.unit_count(); u-- > 0;) {  // backward order
          engine.gather(u);
          for (std::size_t i = engine.param_count(); i-- > 0;)
            if (engine.unit_of(i) == u) {
              add_gradient(ctx, engine.param(i), engine.grad(i), rank, s, i, scale_of(),
                           poisoned(s, i));
              engine.ready(i);
            }
          engine.release(u);
        }
        engine.finish();
        take_step(engine, s);
      }
      const auto memory = ctx.memory_stats().snapshot();
      record(engine, [&] {
        std::vector<float> values;
        auto full = engine.full_params();
        for (std::size_t i = 0; i < engine.param_count(); ++i) {
          const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, engine.param(i), sk::DType::f32));
          values.insert(values.end(), v.begin(), v.end());
        }
        return values;
      });
      if (rank == 0) out.memory = memory;
      return;
    }
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 1024;
    options.precision = precision;
    DataParallel dp(ctx, world_comm, specs, config_for(kind), options);
    dp.set_full_params([&](std::size_t i, const sk::Tensor& v) { init_value(ctx, i, v); });
    for (int s = 0; s < steps; ++s) {
      if (omitted(s)) continue;
      dp.zero_grad();
      for (std::size_t i = specs.size(); i-- > 0;) {
        add_gradient(ctx, dp.param(i), dp.grad(i), rank, s, i, scale_of(), poisoned(s, i));
        dp.ready(i);
      }
      dp.finish();
      take_step(dp, s);
    }
    const auto memory = ctx.memory_stats().snapshot();
    record(dp, [&] {
      std::vector<float> values;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, dp.param(i), sk::DType::f32));
        values.insert(values.end(), v.begin(), v.end());
      }
      return values;
    });
    if (rank == 0) out.memory = memory;
  });
  out.stepped = stepped_by_rank[0];
  out.ranks_agree = true;
  for (std::size_t r = 0; r < stepped_by_rank.size(); ++r)
    out.ranks_agree = out.ranks_agree && stepped_by_rank[r] == out.stepped &&
                      scale_by_rank[r] == scale_by_rank[0];
  return out;
}

}  // namespace

TEST_CASE("mixed precision: OSS, SDP and FSDP equal DDP of the same precision bit for bit") {
  using sk::parallel::Stage;
  for (auto dtype : {sk::DType::bf16, sk::DType::f16}) {
    for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
      for (int world : {1, 2, 3, 4}) {
        const auto precision = MixedPrecision::of(dtype);
        const auto ddp = run_mixed(Stage::ddp, kind, world, precision, 6);
        for (auto stage : {Stage::oss, Stage::sdp, Stage::fsdp}) {
          const auto other = run_mixed(stage, kind, world, precision, 6);
          const std::string what = std::string(sk::dtype_name(dtype)) + " " +
                                   std::string(sk::optim::optimizer_kind_name(kind)) + " " +
                                   std::string(sk::parallel::stage_name(stage)) +
                                   " N=" + std::to_string(world);
          CHECK_MESSAGE(bitwise_equal(other.masters, ddp.masters), what);
          CHECK_MESSAGE(bitwise_equal(other.compute, ddp.compute), what);
          CHECK_MESSAGE(states_equal(other.state, ddp.state, 0), what);
        }
      }
    }
  }
  // bf16 gradients reduced in f32 (FairScale's fp32_reduce_scatter): the stages agree too.
  const MixedPrecision fp32_reduce{sk::DType::bf16, sk::DType::f32};
  const auto ddp = run_mixed(Stage::ddp, OptimizerKind::adamw, 3, fp32_reduce, 6);
  for (auto stage : {Stage::oss, Stage::sdp, Stage::fsdp}) {
    const auto other = run_mixed(stage, OptimizerKind::adamw, 3, fp32_reduce, 6);
    CHECK(bitwise_equal(other.masters, ddp.masters));
  }
  // (The local communicator already sums 16-bit values in f32 and rounds once, so here
  // reducing in bf16 gives these same bits; NCCL's bf16 reductions round as they go.)
  CHECK(bitwise_equal(ddp.masters, run_mixed(Stage::ddp, OptimizerKind::adamw, 3,
                                             MixedPrecision::of(sk::DType::bf16), 6)
                                       .masters));
  // The compute copy is the rounded master, and mixed precision is not f32 training.
  const auto bf16 =
      run_mixed(Stage::ddp, OptimizerKind::adamw, 2, MixedPrecision::of(sk::DType::bf16), 6);
  const auto f32 = run_mixed(Stage::ddp, OptimizerKind::adamw, 2, MixedPrecision{}, 6);
  REQUIRE(bf16.compute.size() == bf16.masters.size());
  for (std::size_t e = 0; e < bf16.masters.size(); ++e)
    REQUIRE(bf16.compute[e] == sk::bf16_bits_to_float(sk::float_to_bf16_bits(bf16.masters[e])));
  CHECK_FALSE(bitwise_equal(bf16.masters, f32.masters));
  double diff = 0, norm = 0;  // norm-wise: near-zero elements may differ in sign
  for (std::size_t e = 0; e < f32.masters.size(); ++e) {
    diff += std::pow(double(bf16.masters[e]) - f32.masters[e], 2);
    norm += std::pow(double(f32.masters[e]), 2);
  }
  CHECK(std::sqrt(diff / norm) < 0.02);
}

TEST_CASE("mixed-precision model state per rank follows the ZeRO paper's (2 + 2 + K)Ψ, K = 12") {
  using sk::parallel::Stage;
  const int world = 4;
  double psi = 0;
  for (const auto& s : trainable_specs()) psi += static_cast<double>(sk::shape_numel(s.shape));
  using C = sk::MemoryCategory;
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
    const auto run =
        run_mixed(stage, OptimizerKind::adamw, world, MixedPrecision::of(sk::DType::bf16), 2);
    const auto& m = run.memory;
    const double measured =
        static_cast<double>(m.current_of(C::parameters) + m.current_of(C::gradients) +
                            m.current_of(C::optimizer_state));
    const double formula = sk::parallel::zero_model_state_bytes(stage, psi, 12, world, 2);
    // Padding: each parameter aligned to 16 elements, each range (unit) to N x 16; 16 bytes of
    // model state per element at most.
    const double padding = (8.0 * 16 + 3.0 * world * 16) * 16;
    CAPTURE(sk::parallel::stage_name(stage));
    CHECK(measured >= formula);
    CHECK(measured <= formula + padding);
    CHECK(m.current_of(C::parameters) < m.current_of(C::optimizer_state));  // 2 vs 4 + 8 bytes
  }
}

TEST_CASE("checkpoints move between precisions: masters are f32, compute copies follow") {
  using sk::parallel::Stage;
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_mixed_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto specs = trainable_specs();
  std::vector<float> saved_masters;
  // bf16 FSDP on 3 ranks saves; an f32 SDP run on 2 loads exactly the masters.
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ParallelOptions options;
    options.stage = sk::parallel::Stage::fsdp;
    options.precision = MixedPrecision::of(sk::DType::bf16);
    FsdpEngine engine(ctx, comm, units_of(specs), config_for(OptimizerKind::adamw), options);
    engine.set_full_params([&](std::size_t i, const sk::Tensor& v) { init_value(ctx, i, v); });
    engine.zero_grad();
    for (std::size_t u = engine.unit_count(); u-- > 0;) {
      engine.gather(u);
      for (std::size_t i = engine.param_count(); i-- > 0;)
        if (engine.unit_of(i) == u) {
          add_gradient(ctx, engine.param(i), engine.grad(i), comm.rank(), 0, i);
          engine.ready(i);
        }
      engine.release(u);
    }
    engine.finish();
    engine.step(0.01f);
    sk::checkpoint::CheckpointOptions o;
    o.layout = sk::checkpoint::CheckpointLayout::sharded;
    sk::checkpoint::save_checkpoint(dir.string(), engine.training_state(), o);
    auto masters = gather_masters(ctx, comm, engine.optimizer());
    if (comm.rank() == 0) saved_masters = std::move(masters);
  });
  for (auto precision : {MixedPrecision{}, MixedPrecision::of(sk::DType::f16)}) {
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      sk::parallel::ParallelOptions options;
      options.stage = Stage::sdp;
      options.precision = precision;
      DataParallel dp(ctx, comm, specs, config_for(OptimizerKind::adamw), options);
      (void)sk::checkpoint::load_checkpoint(dir.string(), dp.training_state());
      const auto masters = gather_masters(ctx, comm, dp.optimizer());
      if (comm.rank() != 0) return;
      CHECK(bitwise_equal(masters, saved_masters));
      // The compute copy is the master rounded to this run's precision.
      std::size_t at = 0;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, dp.param(i), sk::DType::f32));
        for (float x : v) {
          const float m = saved_masters[at++];
          const float want =
              precision.enabled() ? sk::half_bits_to_float(sk::float_to_half_bits(m)) : m;
          REQUIRE(x == want);
        }
      }
    });
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("mixed-precision policies that lose information silently are refused by name") {
  auto error_of = [](MixedPrecision precision, bool broadcast_fp16 = false) -> std::string {
    try {
      sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        sk::parallel::ParallelOptions options;
        options.stage = sk::parallel::Stage::oss;
        options.precision = precision;
        options.broadcast_fp16 = broadcast_fp16;
        DataParallel dp(ctx, comm, trainable_specs(), config_for(OptimizerKind::sgd), options);
      });
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(error_of({sk::DType::bf16, sk::DType::f16})
            .find("gradients computed in bf16 cannot be reduced in f16 (that loses range") !=
        std::string::npos);
  CHECK(error_of({sk::DType::f16, sk::DType::bf16}).find("loses precision") != std::string::npos);
  CHECK(error_of({sk::DType::bf16, sk::DType::bf16, sk::DType::bf16})
            .find("buffer_dtype bf16 is not supported") != std::string::npos);
  CHECK(error_of(MixedPrecision::of(sk::DType::bf16), true)
            .find("broadcast_fp16 is for f32 training") != std::string::npos);
  CHECK(error_of({sk::DType::f64, sk::DType::f64}).find("param_dtype must be f32, f16 or bf16") !=
        std::string::npos);
  // Reducing bf16 gradients in f32 (FairScale's fp32_reduce_scatter) is fine.
  CHECK(error_of({sk::DType::bf16, sk::DType::f32}) == "no error");
}

namespace {

// Dynamic loss scaling from 1024, growing after 3 good steps, with an inf in rank 1's gradients
// at step 2.
Scaling overflow_at_step_2() {
  Scaling scaling;
  scaling.enabled = true;
  scaling.options.init_scale = 1024;
  scaling.options.growth_interval = 3;
  scaling.poison_rank = 1;
  scaling.poison_step = 2;
  return scaling;
}

}  // namespace

TEST_CASE("loss scaling: an overflow on one rank skips the step on every rank, under every stage") {
  using sk::parallel::Stage;
  const Scaling scaling = overflow_at_step_2();
  const auto f16 = MixedPrecision::of(sk::DType::f16);
  // (LARC's gated coefficients take the gate's factor: a skipped step must leave them unused.)
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
    const auto ddp = run_mixed(Stage::ddp, kind, 3, f16, 7, scaling);
    // Steps 0, 1 taken; 2 skipped (scale 1024 -> 512); 3, 4, 5 taken (-> 1024 after three);
    // 6 taken.
    CHECK(ddp.stepped == std::vector<bool>{true, true, false, true, true, true, true});
    CHECK(ddp.ranks_agree);
    CHECK(ddp.final_scale == 1024);
    CHECK(ddp.state.steps == 6);  // the skipped step does not count
    for (auto stage : {Stage::oss, Stage::sdp, Stage::fsdp}) {
      const auto other = run_mixed(stage, kind, 3, f16, 7, scaling);
      CAPTURE(sk::parallel::stage_name(stage));
      CHECK(other.stepped == ddp.stepped);
      CHECK(other.ranks_agree);
      CHECK(bitwise_equal(other.masters, ddp.masters));
      CHECK(states_equal(other.state, ddp.state, 0));
    }
    // The skipped step left everything as it was: equal to a run that never ran step 2.
    Scaling omitted = scaling;
    omitted.poison_rank = -1;
    omitted.omit_step = 2;
    const auto reference = run_mixed(Stage::sdp, kind, 3, f16, 7, omitted);
    CHECK(reference.stepped == ddp.stepped);
    CHECK(bitwise_equal(reference.masters, ddp.masters));
    CHECK(states_equal(reference.state, ddp.state, 0));
    // And the poisoned step is not a no-op by accident: without loss scaling it is taken.
    Scaling off;
    off.poison_rank = 1;
    off.poison_step = 2;
    const auto unscaled = run_mixed(Stage::ddp, kind, 3, f16, 7, off);
    CHECK_FALSE(bitwise_equal(unscaled.masters, ddp.masters));
  }
}

// qgZ's int8 blocks carry an overflow to the owner: a block holding an inf comes back NaN
// (ops/quantize.hpp), so the owner's sum is not finite and every rank skips the step. With error
// feedback the poisoned rank's residual holds the inf's NaNs too: it is dropped with the skipped
// step (else every later step would be skipped), and rescaled when the scale grows.
TEST_CASE("loss scaling with qgZ: an overflow on one rank still skips the step on every rank") {
  // 3 ranks in one group, and 4 as two groups of 2 (the exchange across groups quantised too,
  // its error feedback following the scale as the group's does).
  const Scaling scaling = overflow_at_step_2();
  for (const auto& [world, group] : {std::pair{3, 0}, std::pair{4, 2}})
    for (const bool feedback : {false, true})
      for (const auto& precision : {MixedPrecision::of(sk::DType::f16), MixedPrecision{}}) {
        CAPTURE(world);
        CAPTURE(group);
        CAPTURE(feedback);
        const auto quantized = run_mixed(sk::parallel::Stage::fsdp, OptimizerKind::adamw, world,
                                         precision, 7, scaling, true, feedback, group);
        CHECK(quantized.stepped == std::vector<bool>{true, true, false, true, true, true, true});
        CHECK(quantized.ranks_agree);
        CHECK(quantized.state.steps == 6);
        for (const float m : quantized.masters) REQUIRE(std::isfinite(m));
      }
}

TEST_CASE("the loss scaler follows GradScaler's rules and refuses bad settings") {
  sk::Context ctx;
  sk::optim::DynamicLossScaler scaler(
      {.init_scale = 8, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 2});
  const sk::Tensor finite = sk::from_vector(ctx, std::vector<float>{1.5f, -2.0f}, {2});
  const sk::Tensor overflow = sk::from_vector(ctx, std::vector<float>{1.5f, NAN}, {2});
  auto step = [&](const sk::Tensor& grad) {  // what the engines' step(lr, scaler) runs
    scaler.check_grads(ctx, nullptr, {grad});
    scaler.update(ctx);
  };
  // The seed of the backward is the scale, on the device, in the loss's dtype.
  CHECK(sk::to_vector<float>(ctx, scaler.seed(ctx, sk::zeros(ctx, {1}, sk::DType::f32)))[0] == 8);
  step(finite);
  CHECK(!scaler.found_inf());
  CHECK(scaler.scale() == 8);
  CHECK(scaler.inv_scale() == 0.125f);
  CHECK(scaler.growth_tracker() == 1);
  step(finite);
  CHECK(scaler.scale() == 16);
  CHECK(scaler.growth_tracker() == 0);
  step(finite);
  step(overflow);
  CHECK(scaler.found_inf());
  CHECK(scaler.scale() == 8);
  CHECK(scaler.growth_tracker() == 0);
  const sk::Tensor bf16_seed = scaler.seed(ctx, sk::zeros(ctx, {}, sk::DType::bf16));
  CHECK(bf16_seed.dtype() == sk::DType::bf16);
  CHECK(sk::to_vector<float>(ctx, sk::cast(ctx, bf16_seed, sk::DType::f32))[0] == 8);
  CHECK_THROWS_WITH((void)scaler.seed(ctx, sk::zeros(ctx, {2}, sk::DType::f32)),
                    doctest::Contains("seed() is for a one-element loss"));
  CHECK(sk::optim::DynamicLossScaler().scale() == 65536);
  CHECK_THROWS_WITH(sk::optim::DynamicLossScaler({.init_scale = 0}),
                    doctest::Contains("init_scale must be a positive finite f32 number"));
  CHECK_THROWS_WITH(sk::optim::DynamicLossScaler({.backoff_factor = 1.5}),
                    doctest::Contains("backoff_factor must be in (0, 1)"));
  CHECK_THROWS_WITH(scaler.load(4, 7), doctest::Contains("growth tracker of 7 is outside [0, 2)"));
  // At f32's top the scale stays, as GradScaler's does: grown to inf it would skip every later
  // step (bf16 rarely overflows: 2^16 reaches 2^127 in about 222 000 clean steps).
  sk::optim::DynamicLossScaler top({.init_scale = 0x1p127, .growth_interval = 1});
  top.check_grads(ctx, nullptr, {finite});
  top.update(ctx);
  CHECK(top.scale() == 0x1p127f);
  CHECK(top.growth_tracker() == 0);
  CHECK_THROWS_WITH(sk::optim::DynamicLossScaler({.growth_factor = INFINITY}),
                    doctest::Contains("growth_factor must be a finite f32 number > 1"));
}

namespace {

// The loss-scaled checkpoints' engine: sdp with f16 compute.
sk::parallel::ParallelOptions f16_sdp() {
  sk::parallel::ParallelOptions options;
  options.stage = sk::parallel::Stage::sdp;
  options.precision = MixedPrecision::of(sk::DType::f16);
  return options;
}

}  // namespace

TEST_CASE("the loss scaler's state travels with the checkpoint") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_scaler_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    DataParallel dp(ctx, comm, trainable_specs(), config_for(OptimizerKind::sgd), f16_sdp());
    sk::optim::DynamicLossScaler scaler;
    scaler.load(512, 7);
    auto state = dp.training_state();
    state.scaler = &scaler;
    sk::checkpoint::save_checkpoint(dir.string(), state);
    sk::optim::DynamicLossScaler fresh;
    auto again = dp.training_state();
    again.scaler = &fresh;
    (void)sk::checkpoint::load_checkpoint(dir.string(), again);
    CHECK(fresh.scale() == 512);
    CHECK(fresh.growth_tracker() == 7);
    // A scaler that cannot take the saved state (a tracker of 7 with growth every 4 steps)
    // refuses the load before anything is written.
    const auto masters_before =
        sk::to_vector<float>(ctx, dp.training_state().optimizer->master_params()[0]);
    dp.set_full_params([&](std::size_t, const sk::Tensor& view) { sk::fill(ctx, view, 0.25); });
    const auto masters =
        sk::to_vector<float>(ctx, dp.training_state().optimizer->master_params()[0]);
    CHECK(masters != masters_before);
    sk::optim::DynamicLossScaler shorter({.growth_interval = 4});
    auto refused = dp.training_state();
    refused.scaler = &shorter;
    CHECK_THROWS_WITH((void)sk::checkpoint::load_checkpoint(dir.string(), refused),
                      doctest::Contains("growth tracker of 7 is outside [0, 4)"));
    CHECK(sk::to_vector<float>(ctx, dp.training_state().optimizer->master_params()[0]) == masters);
  });
  std::filesystem::remove_all(dir);
}

namespace {

// Rewrites `key` in every file of the checkpoint folder that holds it, as another writer could:
// the checksums are recomputed, so only the value itself is left to refuse.
void rewrite_metadata(const std::filesystem::path& folder, const std::string& key,
                      const std::string& value) {
  int rewritten = 0;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (entry.path().extension() != ".safetensors") continue;
    auto contents = sk::checkpoint::load_safetensors(entry.path().string());
    if (contents.metadata.count(key) == 0) continue;
    contents.metadata[key] = value;
    std::erase_if(contents.metadata, [](const auto& item) {
      return item.first.starts_with(sk::checkpoint::kCrc32Prefix) ||
             item.first == sk::checkpoint::kHeaderCrc32Key;
    });
    sk::checkpoint::save_safetensors(entry.path().string(), contents.tensors, contents.metadata);
    ++rewritten;
  }
  REQUIRE(rewritten > 0);
}

}  // namespace

TEST_CASE("a saved loss scale that is no positive finite number is refused by name on load") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_bad_scale_" + std::to_string(::getpid()));
  for (const auto layout :
       {sk::checkpoint::CheckpointLayout::full, sk::checkpoint::CheckpointLayout::sharded})
    for (const std::string bad : {"0", "-512", "inf", "nan", "1e400", "512x", ""}) {
      CAPTURE(layout);
      CAPTURE(bad);
      std::filesystem::remove_all(dir);
      std::string error;
      sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        DataParallel dp(ctx, comm, trainable_specs(), config_for(OptimizerKind::sgd), f16_sdp());
        sk::optim::DynamicLossScaler scaler;
        scaler.load(512, 3);
        auto state = dp.training_state();
        state.scaler = &scaler;
        sk::checkpoint::CheckpointOptions save;
        save.layout = layout;
        sk::checkpoint::save_checkpoint(dir.string(), state, save);
        comm.barrier();
        if (comm.rank() == 0) rewrite_metadata(dir, "shardkit.loss_scale", bad);
        comm.barrier();
        // Taken as "no scaler saved" before, the fresh scaler kept its 65536 silently.
        sk::optim::DynamicLossScaler fresh;
        auto again = dp.training_state();
        again.scaler = &fresh;
        try {
          (void)sk::checkpoint::load_checkpoint(dir.string(), again);
        } catch (const std::exception& e) {
          if (comm.rank() == 0) error = e.what();
        }
      });
      CHECK_MESSAGE(error.find("metadata 'shardkit.loss_scale' is '" + bad +
                               "', not a positive finite number") != std::string::npos,
                    error);
    }
  std::filesystem::remove_all(dir);
}

namespace {

// A module trained under `stage` in `precision` (rank 0's masters and compute copies after),
// with per-step losses of rank 0.
struct ModuleRun {
  std::vector<float> masters, values;
  std::vector<double> losses;
};

ModuleRun train_module(sk::parallel::Stage stage, OptimizerKind kind, int world,
                       MixedPrecision precision, int steps, bool resnet, int segments = 0,
                       bool scaled = false, std::int64_t batch_size = 4, float fixed_lr = 0) {
  ModuleRun out;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    std::shared_ptr<module_test::nn::Sequential> net;
    if (resnet)
      net = module_test::small_resnet(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
    else
      net = module_test::mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
    net->set_checkpoint_segments(segments);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 4096;
    options.precision = precision;
    if (resnet) {
      for (int layer = 1; layer <= 4; ++layer)
        for (int b = 0; b < 2; ++b)
          options.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." +
                                                 std::to_string(b));
    } else {
      options.fsdp.wrap.unit_paths = {"0", "3"};
    }
    sk::parallel::ShardedModule model(ctx, comm, net, config_for(kind), options);
    sk::optim::DynamicLossScaler scaler({.init_scale = 256});
    const sk::Shape shape = resnet ? sk::Shape{batch_size, 3, 8, 8} : sk::Shape{6, 12};
    auto lr = [&](int s) { return fixed_lr > 0 ? fixed_lr : lr_at(kind, s % 40); };
    const std::int64_t classes = resnet ? 5 : 7;
    for (int s = 0; s < steps; ++s) {
      model.zero_grad();
      // A fixed set of 8 batches, seen in turn: the loss can fall.
      auto b = module_test::batch(ctx, shape, classes, comm.rank(), s % 8);
      auto loss = module_test::ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
      if (comm.rank() == 0) out.losses.push_back(sk::to_vector<float>(ctx, loss.data())[0]);
      if (scaled) {
        module_test::ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
        model.step(lr(s), scaler);
      } else {
        module_test::ag::backward(ctx, loss);
        model.step(lr(s));
      }
    }
    auto masters = gather_masters(ctx, comm, *model.training_state().optimizer, true);
    std::vector<float> values;
    auto collect = [&] {
      for (const auto& [name, p] : net->named_parameters()) {
        const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, p.data(), sk::DType::f32));
        values.insert(values.end(), v.begin(), v.end());
      }
    };
    if (stage == sk::parallel::Stage::fsdp) {
      auto full = model.full_params();
      collect();
    } else {
      collect();
    }
    if (comm.rank() != 0) return;
    out.masters = std::move(masters);
    out.values = std::move(values);
  });
  return out;
}

}  // namespace

TEST_CASE("modules in bf16 and f16: every stage equals DDP of the same precision bit for bit") {
  using sk::parallel::Stage;
  for (auto dtype : {sk::DType::bf16, sk::DType::f16}) {
    for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adamw}) {
      for (bool resnet : {false, true}) {
        const int world = resnet ? 2 : 3;
        const int steps = resnet ? 3 : 6;
        const auto precision = MixedPrecision::of(dtype);
        const auto ddp = train_module(Stage::ddp, kind, world, precision, steps, resnet);
        for (auto stage : {Stage::oss, Stage::sdp, Stage::fsdp}) {
          const auto other = train_module(stage, kind, world, precision, steps, resnet,
                                          resnet && stage == Stage::fsdp ? 3 : 0);
          const std::string what = std::string(sk::dtype_name(dtype)) + " " +
                                   std::string(sk::optim::optimizer_kind_name(kind)) + " " +
                                   std::string(sk::parallel::stage_name(stage)) +
                                   (resnet ? " resnet" : " mlp");
          CHECK_MESSAGE(other.values == ddp.values, what);
          CHECK_MESSAGE(bitwise_equal(other.masters, ddp.masters), what);
          CHECK_MESSAGE(other.losses == ddp.losses, what);
        }
      }
    }
  }
}

TEST_CASE("a ResNet trained 200 steps in bf16 or f16 follows the f32 loss curve") {
  using sk::parallel::Stage;
  // 8 fixed batches of 16 images per rank, SGD with momentum at a constant 0.003 (a smooth
  // descent: at 0.01 this small problem turns chaotic after 100 steps and any two runs part,
  // f32 against f32 in another summation order too).
  const auto f32 = train_module(Stage::sdp, OptimizerKind::sgd, 2, MixedPrecision{}, 200, true, 0,
                                false, 16, 0.003f);
  const auto bf16 =
      train_module(Stage::sdp, OptimizerKind::sgd, 2, MixedPrecision::of(sk::DType::bf16), 200,
                   true, 0, false, 16, 0.003f);
  const auto f16 = train_module(Stage::fsdp, OptimizerKind::sgd, 2,
                                MixedPrecision::of(sk::DType::f16), 200, true, 0,
                                /*scaled=*/true, 16, 0.003f);
  // The loss falls in all three, and the 16-bit curves stay within 0.05 of the f32 one (means
  // over windows of 20 steps; measured: at most 0.022).
  auto window = [](const std::vector<double>& l, int from) {
    double sum = 0;
    for (int s = from; s < from + 20; ++s) sum += l[static_cast<std::size_t>(s)];
    return sum / 20;
  };
  for (const auto* run : {&f32, &bf16, &f16})
    CHECK(window(run->losses, 180) < 0.85 * window(run->losses, 0));
  for (int from = 0; from < 200; from += 20) {
    CAPTURE(from);
    CHECK(std::abs(window(bf16.losses, from) - window(f32.losses, from)) < 0.05);
    CHECK(std::abs(window(f16.losses, from) - window(f32.losses, from)) < 0.05);
  }
  MESSAGE("loss over steps 180-199: f32 ", window(f32.losses, 180), ", bf16 ",
          window(bf16.losses, 180), ", f16 ", window(f16.losses, 180));
}
