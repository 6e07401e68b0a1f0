// Deferred parameters (core/deferred_init.hpp): a model built under DeferredParameters holds no
// parameter memory, refuses every use but a whole-tensor fill by name, and once wrapped -- or
// materialized -- holds the eager build's values bit for bit under every stage (hybrid and
// offloaded too); each rank makes what it keeps from rank 0's recipes, so under fsdp the wrap
// holds nothing beyond the shards and sends no parameter values.
#include <doctest/doctest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/core/deferred_init.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace module_test;
using sk::optim::OptimizerKind;
using sk::parallel::Stage;

namespace deferred_test {  // (named: the directory's tests are one unity unit)

// ResNet-18 8 channels wide with torchvision's initialisation (kaiming_normal fan_out, the
// blocks' last batch-norm at 0): every kind of recorded fill, one overwriting another. Built
// from `seed` on `ctx`, under DeferredParameters when `deferred`.
std::shared_ptr<nn::ResNet> resnet(sk::Context& ctx, std::uint64_t seed, bool deferred) {
  nn::ResNetOptions o;
  o.num_classes = 5;
  o.small_image_stem = true;
  o.base_channels = 8;
  o.init = nn::ResNetInit::torchvision;
  o.zero_init_residual = true;
  ctx.manual_seed(seed);
  std::optional<sk::DeferredParameters> scope;
  if (deferred) scope.emplace(ctx);
  return nn::resnet18(ctx, o);
}

sk::autograd::Variable param(const nn::Module& net, const std::string& name) {
  for (const auto& [n, p] : net.named_parameters())
    if (n == name) return p;
  FAIL("no parameter ", name);
  return {};
}

sk::parallel::FsdpOptions unit_per_block() {
  sk::parallel::FsdpOptions o;
  for (int layer = 1; layer <= 4; ++layer)
    for (int b = 0; b < 2; ++b)
      o.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." + std::to_string(b));
  return o;
}

struct Outcome {
  std::vector<float> values;               // rank 0 after training: parameters, then f32 buffers
  std::int64_t wrap_peak_over_steady = 0;  // rank 0: the wrap's transient bytes
  std::int64_t largest_unit_bytes = 0;     // rank 0: the largest group's whole f32 buffer
  sk::parallel::MemoryPlan plan;           // the planner's figures for the run
  std::int64_t wrap_peak = 0;              // rank 0: its memory's peak, build to wrap
  // What the module holds that no plan column counts: small tensors of its own (batch-norm's
  // increment).
  std::int64_t module_other_bytes = 0;
  std::uint64_t wrap_bus_bytes = 0;  // rank 0: what the wrap sent (the communicator's counters)
  std::int64_t buffer_bytes = 0;     // the module's buffers (broadcast at the wrap either way)
};

// `hybrid_group` > 0: hybrid sharding in groups of that size; `offload`: the optimizer and
// (fsdp) the parameter shards on the host.
Outcome train(Stage stage, bool deferred, sk::DType param_dtype, int world, bool fc_frozen,
              int hybrid_group = 0, bool offload = false) {
  Outcome out;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    // Ranks build different models: rank 0's values are everyone's, deferred or not.
    ctx.memory_stats().reset_peak();
    auto net = resnet(ctx, 40 + static_cast<std::uint64_t>(comm.rank()), deferred);
    std::int64_t other = ctx.memory_stats().snapshot().current_total;  // (all of it if deferred)
    if (!deferred)
      for (const auto& [name, p] : net->named_parameters())
        other -= static_cast<std::int64_t>(p.data().nbytes());
    if (!deferred)  // (the plan counts the buffers: made at the wrap when deferred)
      for (const auto& [name, b] : net->named_buffers())
        other -= static_cast<std::int64_t>(b.nbytes());
    if (fc_frozen)  // (outside fsdp's units, whole on every rank: f32, then the compute dtype)
      for (const char* name : {"fc.weight", "fc.bias"}) param(*net, name).set_requires_grad(false);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 4096;
    options.precision.param_dtype = param_dtype;
    if (stage == Stage::fsdp) options.fsdp = unit_per_block();
    options.offload.optimizer = offload;
    options.offload.params = offload && stage == Stage::fsdp;
    sk::parallel::PlannedRun planned;
    planned.parallel = options;
    planned.world_size = world;
    planned.optimizer = dp_test::config_for(OptimizerKind::sgd);
    if (comm.rank() == 0) out.plan = sk::parallel::plan_module_memory(*net, planned);
    comm.reset_stats();
    std::optional<sk::comm::HybridMesh> mesh;
    if (hybrid_group > 0) {
      mesh.emplace(comm, hybrid_group);
      planned.group_size = hybrid_group;
      if (comm.rank() == 0) out.plan = sk::parallel::plan_module_memory(*net, planned);
    }
    sk::parallel::ShardedModule model =
        mesh ? sk::parallel::ShardedModule(ctx, *mesh, net, dp_test::config_for(OptimizerKind::sgd),
                                           options)
             : sk::parallel::ShardedModule(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                           options);
    const auto wrapped = ctx.memory_stats().snapshot();
    if (comm.rank() == 0) {
      out.wrap_bus_bytes = comm.stats().total_bus_bytes();
      for (const auto& [name, b] : net->named_buffers())
        out.buffer_bytes +=
            static_cast<std::int64_t>(b.numel()) * (sk::is_floating(b.dtype()) ? 4 : 8);
      out.wrap_peak = wrapped.peak_total;
      out.module_other_bytes = other;
      out.wrap_peak_over_steady = wrapped.peak_total - wrapped.current_total;
      for (std::size_t u = 0; u < model.engine().unit_count(); ++u)
        out.largest_unit_bytes = std::max(
            out.largest_unit_bytes,
            static_cast<std::int64_t>(model.engine().group(u).flat().params().flat().numel() * 4));
    }
    for (int s = 0; s < 3; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {4, 3, 8, 8}, 5, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(0.05f);
    }
    auto full = model.full_params();  // (collective: fsdp gathers every unit)
    if (comm.rank() == 0) out.values = module_values(ctx, *net);
  });
  return out;
}

}  // namespace deferred_test

