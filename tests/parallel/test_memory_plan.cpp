// The memory planner against the allocator: for every stage (and hybrid sharding, mixed
// precision, both partitions, FSDP units) the planned parameters, gradients and optimizer state
// equal what the engines hold after a step (the same plans build both); the measured peaks of
// communication and gathered units stay within the planned bounds, and so does the gradients'
// peak in a ResNet's backward (its layers' gradients, whole before they reach the buckets);
// activations measured on a ResNet step match the profile fitted from two smaller batches within
// 5%.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace dp_test;
using sk::MemoryCategory;
using sk::parallel::MemoryPlan;
using sk::parallel::PlannedRun;

namespace memory_plan_test {

struct Measured {
  std::int64_t parameters = 0, gradients = 0, optimizer_state = 0, communication_peak = 0;
  std::int64_t gradients_peak = 0;
};

// The most any rank holds of each category after `steps` steps (peaks: over the run).
Measured max_over(const std::vector<sk::MemorySnapshot>& snapshots) {
  Measured m;
  for (const auto& s : snapshots) {
    m.parameters = std::max(m.parameters, s.current_of(MemoryCategory::parameters));
    m.gradients = std::max(m.gradients, s.current_of(MemoryCategory::gradients));
    m.optimizer_state = std::max(m.optimizer_state, s.current_of(MemoryCategory::optimizer_state));
    m.communication_peak = std::max(m.communication_peak, s.peak_of(MemoryCategory::communication));
    m.gradients_peak = std::max(m.gradients_peak, s.peak_of(MemoryCategory::gradients));
  }
  return m;
}

// Two steps of `engine` (under hpZ each after a forward that gathers and releases every unit in
// order): each backward walks the units in reverse, gathering each one, filling
// its parameters' gradients (those `has_grad` names) and releasing it. Inside a unit the
// gradients come first parameter first when `ascending` -- the order that keeps every bucket of
// a unit allocated longest, the planner's worst case -- else last first, as a backward would.
template <class HasGrad>
void two_steps(sk::Context& ctx, sk::parallel::Engine& engine, float lr, bool ascending,
               HasGrad&& has_grad) {
  const std::size_t n = engine.param_count();
  for (int s = 0; s < 2; ++s) {
    engine.zero_grad();
    if (engine.node() != nullptr)  // hpZ: a forward keeps every unit's slice over the node
      for (std::size_t u = 0; u < engine.unit_count(); ++u) {
        engine.gather(u);
        engine.release_after_forward(u);
      }
    for (std::size_t u = engine.unit_count(); u-- > 0;) {
      engine.gather(u);
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t i = ascending ? k : n - 1 - k;
        if (engine.unit_of(i) != u || !has_grad(i)) continue;
        sk::fill(ctx, engine.grad(i), 0.01 * static_cast<double>(i + 1));
        engine.ready(i);
      }
      engine.release(u);
    }
    engine.finish();
    engine.step(lr);
  }
}

// The engines over dp_test's model (uneven sizes, a frozen parameter), two steps; per world rank
// the device's ledger, and in `host` (when given) the offload host context's.
std::vector<sk::MemorySnapshot> run_engine(
    const PlannedRun& o, std::vector<sk::MemorySnapshot>* host = nullptr,
    const std::vector<sk::shard::ParamSpec>& model = model_specs()) {
  std::vector<sk::MemorySnapshot> out(static_cast<std::size_t>(o.world_size));
  if (host != nullptr) host->assign(static_cast<std::size_t>(o.world_size), {});
  sk::comm::run_ranks(o.world_size, [&](sk::Context& ctx, sk::comm::Communicator& world) {
    std::unique_ptr<sk::comm::HybridMesh> mesh;
    if (o.group_size > 0) mesh = std::make_unique<sk::comm::HybridMesh>(world, o.group_size);
    const auto& specs = model;
    const sk::parallel::ParallelOptions& options = o.parallel;
    auto record = [&](const sk::parallel::Engine& engine) {
      out[static_cast<std::size_t>(world.rank())] = ctx.memory_stats().snapshot();
      if (host != nullptr)
        (*host)[static_cast<std::size_t>(world.rank())] =
            engine.host_context().memory_stats().snapshot();
    };
    // A custom loop keeps frozen parameters outside FSDP's units, whole, in the compute dtype.
    std::vector<sk::Tensor> frozen;
    if (o.parallel.stage == Stage::fsdp) {
      std::vector<sk::parallel::FsdpUnitParams> units;
      for (const auto& members : o.fsdp_units) {
        units.push_back({std::string("u").append(std::to_string(units.size())), {}});
        for (auto i : members) units.back().params.push_back(specs[i]);
      }
      for (const auto& p : specs)
        if (!p.trainable)
          frozen.push_back(sk::zeros(ctx, p.shape, o.parallel.precision.param_dtype,
                                     MemoryCategory::parameters));
      using Fsdp = sk::parallel::FsdpEngine;
      auto engine = mesh ? std::make_unique<Fsdp>(ctx, *mesh, units, o.optimizer, options)
                         : std::make_unique<Fsdp>(ctx, world, units, o.optimizer, options);
      two_steps(ctx, *engine, 0.1f, true, [](std::size_t) { return true; });
      record(*engine);
    } else {
      auto engine = mesh ? std::make_unique<DataParallel>(ctx, *mesh, specs, o.optimizer, options)
                         : std::make_unique<DataParallel>(ctx, world, specs, o.optimizer, options);
      two_steps(ctx, *engine, 0.05f, false, [&](std::size_t i) { return specs[i].trainable; });
      record(*engine);
    }
  });
  return out;
}

// dp_test's model at `world` ranks (hybrid groups of `group`, 0: none) with buckets small
// enough that it spans several, and under fsdp three units.
PlannedRun small_buckets_run(Stage stage, int world, int group, OptimizerKind kind,
                             const sk::parallel::MixedPrecision& precision,
                             PartitionKind partition) {
  PlannedRun o;
  o.parallel.stage = stage;
  o.world_size = world;
  o.group_size = group;
  o.optimizer = config_for(kind);
  o.parallel.precision = precision;
  o.parallel.partition = partition;
  o.parallel.buckets.bucket_bytes = 2048;
  o.parallel.fsdp.coalesce_bytes = 1024;
  if (stage == Stage::fsdp) o.fsdp_units = {{0, 1, 2}, {4, 5}, {6, 7, 8}};
  return o;
}

std::string describe(const PlannedRun& o) {
  std::ostringstream out;
  out << sk::parallel::stage_name(o.parallel.stage) << " N=" << o.world_size
      << " G=" << o.group_size << " " << sk::optim::optimizer_kind_name(o.optimizer.kind) << " "
      << sk::dtype_name(o.parallel.precision.param_dtype) << " "
      << sk::shard::partition_kind_name(o.parallel.partition);
  return out.str();
}

void check_plan(const PlannedRun& o,
                const std::vector<sk::shard::ParamSpec>& model = model_specs()) {
  const MemoryPlan plan = sk::parallel::plan_memory(model, o);
  const Measured m = max_over(run_engine(o, nullptr, model));
  INFO(describe(o));
  CHECK(plan.parameters == m.parameters);
  CHECK(plan.gradients == m.gradients);
  CHECK(plan.optimizer_state == m.optimizer_state);
  // Transients: the planned bounds hold (gathered units count as communication here).
  CHECK(m.communication_peak <= plan.communication + plan.gathered);
}