namespace dt = deferred_test;

TEST_CASE("deferred parameters: no memory, recorded fills, uses refused by name") {
  sk::Context ctx;
  auto net = dt::resnet(ctx, 7, true);
  CHECK(ctx.memory_stats().snapshot().current_of(sk::MemoryCategory::parameters) == 0);
  const sk::Tensor weight = dt::param(*net, "conv1.weight").data();
  CHECK(sk::is_deferred(weight));
  CHECK(weight.storage()->init_recipe().kind == sk::InitRecipe::Kind::random);
  // (zero_init_residual's fill replaced the batch-norm's 1)
  const sk::Tensor bn2 = dt::param(*net, "layer1.0.bn2.weight").data();
  CHECK(bn2.storage()->init_recipe().kind == sk::InitRecipe::Kind::constant);
  CHECK(bn2.storage()->init_recipe().value == 0.0);
  // Any other use names the scope and the fix.
  CHECK_THROWS_WITH_AS(sk::to_vector<float>(ctx, weight),
                       doctest::Contains("built under DeferredParameters has no memory yet"),
                       sk::StateError);
  CHECK_THROWS_WITH_AS(sk::fill(ctx, weight.slice(0, 0, 2), 1.0),
                       doctest::Contains("fill of part of a deferred tensor"), sk::StateError);
  // A deferred parameter nobody initialised is named when it is needed.
  sk::Context other;
  std::optional<sk::DeferredParameters> scope(std::in_place, other);
  const sk::Tensor bare = sk::empty(other, {3}, sk::DType::f32, sk::MemoryCategory::parameters);
  scope.reset();
  CHECK_THROWS_WITH_AS(sk::materialize(other, bare, "parameter 'w'"),
                       doctest::Contains("parameter 'w' was built under DeferredParameters and "
                                         "never initialised"),
                       sk::StateError);
  // Outside the scope nothing is deferred.
  CHECK_FALSE(
      sk::is_deferred(sk::empty(other, {3}, sk::DType::f32, sk::MemoryCategory::parameters)));

  // Materialized: the eager build's values, bit for bit, and its memory.
  nn::materialize(ctx, *net);
  sk::Context eager_ctx;
  auto eager = dt::resnet(eager_ctx, 7, false);
  CHECK(dp_test::bitwise_equal(module_values(ctx, *net), module_values(eager_ctx, *eager)));
  CHECK(ctx.memory_stats().snapshot().current_of(sk::MemoryCategory::parameters) ==
        eager_ctx.memory_stats().snapshot().current_of(sk::MemoryCategory::parameters));
  // Later draws of the stream are the eager build's too (the deferred fills took their blocks).
  const auto next = sk::empty(ctx, {9}, sk::DType::f32);
  const auto eager_next = sk::empty(eager_ctx, {9}, sk::DType::f32);
  sk::normal_(ctx, next, 0, 1);
  sk::normal_(eager_ctx, eager_next, 0, 1);
  CHECK(sk::to_vector<float>(ctx, next) == sk::to_vector<float>(eager_ctx, eager_next));
}