// Offload: every rank's two ledgers against the plan of that rank (its shard rank).
void check_offload_plan(const PlannedRun& o) {
  std::vector<sk::MemorySnapshot> host;
  const auto device = run_engine(o, &host);
  const int group = o.group_size == 0 ? o.world_size : o.group_size;
  for (int r = 0; r < o.world_size; ++r) {
    PlannedRun one = o;
    one.rank = r % group;
    const MemoryPlan plan = sk::parallel::plan_memory(model_specs(), one);
    const auto& d = device[static_cast<std::size_t>(r)];
    const auto& h = host[static_cast<std::size_t>(r)];
    INFO(describe(o), " offload optimizer=", o.parallel.offload.optimizer,
         " params=", o.parallel.offload.params, " rank ", r);
    CHECK(plan.parameters == d.current_of(MemoryCategory::parameters));
    CHECK(plan.gradients == d.current_of(MemoryCategory::gradients));
    CHECK(plan.optimizer_state == d.current_of(MemoryCategory::optimizer_state));
    CHECK(d.current_of(MemoryCategory::optimizer_state) == 0);
    CHECK(plan.host_parameters == h.current_of(MemoryCategory::parameters));
    CHECK(plan.host_gradients == h.current_of(MemoryCategory::gradients));
    CHECK(plan.host_optimizer_state == h.current_of(MemoryCategory::optimizer_state));
    CHECK(plan.host_optimizer_state > 0);
    CHECK(d.peak_of(MemoryCategory::communication) <= plan.communication + plan.gathered);
  }
}

}  // namespace memory_plan_test

using namespace memory_plan_test;

TEST_CASE("offloaded plans equal the device's and the host's ledgers, rank by rank") {
  sk::parallel::MixedPrecision bf16 = sk::parallel::MixedPrecision::of(sk::DType::bf16);
  for (auto kind : {OptimizerKind::larc_sgd, OptimizerKind::adamw})
    for (auto stage : sk::parallel::kAllStages)
      for (const auto& precision : {sk::parallel::MixedPrecision{}, bf16})
        for (bool params : {false, true}) {
          if (params && stage != Stage::fsdp) continue;
          for (const auto& [world, group] : {std::pair{3, 0}, std::pair{4, 2}}) {
            PlannedRun o = small_buckets_run(
                stage, world, group, kind, precision,
                stage == Stage::oss ? PartitionKind::greedy : PartitionKind::flat);
            o.parallel.offload.optimizer = true;
            o.parallel.offload.params = params;
            check_offload_plan(o);
          }
        }
  // The formulas: ZeRO-3 with everything offloaded keeps no model state on the device; the
  // host holds a rank's 2 bytes of gradients per parameter, 2 of bf16 params and 12 of state.
  std::vector<sk::shard::ParamSpec> specs;
  for (int i = 0; i < 64; ++i)
    specs.push_back({std::string("w").append(std::to_string(i)), {1024}});
  PlannedRun o;
  o.parallel.stage = Stage::fsdp;
  o.world_size = 8;
  o.optimizer.kind = OptimizerKind::adamw;
  o.parallel.precision = bf16;
  o.parallel.offload.params = true;
  const auto plan = sk::parallel::plan_memory(specs, o);
  const double per_rank = 65536.0 / 8;
  CHECK(plan.parameters == 0);
  CHECK(plan.optimizer_state == 0);
  CHECK(plan.gradients == 0);
  CHECK(static_cast<double>(plan.host_gradients) == 2 * per_rank);
  CHECK(static_cast<double>(plan.host_parameters) == 2 * per_rank);
  CHECK(static_cast<double>(plan.host_optimizer_state) == 12 * per_rank);
  CHECK(plan.host_transfer == 2 * per_rank + 2 * 2 * per_rank);
  o.parallel.stage = Stage::sdp;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(specs, o),
                    doctest::Contains("offload.params keeps parameter shards on the host"));
  o.parallel.stage = Stage::fsdp;
  o.rank = 8;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(specs, o),
                    doctest::Contains("rank 8 is not a rank of the shard group of 8"));
}

TEST_CASE("planned model states equal the allocator's after a step, for every stage") {
  sk::parallel::MixedPrecision bf16;
  bf16.param_dtype = sk::DType::bf16;
  bf16.reduce_dtype = sk::DType::f32;
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
      for (auto partition : {PartitionKind::greedy, PartitionKind::flat}) {
        if (stage == Stage::fsdp && partition == PartitionKind::greedy) continue;
        for (const auto& precision : {sk::parallel::MixedPrecision{}, bf16}) {
          for (const auto& [world, group] : {std::pair{4, 0}, std::pair{3, 0}, std::pair{8, 4}}) {
            check_plan(small_buckets_run(stage, world, group, kind, precision, partition));
          }
        }
      }
    }
  }
}

// Hybrid sharding holds every bucket's reduced part until the exchange across groups at the
// backward's end; with a wire dtype other than the gradients' each part is a buffer of its own
// (the planner once counted only the buckets in flight). Many buckets of one size, so that
// the held parts, not the largest bucket, set the peak.
TEST_CASE("hybrid with a wire dtype of its own: the plan holds every bucket's part") {
  std::vector<sk::shard::ParamSpec> many;
  for (int i = 0; i < 64; ++i) many.push_back({"p" + std::to_string(i), {1024}});
  sk::parallel::MixedPrecision bf16;
  bf16.param_dtype = sk::DType::bf16;
  bf16.reduce_dtype = sk::DType::f32;
  for (auto stage : {Stage::ddp, Stage::sdp}) {
    PlannedRun o = small_buckets_run(stage, 4, 2, OptimizerKind::sgd, bf16, PartitionKind::flat);
    o.parallel.buckets.bucket_bytes = 4096;
    check_plan(o, many);
  }
}

// Inside an FSDP unit the gradients may come in any order (the harness gives them first
// parameter first: every bucket of the unit touched before the first can go); with many buckets
// a unit's transients are then all of its buckets, not the ones in flight.
TEST_CASE("fsdp: the plan holds a unit's buckets whatever order its gradients come in") {
  std::vector<sk::shard::ParamSpec> many;
  for (int i = 0; i < 64; ++i) many.push_back({"p" + std::to_string(i), {1024}});
  for (const auto& [world, group] : {std::pair{4, 0}, std::pair{4, 2}}) {
    PlannedRun o =
        small_buckets_run(Stage::fsdp, world, group, OptimizerKind::sgd, {}, PartitionKind::flat);
    o.parallel.buckets.bucket_bytes = 4096;
    o.fsdp_units = {{}};
    for (std::size_t i = 0; i < 48; ++i) o.fsdp_units[0].push_back(i);
    o.fsdp_units.push_back({});
    for (std::size_t i = 48; i < 64; ++i) o.fsdp_units[1].push_back(i);
    check_plan(o, many);
  }
}

// Per block (int8, a scale per 16 values) and per tensor (E4M3 codes alone, each parameter's
// maximum all-reduced beside them).
TEST_CASE("qwZ: the plan's bounds hold the wires, and its gather traffic is a quarter") {
  sk::parallel::MixedPrecision bf16 = sk::parallel::MixedPrecision::of(sk::DType::bf16);
  for (const auto scale : {sk::ops::QuantScale::block, sk::ops::QuantScale::tensor})
    for (const auto& precision : {sk::parallel::MixedPrecision{}, bf16})
      for (const auto& [world, group] : {std::pair{3, 0}, std::pair{4, 2}}) {
        CAPTURE(sk::ops::quant_scale_name(scale));
        PlannedRun o = small_buckets_run(Stage::fsdp, world, group, OptimizerKind::adamw, precision,
                                         PartitionKind::flat);
        o.parallel.fsdp.quantized_weights = true;
        o.parallel.fsdp.quantization_block = 16;
        if (scale == sk::ops::QuantScale::tensor) {
          o.parallel.fsdp.quantized_weights_format = sk::ops::QuantFormat::f8_e4m3;
          o.parallel.fsdp.quantized_weights_scale = scale;
        }
        check_plan(o);  // the allocator's peaks under the plan's bounds
        const MemoryPlan quantized = sk::parallel::plan_memory(model_specs(), o);
        o.parallel.fsdp.quantized_weights = false;
        o.parallel.fsdp.quantized_weights_scale = sk::ops::QuantScale::block;
        const MemoryPlan exact = sk::parallel::plan_memory(model_specs(), o);
        CHECK(quantized.gathered > exact.gathered);  // the wires, while the runs are unpacked
        // Per gathered value (twice a step: forward and backward) 1 byte + 4 / 16 of a scale
        // (per tensor: the byte alone) instead of 4 (f32) or 2 (bf16); the gradients'
        // reduce-scatter is unchanged.
        double psi = 0;
        for (const auto& spec : model_specs())
          if (spec.trainable) psi += static_cast<double>(sk::shape_numel(spec.shape));
        const double g = group == 0 ? world : group, ring = (g - 1) / g;
        const double param = precision.enabled() ? 2.0 : 4.0;
        const double wire = scale == sk::ops::QuantScale::tensor ? 1.0 : 1.25;
        CHECK(exact.sent_in_group - quantized.sent_in_group ==
              doctest::Approx(2 * psi * ring * (param - wire)));
      }
}