TEST_CASE(
    "deferred parameters: wrapped under every stage, the eager build's training bit for bit") {
  struct Case {
    Stage stage;
    sk::DType param_dtype;
    int world;
    int hybrid_group = 0;
    bool offload = false;
  };
  sk::Context build_ctx;
  const auto params =
      static_cast<std::int64_t>(dt::resnet(build_ctx, 1, false)->named_parameters().size());
  for (const Case c :
       {Case{Stage::ddp, sk::DType::f32, 2}, Case{Stage::oss, sk::DType::f32, 3},
        Case{Stage::sdp, sk::DType::f32, 2}, Case{Stage::fsdp, sk::DType::f32, 3},
        Case{Stage::fsdp, sk::DType::bf16, 2}, Case{Stage::fsdp, sk::DType::f32, 4, 2},
        Case{Stage::sdp, sk::DType::bf16, 4, 2}, Case{Stage::fsdp, sk::DType::bf16, 2, 0, true}}) {
    const auto what = std::string(sk::parallel::stage_name(c.stage)) + " " +
                      std::string(sk::dtype_name(c.param_dtype)) + " N=" + std::to_string(c.world) +
                      " hybrid groups of " + std::to_string(c.hybrid_group) +
                      (c.offload ? " offloaded" : "");
    const dt::Outcome eager =
        dt::train(c.stage, false, c.param_dtype, c.world, true, c.hybrid_group, c.offload);
    const dt::Outcome deferred =
        dt::train(c.stage, true, c.param_dtype, c.world, true, c.hybrid_group, c.offload);
    CHECK_MESSAGE(!eager.values.empty(), what);
    CHECK_MESSAGE(dp_test::bitwise_equal(deferred.values, eager.values), what);
    // The planner bounds the wrap's peak (an f32 staging copy and the frozen fc's f32 values
    // under bf16), both ways.
    CHECK_MESSAGE(deferred.wrap_peak <= deferred.plan.wrap_peak(true) + deferred.module_other_bytes,
                  what);
    CHECK_MESSAGE(eager.wrap_peak <= eager.plan.wrap_peak(false) + eager.module_other_bytes, what);
    CHECK_MESSAGE(deferred.wrap_peak < eager.wrap_peak, what);
    // No parameter value travels, not even the frozen fc's outside fsdp's units: the wrap
    // sends rank 0's recipes and the buffers (the world's counters: hybrid's groups count
    // their own).
    if (c.hybrid_group == 0) {
      CHECK_MESSAGE(deferred.wrap_bus_bytes <=
                        static_cast<std::uint64_t>(sk::parallel::MemoryPlan::kRecipeBytes * params +
                                                   deferred.buffer_bytes + 4096),
                    what);
      CHECK_MESSAGE(deferred.wrap_bus_bytes * 4 < eager.wrap_bus_bytes, what);
    }
  }
}