TEST_CASE("qgZ: the plan's bounds hold the int8 and int4 runs and the residual; its traffic") {
  sk::parallel::MixedPrecision bf16 = sk::parallel::MixedPrecision::of(sk::DType::bf16);
  for (const auto format : {sk::ops::QuantFormat::int8, sk::ops::QuantFormat::int4})
    for (const auto& precision : {sk::parallel::MixedPrecision{}, bf16})
      for (const auto& [world, group] : {std::pair{3, 0}, std::pair{4, 2}})
        for (const bool feedback : {false, true}) {
          PlannedRun o = small_buckets_run(Stage::fsdp, world, group, OptimizerKind::adamw,
                                           precision, PartitionKind::flat);
          o.parallel.fsdp.quantized_grads = true;
          o.parallel.fsdp.quantized_grads_format = format;
          o.parallel.fsdp.grad_error_feedback = feedback;
          o.parallel.fsdp.quantization_block = 16;
          CAPTURE(sk::ops::quant_format_name(format));
          CAPTURE(feedback);
          check_plan(o);  // the allocator's peaks under the plan's bounds
          const MemoryPlan quantized = sk::parallel::plan_memory(model_specs(), o);
          o.parallel.fsdp.quantized_grads = false;
          o.parallel.fsdp.grad_error_feedback = false;
          const MemoryPlan exact = sk::parallel::plan_memory(model_specs(), o);
          double psi = 0;
          for (const auto& spec : model_specs())
            if (spec.trainable) psi += static_cast<double>(sk::shape_numel(spec.shape));
          // Error feedback keeps an f32 residual of every local gradient (Psi elements, padding
          // aside), and in hybrid groups of G one of every reduced gradient as well (Psi / G);
          // without it the gradients are the exact run's.
          if (feedback)
            CHECK(quantized.gradients - exact.gradients >=
                  static_cast<std::int64_t>(4 * psi * (group == 0 ? 1.0 : 1.0 + 1.0 / group)));
          else
            CHECK(quantized.gradients == exact.gradients);
          // Per reduced value 1 byte (int4: half of one) + 4 / 16 of a scale instead of the wire
          // dtype's 4 or 2.
          const double g = group == 0 ? world : group, ring = (g - 1) / g;
          const double wire = precision.enabled() ? 2.0 : 4.0;
          const double code = format == sk::ops::QuantFormat::int4 ? 0.5 : 1.0;
          CHECK(exact.sent_in_group - quantized.sent_in_group ==
                doctest::Approx(psi * ring * (wire - code - 0.25)));
          if (group > 0) {
            // Across groups: a reduce-scatter and an all-gather of the group's share -- in codes,
            // or without quantized_grads_across_groups in the f32 sums it holds.
            const double r = double(world) / g, across = (r - 1) / r;
            CHECK(quantized.sent_across_groups ==
                  doctest::Approx(2 * psi / g * (code + 0.25) * across));
            o.parallel.fsdp.quantized_grads = true;
            o.parallel.fsdp.quantized_grads_across_groups = false;
            CHECK(sk::parallel::plan_memory(model_specs(), o).sent_across_groups ==
                  doctest::Approx(2 * psi / g * 4 * across));
          }
        }
}