TEST_CASE("deferred parameters: an fsdp wrap makes each rank's shards only, and sends no values") {
  const int world = 4;
  const dt::Outcome eager = dt::train(Stage::fsdp, false, sk::DType::f32, world, false);
  const dt::Outcome deferred = dt::train(Stage::fsdp, true, sk::DType::f32, world, false);
  sk::Context ctx;
  const auto net = dt::resnet(ctx, 1, false);
  const auto model_bytes = net->parameter_count() * 4;
  const auto params = static_cast<std::int64_t>(net->named_parameters().size());
  // Eager: the module's own parameters, whole, beside the shards until they are bound, and the
  // unit being filled whole; every unit's values broadcast from rank 0.
  CHECK(eager.wrap_peak_over_steady >= model_bytes + eager.largest_unit_bytes);
  CHECK(eager.wrap_bus_bytes >= static_cast<std::uint64_t>(model_bytes));
  // Deferred: every rank makes rank 0's values of its own range from rank 0's recipes (one
  // broadcast of kRecipeBytes a parameter); no unit is ever whole, no parameter value travels:
  // what is sent is the recipes and the buffers (and the wrap's checks' few scalars).
  CHECK(deferred.wrap_peak_over_steady <= sk::parallel::MemoryPlan::kWrapScalarBytes +
                                              sk::parallel::MemoryPlan::kRecipeBytes * params);
  CHECK(deferred.wrap_peak_over_steady < deferred.largest_unit_bytes / 4);
  CHECK(deferred.wrap_bus_bytes <=
        static_cast<std::uint64_t>(sk::parallel::MemoryPlan::kRecipeBytes * params +
                                   deferred.buffer_bytes + 4096));
  // The planner's wrap figures bound both (parallel/memory_plan.hpp).
  CHECK(eager.plan.eager_build == model_bytes);
  CHECK(eager.plan.wrap_transient ==
        deferred.largest_unit_bytes + sk::parallel::MemoryPlan::kWrapScalarBytes);
  CHECK(eager.wrap_peak_over_steady <= eager.plan.wrap_transient + eager.plan.eager_build);
  CHECK(deferred.wrap_peak_over_steady <= deferred.plan.deferred_transient);
  CHECK(deferred.plan.deferred_transient == sk::parallel::MemoryPlan::kWrapScalarBytes +
                                                sk::parallel::MemoryPlan::kRecipeBytes * params);
  MESSAGE("fsdp wrap, N=4: transient eager ", eager.wrap_peak_over_steady, " B, deferred ",
          deferred.wrap_peak_over_steady, " B; sent eager ", eager.wrap_bus_bytes, " B, deferred ",
          deferred.wrap_bus_bytes, " B; model ", model_bytes, " B, largest unit ",
          deferred.largest_unit_bytes, " B");
}

namespace deferred_test {

// A parameter that is a view of part of a deferred tensor (here its transpose): no recipe
// describes it alone, so the wrap makes its tensor whole first.
class TransposedLinear : public nn::Module {
 public:
  explicit TransposedLinear(sk::Context& ctx) {
    const sk::Tensor stored =
        sk::empty(ctx, {3, 5}, sk::DType::f32, sk::MemoryCategory::parameters);
    sk::uniform_(ctx, stored, -1.0, 1.0);
    weight = register_parameter("weight", stored.transpose(0, 1));
    bias = register_parameter("bias",
                              sk::zeros(ctx, {3}, sk::DType::f32, sk::MemoryCategory::parameters));
  }
  const char* type_name() const override { return "TransposedLinear"; }
  ag::Variable forward(sk::Context& ctx, const ag::Variable& x) override {
    return ag::linear(ctx, x, weight, bias);
  }
  ag::Variable weight, bias;
};

}  // namespace deferred_test

TEST_CASE("deferred parameters: a view of part of a deferred tensor is made whole at the wrap") {
  for (const Stage stage : {Stage::ddp, Stage::fsdp}) {
    std::vector<float> values[2];
    for (const bool deferred : {false, true})
      sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        ctx.manual_seed(9);
        std::shared_ptr<dt::TransposedLinear> net;
        {
          std::optional<sk::DeferredParameters> scope;
          if (deferred) scope.emplace(ctx);
          net = std::make_shared<dt::TransposedLinear>(ctx);
        }
        sk::parallel::ParallelOptions options;
        options.stage = stage;
        sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                          options);
        auto full = model.full_params();  // (collective: fsdp gathers every unit)
        if (comm.rank() == 0) values[deferred] = module_values(ctx, *net);
      });
    CHECK(values[0].size() == 18);
    CHECK_MESSAGE(dp_test::bitwise_equal(values[1], values[0]), sk::parallel::stage_name(stage));
  }
}

TEST_CASE("deferred parameters: wrapping inside the scope is refused") {
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = dt::resnet(ctx, 3, true);
    sk::DeferredParameters scope(ctx);
    CHECK_THROWS_WITH_AS(
        sk::parallel::ShardedModule(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd)),
        doctest::Contains("inside a DeferredParameters scope"), sk::StateError);
  });
}