TEST_CASE("hpZ: the plan holds every unit's slice over the node; the backward's gathers in it") {
  for (const auto& [world, node] : {std::pair{4, 2}, std::pair{6, 3}}) {
    PlannedRun o =
        small_buckets_run(Stage::fsdp, world, 0, OptimizerKind::adamw, {}, PartitionKind::flat);
    o.parallel.fsdp.reshard_group_size = node;
    CAPTURE(node);
    check_plan(o);  // the allocator's peaks under the plan's bounds
    const MemoryPlan partial = sk::parallel::plan_memory(model_specs(), o);
    o.parallel.fsdp.reshard_group_size = 0;
    const MemoryPlan plain = sk::parallel::plan_memory(model_specs(), o);
    CHECK(partial.gathered > plain.gathered);
    CHECK(partial.parameters == plain.parameters);
    // The backward's gather moves Psi (G-1)/G instead of Psi (N-1)/N (f32).
    double psi = 0;
    for (const auto& spec : model_specs())
      if (spec.trainable) psi += static_cast<double>(sk::shape_numel(spec.shape));
    const double n = world, g = node;
    CHECK(plain.sent_in_group - partial.sent_in_group ==
          doctest::Approx(4 * psi * ((n - 1) / n - (g - 1) / g)));
  }
  PlannedRun hybrid =
      small_buckets_run(Stage::fsdp, 4, 2, OptimizerKind::sgd, {}, PartitionKind::flat);
  hybrid.parallel.fsdp.reshard_group_size = 2;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(model_specs(), hybrid),
                    doctest::Contains("needs plain sharding over a world it divides"));
}

TEST_CASE("the plan follows the ZeRO formulas with the group size in place of N") {
  std::vector<sk::shard::ParamSpec> specs;
  for (int i = 0; i < 64; ++i)
    specs.push_back({std::string("w").append(std::to_string(i)), {1024}});  // 2^16 in all
  const double psi = 65536;
  for (auto stage : sk::parallel::kAllStages) {
    for (const auto& [world, group] : {std::pair{8, 0}, std::pair{8, 2}, std::pair{64, 8}}) {
      PlannedRun o;
      o.parallel.stage = stage;
      o.world_size = world;
      o.group_size = group;
      o.optimizer.kind = OptimizerKind::adamw;  // K = 8 bytes of f32 state per parameter
      const auto plan = sk::parallel::plan_memory(specs, o);
      const int n = group == 0 ? world : group;
      CHECK_MESSAGE(
          static_cast<double>(plan.model_states()) ==
              doctest::Approx(sk::parallel::zero_model_state_bytes(stage, psi, 8, n)).epsilon(0.01),
          sk::parallel::stage_name(stage), " N=", world, " G=", group);
    }
  }
}

TEST_CASE("activations: a profile measured by doubling from batch 2 predicts others within 5%") {
  for (int segments : {0, 2}) {
    auto peak_at = [&](std::int64_t batch) {
      sk::Context ctx({.seed = 3, .cpu_threads = 1});
      auto net = module_test::small_resnet(ctx, 5);
      net->set_checkpoint_segments(segments);
      auto b = module_test::batch(ctx, {batch, 3, 16, 16}, 5, 0, 0);
      ctx.memory_stats().reset_peak();
      sk::autograd::backward(ctx, sk::autograd::cross_entropy(ctx, (*net)(ctx, b.x), b.labels));
      return ctx.memory_stats().snapshot().peak_of(MemoryCategory::activations);
    };
    const auto profile = sk::parallel::profile_activations(peak_at, 2, 64);
    // Batches it measured, batches between them, and one past them.
    for (std::int64_t batch : {3, 6, 12, 24, 40}) {
      const auto measured = peak_at(batch);
      INFO("segments ", segments, " batch ", batch, ": measured ", measured, " planned ",
           profile.at(batch));
      CHECK(std::fabs(static_cast<double>(profile.at(batch) - measured)) <= 0.05 * measured);
    }
    CHECK(profile.bytes_per_sample > 0);
  }
}

TEST_CASE("ShardedModule: the module plan matches a ResNet's model states under every stage") {
  const int world = 4;
  for (auto stage : sk::parallel::kAllStages) {
    std::vector<sk::MemorySnapshot> snapshots(world);
    MemoryPlan plan;
    sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = module_test::small_resnet(ctx, 7);
      PlannedRun o;  // the module's options, planned before it is wrapped
      o.parallel.stage = stage;
      o.parallel.buckets.bucket_bytes = 4096;
      o.parallel.fsdp.wrap.unit_paths = {"layer1.0", "layer2.0", "layer3.0", "layer4.0"};
      o.world_size = world;
      o.optimizer = config_for(OptimizerKind::larc_sgd);
      if (comm.rank() == 0) plan = sk::parallel::plan_module_memory(*net, o);
      sk::parallel::ShardedModule model(ctx, comm, net, o.optimizer, o.parallel);
      for (int s = 0; s < 2; ++s) {
        model.zero_grad();
        auto b = module_test::batch(ctx, {2, 3, 8, 8}, 5, comm.rank(), s);
        sk::autograd::backward(ctx, sk::autograd::cross_entropy(ctx, model(ctx, b.x), b.labels));
        model.step(0.1f);
      }
      snapshots[static_cast<std::size_t>(comm.rank())] = ctx.memory_stats().snapshot();
    });
    const Measured m = max_over(snapshots);
    INFO(sk::parallel::stage_name(stage));
    CHECK(plan.parameters == m.parameters);  // (the batch-norm buffers, whole, among them)
    CHECK(plan.gradients == m.gradients);
    CHECK(plan.optimizer_state == m.optimizer_state);
    // In the backward each layer's parameter gradients are made whole before they reach the
    // engine: above the kept gradients, within the plan's bound (layer4's 3x3 convolution).
    CHECK(m.gradients_peak > m.gradients);
    CHECK(m.gradients_peak <= plan.gradients + plan.layer_gradients);
    CHECK(plan.layer_gradients == 4 * 64 * 64 * 9);
  }
}

TEST_CASE("largest_batch and bad plans") {
  const auto specs = model_specs();
  PlannedRun o;
  o.parallel.stage = Stage::sdp;
  o.world_size = 4;
  const sk::parallel::ActivationProfile profile{1000, 500};
  const auto fixed = sk::parallel::plan_memory(specs, o).total();
  const auto fixed_parameters = sk::parallel::plan_memory(specs, o).parameters;
  const auto batch = sk::parallel::largest_batch(specs, o, profile, fixed + 1000 + 500 * 10 + 499);
  CHECK(batch == 10);
  CHECK(sk::parallel::largest_batch(specs, o, profile, fixed) == 0);
  o.group_size = 3;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(specs, o),
                    doctest::Contains("a shard group of 3 ranks does not divide the world of 4"));
  o.group_size = 0;
  o.buffer_bytes = -4;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(specs, o),
                    doctest::Contains("memory plan: buffer_bytes -4 is negative"));
  o.buffer_bytes = 4000;  // (on every rank's device, counted under parameters)
  CHECK(sk::parallel::plan_memory(specs, o).parameters == fixed_parameters + 4000);
  o.buffer_bytes = 0;
  CHECK_THROWS_WITH(sk::parallel::largest_batch(specs, o, {}, 1 << 30),
                    doctest::Contains("no per-sample bytes"));
  // An empty FSDP unit, which the engine refuses, would shift root_unit onto another unit.
  o.parallel.stage = Stage::fsdp;
  o.fsdp_units = {{}, {0, 1, 2}, {4, 5}, {6, 7, 8}};
  o.root_unit = 1;
  CHECK_THROWS_WITH(sk::parallel::plan_memory(specs, o),
                    doctest::Contains("FSDP unit #0 has no parameter"));
}
