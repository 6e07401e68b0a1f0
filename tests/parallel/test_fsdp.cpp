// FSDP (ZeRO-3) against DDP over the local communicator: the same model, batches and optimizer
// give bitwise the same parameters and buffers after training, for MLPs and a small ResNet-18,
// any unit split, checkpointing, resharding on or off, prefetch depths, accumulation both ways
// and frozen parameters; memory per rank follows the ZeRO-3 formula; bad input is named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace module_test;
using sk::optim::OptimizerKind;
using sk::parallel::Stage;

namespace {

enum class Model { mlp, resnet };
enum class Accumulation { none, no_sync, sharded };

struct Run {
  Model model = Model::mlp;
  OptimizerKind kind = OptimizerKind::sgd;
  int world = 2;
  int steps = 20;
  int checkpoint_segments = 0;
  Accumulation accumulation = Accumulation::none;
  double clip = 0;  // clip_grad_norm's max_norm before each step (0: none)
  sk::parallel::FsdpOptions fsdp;
  int unit_family = 1;  // the most units of a family: a unit, those inside it, those around it
};

float lr_at(OptimizerKind kind, int step) {
  return (kind == OptimizerKind::larc_sgd ? 0.5f : 0.05f) *
         (1.0f - 0.02f * static_cast<float>(step));
}

struct Outcome {
  std::vector<float> values;  // rank 0: parameters then f32 buffers
  int max_gathered = 0;
  sk::MemorySnapshot memory;                 // rank 0 after the last step
  std::vector<sk::MemorySnapshot> memories;  // every rank's after the last step
  std::vector<double> norms;                 // rank 0: clip_grad_norm's result per step
  std::uint64_t reduce_scatters = 0;         // rank 0: reduce_scatter_v collectives over the run
  std::uint64_t gather_bytes = 0;            // rank 0: all_gather_v payload bytes over the run
  std::uint64_t grad_bytes = 0;  // rank 0: reduce_scatter_v + all_to_all_v (qgZ) payload bytes
  double final_loss = 0;         // rank 0: the trained model's loss on a batch of its own
};

Outcome train(Stage stage, const Run& run) {
  Outcome out;
  out.memories.resize(static_cast<std::size_t>(run.world));
  sk::comm::run_ranks(run.world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto seed = 300 + static_cast<std::uint64_t>(comm.rank());
    std::shared_ptr<nn::Sequential> net;
    if (run.model == Model::mlp)
      net = mlp(ctx, seed);
    else
      net = small_resnet(ctx, seed);
    net->set_checkpoint_segments(run.checkpoint_segments);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 4096;
    options.fsdp = run.fsdp;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(run.kind), options);
    const sk::Shape shape = run.model == Model::mlp ? sk::Shape{6, 12} : sk::Shape{3, 3, 8, 8};
    const std::int64_t classes = run.model == Model::mlp ? 7 : 5;
    const int micro_batches = run.accumulation == Accumulation::none ? 1 : 2;
    for (int s = 0; s < run.steps; ++s) {
      model.zero_grad();
      for (int m = 0; m < micro_batches; ++m) {
        auto b = batch(ctx, shape, classes, comm.rank(), s * 2 + m);
        const bool local = run.accumulation == Accumulation::no_sync && m + 1 < micro_batches;
        if (local) {
          auto scope = model.no_sync();
          ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
        } else {
          ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
        }
      }
      if (run.clip > 0) {
        const sk::Tensor norm = model.clip_grad_norm(run.clip);
        if (comm.rank() == 0) out.norms.push_back(sk::to_vector<double>(ctx, norm)[0]);
      }
      model.step(lr_at(run.kind, s));
    }
    out.memories[static_cast<std::size_t>(comm.rank())] = ctx.memory_stats().snapshot();
    if (comm.rank() == 0) out.memory = out.memories[0];
    if (comm.rank() == 0)
      out.reduce_scatters = comm.stats().of(sk::comm::CollectiveKind::reduce_scatter_v).calls;
    if (comm.rank() == 0)
      out.gather_bytes = comm.stats().of(sk::comm::CollectiveKind::all_gather_v).payload_bytes;
    if (comm.rank() == 0)
      out.grad_bytes = comm.stats().of(sk::comm::CollectiveKind::reduce_scatter_v).payload_bytes +
                       comm.stats().of(sk::comm::CollectiveKind::all_to_all_v).payload_bytes;
    if (comm.rank() == 0 && stage == Stage::fsdp)
      out.max_gathered = model.max_gathered_units();  // (before gathering everything)
    {  // (after the memory and gather counts: a forward without its backward keeps the root)
      auto b = batch(ctx, shape, classes, comm.rank(), 1000);  // not a training batch
      const double loss =
          sk::to_vector<float>(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels).data())[0];
      if (comm.rank() == 0) out.final_loss = loss;
    }
    std::vector<float> values;
    if (stage == Stage::fsdp) {
      auto full = model.full_params();  // collective: every rank gathers
      values = module_values(ctx, *net);
    } else {
      values = module_values(ctx, *net);
    }
    if (comm.rank() != 0) return;
    out.values = std::move(values);
  });
  return out;
}

std::string describe(const Run& run) {
  return std::string(run.model == Model::mlp ? "mlp" : "resnet18") + " " +
         std::string(sk::optim::optimizer_kind_name(run.kind)) + " N=" + std::to_string(run.world) +
         " segments=" + std::to_string(run.checkpoint_segments) +
         " reshard=" + std::to_string(run.fsdp.reshard_after_forward) +
         " prefetch=" + std::to_string(run.fsdp.prefetch) +
         " accumulation=" + std::to_string(static_cast<int>(run.accumulation)) +
         " clip=" + std::to_string(run.clip);
}

void check_matches_ddp(const Run& run) {
  Run ddp_run = run;
  ddp_run.fsdp.reshard_group_size = 0;  // (an fsdp option)
  // DDP's counterpart of sharded accumulation: two synchronised backwards (A + avg(g)).
  const auto ddp = train(Stage::ddp, ddp_run);
  const auto fsdp = train(Stage::fsdp, run);
  // LARC too: its per-parameter norms have the same bits whatever the split.
  CHECK_MESSAGE(dp_test::bitwise_equal(fsdp.values, ddp.values), describe(run));
  CHECK_MESSAGE(fsdp.norms == ddp.norms, describe(run));  // (bitwise: doubles compared exactly)
  // Resharding after forward bounds the units gathered at once (the root unit aside): the
  // computing unit's family of nested units (memory_plan.hpp's unit_family), and what is
  // prefetched.
  if (run.fsdp.reshard_after_forward)
    CHECK_MESSAGE(fsdp.max_gathered <= run.fsdp.prefetch + run.unit_family, describe(run),
                  " gathered ", fsdp.max_gathered);
}

// The largest |parameter| of a run, and the largest difference of a run's parameters from it.
double largest_value(const Outcome& run) {
  double largest = 0;
  for (const float v : run.values) largest = std::max(largest, std::fabs(double(v)));
  return largest;
}
double worst_difference(const Outcome& run, const Outcome& exact) {
  double worst = 0;
  for (std::size_t i = 0; i < exact.values.size(); ++i)
    worst = std::max(worst, std::fabs(double(run.values[i]) - exact.values[i]));
  return worst;
}

sk::parallel::FsdpOptions mlp_units() {
  sk::parallel::FsdpOptions o;
  o.wrap.unit_paths = {"0", "3"};  // the root unit keeps batch-norm and the last linear
  return o;
}

// The MLP in mlp_units() trained under fsdp exactly, and again after `compress` changed its
// options: the compressed run's description, the exact outcome, the compressed one.
struct CompressedPair {
  Run run;
  Outcome exact, compressed;
};
template <class Compress>
CompressedPair exact_and_compressed(OptimizerKind kind, int world, Compress&& compress) {
  CompressedPair out;
  out.run.kind = kind;
  out.run.world = world;
  out.run.fsdp = mlp_units();
  out.exact = train(Stage::fsdp, out.run);
  compress(out.run.fsdp);
  out.compressed = train(Stage::fsdp, out.run);
  return out;
}

}  // namespace

TEST_CASE("FSDP equals DDP bitwise on an MLP: optimizers, world sizes, unit splits") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (int world : {1, 2, 3, 4, 8}) {
      Run run;
      run.kind = kind;
      run.world = world;
      run.fsdp = mlp_units();
      check_matches_ddp(run);
    }
  }
  Run by_size;
  by_size.world = 3;
  by_size.fsdp.wrap.min_num_params = 200;  // wraps "0" (520) and "3" (943, its bias frozen)
  check_matches_ddp(by_size);
  Run root_only;
  root_only.world = 4;
  check_matches_ddp(root_only);
}

TEST_CASE("FSDP equals DDP bitwise: checkpointing, resharding, prefetch, accumulation") {
  for (int segments : {0, 2}) {
    for (bool reshard : {true, false}) {
      for (int prefetch : {0, 2}) {
        Run run;
        run.world = 3;
        run.steps = 8;
        run.checkpoint_segments = segments;
        run.fsdp = mlp_units();
        run.fsdp.reshard_after_forward = reshard;
        run.fsdp.prefetch = prefetch;
        check_matches_ddp(run);
      }
    }
  }
  for (auto accumulation : {Accumulation::no_sync, Accumulation::sharded}) {
    Run run;
    run.world = 4;
    run.steps = 8;
    run.kind = OptimizerKind::adamw;
    run.accumulation = accumulation;
    run.fsdp = mlp_units();
    check_matches_ddp(run);
  }
  // Inside no_sync nothing is reduced: a step of two micro-batches reduce-scatters as often as
  // a step of one backward, and accumulating sharded (every backward synchronised) twice as often.
  Run once;
  once.world = 4;
  once.steps = 3;
  once.kind = OptimizerKind::adamw;
  once.fsdp = mlp_units();
  Run local = once, sharded = once;
  local.accumulation = Accumulation::no_sync;
  sharded.accumulation = Accumulation::sharded;
  const auto plain = train(Stage::fsdp, once).reduce_scatters;
  CHECK(plain > 0);
  CHECK(train(Stage::fsdp, local).reduce_scatters == plain);
  CHECK(train(Stage::fsdp, sharded).reduce_scatters == 2 * plain);
}

// hpZ: after a training forward each rank keeps its slice of a unit over its node, and the
// backward gathers inside the node. The values are the forward's, so the bits are DDP's --
// with checkpointing's recomputed forwards, prefetch and accumulation too -- and under qwZ the
// same as qwZ's without hpZ (the backward computes with the forward's dequantised values, which
// a second quantised gather of the same shards reproduces); only the world's gathers shrink.
TEST_CASE("hpZ: FSDP with the backward's gathers inside a node equals DDP bitwise") {
  for (const auto& [world, node] : {std::pair{4, 2}, std::pair{6, 3}, std::pair{4, 4}})
    for (int segments : {0, 2}) {
      Run run;
      run.world = world;
      run.steps = 6;
      run.kind = OptimizerKind::adamw;
      run.checkpoint_segments = segments;
      run.fsdp = mlp_units();
      run.fsdp.prefetch = segments == 0 ? 1 : 2;
      run.fsdp.reshard_group_size = node;
      CAPTURE(node);
      check_matches_ddp(run);
      Run plain = run;
      plain.fsdp.reshard_group_size = 0;
      const auto everywhere = train(Stage::fsdp, plain);
      const auto in_node = train(Stage::fsdp, run);
      CHECK(in_node.gather_bytes < everywhere.gather_bytes);  // the backward's left the world
      if (segments > 0) {
        // A segment's first forward (without grad) keeps the slices too: its recomputation and
        // its backward gather inside the node, so the world sees the forward's gathers alone,
        // as without checkpointing.
        Run whole = run;
        whole.checkpoint_segments = 0;
        CHECK(in_node.gather_bytes == train(Stage::fsdp, whole).gather_bytes);
      }
      run.fsdp.quantized_weights = true;
      plain.fsdp.quantized_weights = true;
      CHECK(
          dp_test::bitwise_equal(train(Stage::fsdp, run).values, train(Stage::fsdp, plain).values));
    }
  // Prefetching changes when units are gathered, never which: the backward's prefetch skips a
  // unit whose backward is over (the root unit, once the head's gradients are in), which it
  // used to gather again over the world for nothing.
  for (int node : {0, 2}) {
    Run eager;
    eager.world = 4;
    eager.steps = 3;
    eager.fsdp = mlp_units();
    eager.fsdp.reshard_group_size = node;
    eager.fsdp.prefetch = 0;
    Run ahead = eager;
    ahead.fsdp.prefetch = 2;
    CAPTURE(node);
    CHECK(train(Stage::fsdp, ahead).gather_bytes == train(Stage::fsdp, eager).gather_bytes);
  }
  Run accumulate;
  accumulate.world = 4;
  accumulate.steps = 4;
  accumulate.accumulation = Accumulation::sharded;
  accumulate.fsdp = mlp_units();
  accumulate.fsdp.reshard_group_size = 2;
  check_matches_ddp(accumulate);
}

TEST_CASE("hpZ: refused outside fsdp, without resharding, under hybrid, and off the world's size") {
  sk::parallel::ParallelOptions options;
  options.fsdp.reshard_group_size = 2;
  options.stage = Stage::sdp;
  CHECK_THROWS_WITH(sk::parallel::resolve(options), doctest::Contains("use Stage::fsdp"));
  options.stage = Stage::fsdp;
  options.fsdp.reshard_after_forward = false;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("but reshard_after_forward is false"));
  options.fsdp.reshard_after_forward = true;
  options.fsdp.reshard_group_size = 1;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.reshard_group_size is 1; pass the ranks of a node"));
  options.fsdp.reshard_group_size = 2;
  CHECK_THROWS_WITH(sk::comm::run_ranks(3,
                                        [&](sk::Context& ctx, sk::comm::Communicator& comm) {
                                          sk::parallel::FsdpEngine engine(
                                              ctx, comm, {{"unit", {{"w", {10}, true}}}},
                                              dp_test::config_for(OptimizerKind::sgd), options);
                                        }),
                    doctest::Contains("fsdp.reshard_group_size is 2 but the world has 3 ranks"));
}

TEST_CASE("small units' reduce-scatters travel together: the same bits, fewer collectives") {
  Run run;
  run.world = 3;
  run.steps = 5;
  run.kind = OptimizerKind::adamw;
  run.fsdp = mlp_units();  // three units of one 4 KiB bucket each
  run.fsdp.coalesce_bytes = 0;
  const auto alone = train(Stage::fsdp, run);
  run.fsdp.coalesce_bytes = sk::parallel::kDefaultCoalesceBytes;
  const auto together = train(Stage::fsdp, run);
  CHECK(dp_test::bitwise_equal(together.values, alone.values));
  CHECK(alone.reduce_scatters == 3 * 5);
  CHECK(together.reduce_scatters == 5);  // one per backward
  check_matches_ddp(run);
}

namespace {

// One plain-SGD step of `model` at `lr` (no momentum, no decay): the largest relative distance
// of a parameter from before - lr * coefficient * g (its gradient before the step).
double sgd_step_error(sk::Context& ctx, sk::parallel::ShardedModule& model, float lr,
                      double coefficient) {
  std::vector<std::vector<float>> grads, before;
  for (const auto& g : model.engine().piece_grads()) grads.push_back(sk::to_vector<float>(ctx, g));
  for (const auto& p : model.engine().optimizer().piece_params())
    before.push_back(sk::to_vector<float>(ctx, p));
  model.step(lr);
  double worst = 0;
  for (std::size_t k = 0; k < grads.size(); ++k) {
    const auto after = sk::to_vector<float>(ctx, model.engine().optimizer().piece_params()[k]);
    for (std::size_t i = 0; i < after.size(); ++i) {
      const double want = before[k][i] - lr * coefficient * grads[k][i];
      worst = std::max(worst, std::abs(after[i] - want) / (std::abs(want) + 1e-3));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("clip_grad_norm: the same norm and the same clipped steps under every stage") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd}) {
    Run run;
    run.kind = kind;
    run.world = 3;
    run.steps = 6;
    run.clip = 0.2;  // below the gradients' norms here: every step is clipped
    run.fsdp = mlp_units();
    check_matches_ddp(run);
    const auto clipped = train(Stage::fsdp, run);
    for (double norm : clipped.norms) CHECK(norm > run.clip);
    Run plain = run;
    plain.clip = 0;
    CHECK_FALSE(dp_test::bitwise_equal(train(Stage::fsdp, plain).values, clipped.values));
    for (auto stage : {Stage::oss, Stage::sdp}) CHECK(train(stage, run).norms == clipped.norms);
  }
  // The norm itself: one rank's gradients against a float64 sum, before the step.
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 5);
    sk::parallel::ParallelOptions options;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    auto b = batch(ctx, {6, 12}, 7, 0, 0);
    ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    double exact = 0;
    for (const auto& g : model.engine().piece_grads())  // ddp: every parameter whole
      for (float v : sk::to_vector<float>(ctx, g)) exact += double(v) * v;
    const double norm = sk::to_vector<double>(ctx, model.clip_grad_norm(1e9))[0];
    CHECK(std::abs(norm - std::sqrt(exact)) <= 1e-12 * std::sqrt(exact));
    CHECK_THROWS_WITH(model.clip_grad_norm(0), doctest::Contains("max_norm must be > 0"));
  });
  // The coefficient reaches the fused pass (through the step gate, on the device): plain SGD
  // moves every parameter by -lr · max_norm / (norm + 1e-6) · g.
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 5);
    sk::optim::OptimizerConfig config;  // SGD without momentum or decay
    sk::parallel::ShardedModule model(ctx, comm, net, config, sk::parallel::ParallelOptions{});
    auto b = batch(ctx, {6, 12}, 7, 0, 0);
    ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    const double max_norm = 0.25;
    const double norm = sk::to_vector<double>(ctx, model.clip_grad_norm(max_norm))[0];
    REQUIRE(norm > 2 * max_norm);
    const double coefficient = max_norm / (norm + 1e-6);
    CHECK(sgd_step_error(ctx, model, 0.1f, coefficient) <= 1e-6);
  });
}

// A clip waits for the step: a second clip_grad_norm keeps the smaller max_norm (PyTorch's second
// clip of clipped gradients, within its 1e-6), and zero_grad forgets it with the gradients --
// before, the second call replaced the first (a log of the norm at max_norm = inf unclipped the
// step), and a clip of a skipped batch carried into the next one's step.
TEST_CASE("clip_grad_norm: a second call keeps the tighter clip; zero_grad forgets a clip") {
  for (const bool skip_batch : {false, true}) {
    sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, 5);
      sk::optim::OptimizerConfig config;  // SGD without momentum or decay
      sk::parallel::ShardedModule model(ctx, comm, net, config, sk::parallel::ParallelOptions{});
      auto b = batch(ctx, {6, 12}, 7, 0, 0);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      const double norm = sk::to_vector<double>(ctx, model.clip_grad_norm(0.25))[0];
      REQUIRE(norm > 0.5);
      double coefficient = 0.25 / (norm + 1e-6);
      if (skip_batch) {  // the batch dropped after its clip; the same batch again, unclipped
        model.zero_grad();
        ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
        coefficient = 1.0;
      } else {
        CHECK(sk::to_vector<double>(ctx, model.clip_grad_norm(1e9))[0] == norm);
      }
      CAPTURE(skip_batch);
      CHECK(sgd_step_error(ctx, model, 0.1f, coefficient) <= 1e-6);
    });
  }
}

TEST_CASE("FSDP equals DDP bitwise on a small ResNet-18 with batch-norm, one unit per block") {
  sk::parallel::FsdpOptions blocks;
  for (int layer = 1; layer <= 4; ++layer)
    for (int b = 0; b < 2; ++b)
      blocks.wrap.unit_paths.push_back("layer" + std::to_string(layer) + "." + std::to_string(b));
  for (int segments : {0, 3}) {
    Run run;
    run.model = Model::resnet;
    run.world = 2;
    run.steps = 4;
    run.checkpoint_segments = segments;
    run.fsdp = blocks;
    run.fsdp.prefetch = 1;
    check_matches_ddp(run);
  }
}

// VISSL's AUTO_WRAP_THRESHOLD: a block's large convolutions become units of their own inside
// the block's unit. The inner unit is gathered and freed inside the outer one's forward and
// backward, recomputation included; the bits stay DDP's.
TEST_CASE("FSDP equals DDP bitwise with units nested in units (a block's convolutions)") {
  sk::parallel::FsdpOptions nested;
  for (int layer = 1; layer <= 4; ++layer)
    for (int b = 0; b < 2; ++b) {
      const std::string block = "layer" + std::to_string(layer) + "." + std::to_string(b);
      nested.wrap.unit_paths.push_back(block);
      nested.wrap.unit_paths.push_back(block + ".conv2");
      if (layer > 1 && b == 0) nested.wrap.unit_paths.push_back(block + ".downsample.0");
    }
  // (the planner's family: a block of layers 2-4's first, its convolution and its projection)
  int family = 0;
  {
    sk::Context ctx;
    auto net = small_resnet(ctx, 1);
    sk::parallel::PlannedRun planned;
    planned.parallel.stage = Stage::fsdp;
    planned.parallel.fsdp = nested;
    planned.world_size = 3;
    family = sk::parallel::module_planned_run(*net, planned).unit_family;
  }
  CHECK(family == 3);
  for (int segments : {0, 3})
    for (int prefetch : {0, 1}) {
      Run run;
      run.model = Model::resnet;
      run.world = 3;
      run.steps = 4;
      run.checkpoint_segments = segments;
      run.fsdp = nested;
      run.fsdp.prefetch = prefetch;
      run.unit_family = family;
      check_matches_ddp(run);
    }
}

TEST_CASE("FSDP model state per rank follows the ZeRO-3 formula (plus padding)") {
  // AdamW: k = 8 bytes of state per parameter. Each unit's flat parameter is padded to a
  // multiple of N x 16 elements; frozen parameters stay whole.
  for (int world : {2, 4}) {
    Run run;
    run.kind = OptimizerKind::adamw;
    run.world = world;
    run.steps = 2;
    run.fsdp = mlp_units();
    const auto fsdp = train(Stage::fsdp, run);
    sk::Context ctx;
    auto net = mlp(ctx, 1);
    double psi = 0, frozen = 0;
    for (auto& p : net->parameters())
      (p.requires_grad() ? psi : frozen) += static_cast<double>(p.numel());
    const double formula = sk::parallel::zero_model_state_bytes(Stage::fsdp, psi, 8, world);
    // The module's own buffers (batch-norm statistics) count as parameters too.
    double buffers = 0;
    for (auto& [name, b] : net->named_buffers()) buffers += static_cast<double>(b.nbytes());
    const double padding = 3.0 /*units*/ * 16 * world * (4 + 4 + 8);
    REQUIRE(fsdp.memories.size() == static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) {  // (every rank: the last holds the padding)
      CAPTURE(r);
      const auto& m = fsdp.memories[static_cast<std::size_t>(r)];
      const double model_state =
          static_cast<double>(m.current_of(sk::MemoryCategory::parameters) +
                              m.current_of(sk::MemoryCategory::gradients) +
                              m.current_of(sk::MemoryCategory::optimizer_state)) -
          4 * frozen;
      CHECK(model_state - buffers >= formula);
      CHECK(model_state - buffers <= formula + padding);
      CHECK(m.current_of(sk::MemoryCategory::communication) == 0);  // nothing left gathered
    }
  }
}

TEST_CASE(
    "FSDP bad input: tied weights, a policy that wraps nothing, unknown units, use outside the "
    "gathered window") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto config = dp_test::config_for(OptimizerKind::sgd);
    sk::parallel::ParallelOptions options;
    options.stage = Stage::fsdp;
    {
      auto net = mlp(ctx, 1);
      options.fsdp.wrap.min_num_params = 100000;
      CHECK_THROWS_WITH(sk::parallel::ShardedModule(ctx, comm, net, config, options),
                        doctest::Contains("min_num_params = 100000 wraps no module: the largest "
                                          "sub-module has 943 parameters"));
      options.fsdp.wrap.min_num_params = 0;
      options.fsdp.wrap.unit_paths = {"7"};
      CHECK_THROWS_WITH(sk::parallel::ShardedModule(ctx, comm, net, config, options),
                        doctest::Contains("FSDP unit '7' names no module of the model"));
      options.fsdp.wrap.unit_paths = {"0"};
    }
    {
      // Tied weights: a second parameter over the first one's memory.
      struct Tied : nn::Module {
        ag::Variable encoder, decoder;
        explicit Tied(sk::Context& c) {
          encoder = register_parameter("encoder", sk::full(c, {4, 4}, sk::DType::f32, 0.5));
          decoder = register_parameter("decoder", encoder.data());
        }
        const char* type_name() const override { return "Tied"; }
        ag::Variable forward(sk::Context& c, const ag::Variable& x) override {
          return ag::linear(c, ag::linear(c, x, encoder), decoder);
        }
      };
      auto tied = std::make_shared<Tied>(ctx);
      sk::parallel::ParallelOptions plain;
      plain.stage = Stage::fsdp;
      CHECK_THROWS_WITH(
          sk::parallel::ShardedModule(ctx, comm, tied, config, plain),
          doctest::Contains("parameters 'encoder' and 'decoder' share memory (tied weights)"));
    }
    {
      auto net = mlp(ctx, 1);
      sk::parallel::ShardedModule model(ctx, comm, net, config, options);
      auto& weight = dynamic_cast<nn::Linear&>(net->at(0)).weight;
      CHECK_THROWS_WITH_AS((void)sk::to_vector<float>(ctx, weight.data()),
                           doctest::Contains("the parameters of FSDP unit '0' are not gathered"),
                           sk::StateError);
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(0.1f);
      {
        auto full = model.full_params();
        CHECK(sk::to_vector<float>(ctx, weight.data()).size() == 12 * 40);
      }
    }
  });
  // A module tree that differs between ranks is refused before any unit's collective.
  CHECK_THROWS_WITH(sk::comm::run_ranks(2,
                                        [&](sk::Context& ctx, sk::comm::Communicator& comm) {
                                          auto net = mlp(ctx, 1, /*with_frozen=*/comm.rank() == 0);
                                          sk::parallel::ParallelOptions options;
                                          options.stage = Stage::fsdp;
                                          options.fsdp.wrap.unit_paths = {"0"};
                                          sk::parallel::ShardedModule model(
                                              ctx, comm, net,
                                              dp_test::config_for(OptimizerKind::sgd), options);
                                        }),
                    doctest::Contains("module tree or its FSDP units differ between ranks"));
}

// A parameter some ranks use and others do not: unreached, it counts as a zero gradient marked
// at the backward's start (DDP's find_unused_parameters), so its unit's reduction comes in the
// same place on every rank. Marked at the backward's end, the root unit (`second` and `extra`)
// reduced before unit `first` on rank 0 and after it on rank 1, and the coalesced reduce-scatter
// summed one unit's gradients into the other's: parameters unlike DDP's, without an error.
TEST_CASE("FSDP: a parameter unused on some ranks trains as under DDP") {
  struct Branchy : nn::Module {
    std::shared_ptr<nn::Linear> first, second;
    ag::Variable extra;
    bool use_extra = false;
    explicit Branchy(sk::Context& c) {
      first = register_module("first", std::make_shared<nn::Linear>(c, 12, 16));
      second = register_module("second", std::make_shared<nn::Linear>(c, 16, 7));
      extra = register_parameter("extra", sk::empty(c, {7, 7}, sk::DType::f32));
      fill_uniform(c, *this, 77, 0.4);
    }
    const char* type_name() const override { return "Branchy"; }
    ag::Variable forward(sk::Context& c, const ag::Variable& x) override {
      ag::Variable y = (*second)(c, (*first)(c, x));
      return use_extra ? ag::linear(c, y, extra) : y;
    }
  };
  auto train_on = [](Stage stage, std::size_t coalesce_bytes) {
    std::vector<float> out;
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = std::make_shared<Branchy>(ctx);
      net->use_extra = comm.rank() == 0;
      sk::parallel::ParallelOptions options;
      options.stage = stage;
      options.fsdp.wrap.unit_paths = {"first"};
      options.fsdp.coalesce_bytes = coalesce_bytes;
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                        options);
      for (int s = 0; s < 3; ++s) {
        model.zero_grad();
        auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
        ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
        model.step(0.1f);
      }
      auto full = model.full_params();
      if (comm.rank() == 1)
        for (auto& p : net->parameters()) {
          const auto v = sk::to_vector<float>(ctx, p.data());
          out.insert(out.end(), v.begin(), v.end());
        }
    });
    return out;
  };
  const auto ddp = train_on(Stage::ddp, 0);
  for (std::size_t coalesce : {std::size_t{1} << 22, std::size_t{0}}) {
    CAPTURE(coalesce);
    const auto fsdp = train_on(Stage::fsdp, coalesce);
    REQUIRE(fsdp.size() == ddp.size());
    double worst = 0;
    for (std::size_t i = 0; i < ddp.size(); ++i)
      worst = std::max(worst, double(std::abs(fsdp[i] - ddp[i])));
    CHECK(worst <= 1e-6);
  }
}

// A whole unit whose output reaches the loss on some ranks only: where it is not reached, its
// gradients (zeros) are marked at the backward's start and its reduction goes out before the
// units the backward reaches first; elsewhere in its turn. Coalesced, the two ranks' batches held
// the same bytes from the units in another order, and the reduction summed one unit's gradients
// into the other's without a word. The coalesced launch now carries its units' labels, so the
// order check refuses it naming both (as it refuses separate launches by their labels).
TEST_CASE("FSDP: a unit the loss reaches on some ranks only is refused by the order check") {
  struct TwoHeads : nn::Module {
    std::shared_ptr<nn::Linear> first, aux, second;
    bool use_aux = false;
    explicit TwoHeads(sk::Context& c) {
      first = register_module("first", std::make_shared<nn::Linear>(c, 12, 16));
      aux = register_module("aux", std::make_shared<nn::Linear>(c, 16, 7));
      second = register_module("second", std::make_shared<nn::Linear>(c, 16, 7));
      fill_uniform(c, *this, 78, 0.4);
    }
    const char* type_name() const override { return "TwoHeads"; }
    ag::Variable forward(sk::Context& c, const ag::Variable& x) override {
      const ag::Variable h = (*first)(c, x);
      // (every rank runs it, so the gathers agree; first, so that where it is reached its
      // gradients come after the root's)
      const ag::Variable a = (*aux)(c, h);
      const ag::Variable y = (*second)(c, h);
      return use_aux ? ag::add(c, y, a) : y;
    }
  };
  for (const std::size_t coalesce : {std::size_t{1} << 22, std::size_t{0}}) {
    CAPTURE(coalesce);
    sk::comm::RunRanksOptions run;
    run.comm.validate_order = true;
    std::string message;
    try {
      sk::comm::run_ranks(
          2,
          [&](sk::Context& ctx, sk::comm::Communicator& comm) {
            auto net = std::make_shared<TwoHeads>(ctx);
            net->use_aux = comm.rank() == 0;
            sk::parallel::ParallelOptions options;
            options.stage = Stage::fsdp;
            options.fsdp.wrap.unit_paths = {"first", "aux"};
            options.fsdp.reshard_after_forward = false;  // (no gather in the backward to differ)
            options.fsdp.coalesce_bytes = coalesce;
            sk::parallel::ShardedModule model(ctx, comm, net,
                                              dp_test::config_for(OptimizerKind::sgd), options);
            model.zero_grad();
            auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
            ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
            model.step(0.1f);
          },
          run);
    } catch (const std::exception& e) {
      message = e.what();
    }
    CAPTURE(message);
    CHECK(message.find("unit 'aux': gradient reduction") != std::string::npos);
    CHECK(message.find("every rank must issue the same collectives in the same order") !=
          std::string::npos);
  }
}

// qwZ: the parameters' gathers carry int8 (or E4M3, or int4) blocks. Training follows exact FSDP
// closely (the shards and the optimizer stay exact; only what a forward and backward compute with
// is quantised) on about a quarter of the gather bytes.
TEST_CASE("qwZ: FSDP with int8, E4M3 or int4 parameter gathers trains close to exact FSDP") {
  for (auto format :
       {sk::ops::QuantFormat::int8, sk::ops::QuantFormat::f8_e4m3, sk::ops::QuantFormat::int4})
    for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw})
      for (int world : {2, 3}) {
        const auto [run, exact, quantized] =
            exact_and_compressed(kind, world, [&](sk::parallel::FsdpOptions& o) {
              o.quantized_weights = true;
              o.quantized_weights_format = format;
            });
        CAPTURE(sk::ops::quant_format_name(format));
        CAPTURE(describe(run));
        CHECK(!dp_test::bitwise_equal(quantized.values, exact.values));  // quantised, really
        const double largest = largest_value(exact), worst = worst_difference(quantized, exact);
        CHECK(std::isfinite(worst));
        // SGD moves each parameter by its gradient, so the parameters stay close (1.1% of the
        // largest after 20 steps); Adam's step is about lr wherever a gradient is tiny, whatever
        // its size, so its parameters drift apart where gradients are near zero -- the loss is
        // what to compare there. E4M3 keeps 3 mantissa bits (an error up to 1/16 of each value,
        // where int8 keeps a block's large values to 1/254 of its largest), so its forwards
        // stray further: 2.2-2.4% of the largest parameter, the loss within 1.8%. int4's step is
        // 18 times int8's: 4.6-5.7% of the largest parameter, the loss within 1.5%.
        const bool f8 = format == sk::ops::QuantFormat::f8_e4m3;
        const bool int4 = format == sk::ops::QuantFormat::int4;
        if (kind == OptimizerKind::sgd) CHECK(worst <= (f8 ? 0.04 : int4 ? 0.07 : 0.02) * largest);
        CHECK(std::fabs(quantized.final_loss - exact.final_loss) <= (f8     ? 0.03
                                                                     : int4 ? 0.02
                                                                            : 0.01) *
                                                                        exact.final_loss);
        // int8 (int4: half of it) and a scale per 256 values, against f32; this MLP's small units
        // pay for the 16-byte padding of each rank's run too.
        const double ratio = double(quantized.gather_bytes) / double(exact.gather_bytes);
        CHECK(ratio > (int4 ? 0.125 : 0.25));
        CHECK(ratio < (int4 ? 0.15 : 0.28));
      }
}

// qgZ: the gradients' reduce-scatter as an all-to-all of int8 (or int4) blocks summed in f32 by
// the owner, with and without error feedback, alone and with qwZ: training follows exact FSDP
// closely on about a quarter (an eighth) of the gradient bytes.
TEST_CASE(
    "qgZ: FSDP with int8 or int4 gradient all-to-alls trains close to exact FSDP on 0.27x "
    "(0.14x) the bytes") {
  struct Variant {
    const char* name;
    bool error_feedback, weights;
    sk::ops::QuantFormat format = sk::ops::QuantFormat::int8;
  };
  for (const Variant v :
       {Variant{"qgZ", false, false}, Variant{"qgZ + error feedback", true, false},
        Variant{"qgZ + qwZ", false, true},
        Variant{"qgZ int4", false, false, sk::ops::QuantFormat::int4},
        Variant{"qgZ int4 + error feedback", true, false, sk::ops::QuantFormat::int4}})
    for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw})
      for (int world : {2, 3}) {
        const auto [run, exact, quantized] =
            exact_and_compressed(kind, world, [&](sk::parallel::FsdpOptions& o) {
              o.quantized_grads = true;
              o.quantized_grads_format = v.format;
              o.grad_error_feedback = v.error_feedback;
              o.quantized_weights = v.weights;
            });
        CAPTURE(v.name);
        CAPTURE(describe(run));
        CHECK(!dp_test::bitwise_equal(quantized.values, exact.values));  // quantised, really
        const double largest = largest_value(exact), worst = worst_difference(quantized, exact);
        CHECK(std::isfinite(worst));
        // SGD moves each parameter by its gradient: within 0.3% of the largest parameter after
        // 20 steps (1.2% with qwZ too). Adam divides each gradient by its running RMS, so a
        // gradient that its block's scale rounds to 0 or to one step moves its parameter by up to
        // lr either way: the parameters part (26-41% of the largest) while the loss stays within
        // 4% (measured: 2.02 -> 2.02-2.06, 2.15 -> 2.20-2.24 on this 7-class toy).
        // int4's step is 18 times int8's: SGD's parameters stay within 1.6% of the largest
        // (0.3-0.8% with error feedback), Adam's loss within 5.2% without feedback (2.15 ->
        // 2.04, lower on this toy) and 1% with it.
        const bool int4 = v.format == sk::ops::QuantFormat::int4;
        if (kind == OptimizerKind::sgd) CHECK(worst <= 0.02 * largest);
        const double loss_tolerance =
            kind == OptimizerKind::sgd ? 0.01 : (int4 && !v.error_feedback ? 0.06 : 0.05);
        CHECK(std::fabs(quantized.final_loss - exact.final_loss) <=
              loss_tolerance * exact.final_loss);
        // int8 (int4) and a scale per 256 values against f32, and each owner's run padded to
        // 16 bytes (this MLP's units are small).
        const double ratio = double(quantized.grad_bytes) / double(exact.grad_bytes);
        CHECK(ratio > (int4 ? 0.125 : 0.25));
        CHECK(ratio < (int4 ? 0.16 : 0.29));
        CHECK(quantized.reduce_scatters == 0);  // no exact reduce-scatter left
      }
}

TEST_CASE("qgZ: refused outside fsdp, and error feedback without it") {
  sk::parallel::ParallelOptions options;
  options.stage = Stage::fsdp;
  options.fsdp.grad_error_feedback = true;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.quantized_grads is off; turn quantized_grads on"));
  options.fsdp.quantized_grads = true;
  CHECK(sk::parallel::resolve(options).buckets.quantized_block == sk::ops::kDefaultQuantBlock);
  CHECK(sk::parallel::resolve(options).buckets.error_feedback);
  options.fsdp.quantization_block = 0;  // (checked for qgZ alone too)
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.quantization_block is 0"));
  options.fsdp.quantization_block = 255;  // int4: two codes a byte, so an even block
  options.fsdp.quantized_grads_format = sk::ops::QuantFormat::int4;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.quantization_block is 255 with "
                                      "fsdp.quantized_grads_format int4"));
  options.fsdp.quantization_block = 256;
  CHECK(sk::parallel::resolve(options).buckets.quantized_format == sk::ops::QuantFormat::int4);
  options.stage = Stage::sdp;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("quantises fsdp's (ZeRO-3's) gradient reduce-scatter; "
                                      "stage sdp"));
}

// A unit gathered for a step holds each rank's shard quantised and dequantised (ops/quantize.hpp,
// bit for bit), on every rank alike; full_params() and state_dict() see the exact shards, also
// while a quantised gather is held, and writing through full_params() keeps them exact.
TEST_CASE("qwZ: a gathered unit holds every shard through its blocks; full_params is exact") {
  const std::vector<sk::shard::ParamSpec> specs = {
      {"a", {300}, true}, {"b", {7, 50}, true}, {"c", {1000}, true}};
  const std::int64_t block = 64;
  for (auto format : {sk::ops::QuantFormat::int8, sk::ops::QuantFormat::f8_e4m3})
    sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      CAPTURE(sk::ops::quant_format_name(format));
      sk::parallel::ParallelOptions options;
      options.stage = Stage::fsdp;
      options.fsdp.quantized_weights = true;
      options.fsdp.quantized_weights_format = format;
      options.fsdp.quantization_block = block;
      sk::parallel::FsdpEngine engine(ctx, comm, {sk::parallel::FsdpUnitParams{"unit", specs}},
                                      dp_test::config_for(OptimizerKind::sgd), options);
      engine.set_full_params([&](std::size_t i, const sk::Tensor& view) {
        std::vector<float> v(static_cast<std::size_t>(view.numel()));
        std::mt19937 gen(static_cast<std::uint32_t>(40 + i));
        std::normal_distribution<float> normal(0.0f, i == 1 ? 1e-3f : 1.0f);
        for (auto& x : v) x = normal(gen);
        sk::copy(ctx, view, sk::from_vector(ctx, v, view.shape()));
      });
      const auto& flat = engine.group(0).flat();
      const auto& plan = flat.plan();
      auto whole = [&] {
        return sk::to_vector<float>(ctx, flat.params().flat().slice(0, 0, plan.trainable_end()));
      };
      std::vector<float> exact;
      {
        auto full = engine.full_params();
        exact = whole();
      }
      engine.gather(0);  // as a step's forward does
      const auto gathered = whole();
      for (int r = 0; r < comm.size(); ++r) {
        const sk::Tensor run = sk::from_vector(
            ctx, std::vector<float>(exact.begin() + plan.begin(r), exact.begin() + plan.end(r)),
            {plan.numel(r)});
        const sk::Tensor payload =
            sk::zeros(ctx, {sk::ops::quant_payload_bytes(plan.numel(r), block)}, sk::DType::u8);
        sk::ops::quantize_blocks(ctx, format, run, block, payload);
        sk::ops::dequantize_blocks(ctx, format, payload, block, run);
        const auto want = sk::to_vector<float>(ctx, run);
        CAPTURE(r);
        CHECK(std::memcmp(want.data(), gathered.data() + plan.begin(r),
                          want.size() * sizeof(float)) == 0);
        // And within the format's bound of the exact values, block by block, independently of
        // the ops above: int8 steps by amax / 127 (half a step), E4M3 keeps 3 mantissa bits
        // (1/16 of |x|) down to its subnormals' step (amax / 448 / 512, half of it).
        std::int64_t outside = 0;
        for (std::int64_t lo = 0; lo < plan.numel(r); lo += block) {
          const std::int64_t hi = std::min(plan.numel(r), lo + block);
          const auto at = [&](std::int64_t i) {
            return static_cast<std::size_t>(plan.begin(r) + i);
          };
          double amax = 0;
          for (std::int64_t i = lo; i < hi; ++i)
            amax = std::max(amax, std::fabs(double(exact[at(i)])));
          for (std::int64_t i = lo; i < hi; ++i) {
            const double x = exact[at(i)], g = gathered[at(i)];
            const double bound = format == sk::ops::QuantFormat::int8
                                     ? amax / 254
                                     : std::max(std::fabs(x) / 16, amax / 448 / 1024);
            outside += !(std::fabs(g - x) <= bound * (1 + 1e-5));
          }
        }
        CHECK(outside == 0);
      }
      CHECK(gathered != exact);
      {
        auto full = engine.full_params();  // exact again, although the unit was held quantised
        CHECK(whole() == exact);
        sk::copy(ctx, engine.param(0), sk::full(ctx, {300}, sk::DType::f32, 0.1));  // written back
      }
      {
        auto full = engine.full_params();
        const auto now = whole();
        CHECK(std::all_of(now.begin(), now.begin() + 300, [](float x) { return x == 0.1f; }));
        CHECK(std::equal(now.begin() + 300, now.end(), exact.begin() + 300));
      }
    });
}

namespace {

// FSDP with FSDP2's float8 gathers: E4M3 codes, one scale per tensor.
sk::parallel::ParallelOptions e4m3_per_tensor() {
  sk::parallel::ParallelOptions options;
  options.stage = Stage::fsdp;
  options.fsdp.quantized_weights = true;
  options.fsdp.quantized_weights_format = sk::ops::QuantFormat::f8_e4m3;
  options.fsdp.quantized_weights_scale = sk::ops::QuantScale::tensor;
  return options;
}

// Unit u, gathered by a step's gather, holds each parameter through its tensor's E4M3 scale
// from the shards' exact values, bit for bit as the host's encode and decode give them.
void check_tensor_scaled_gather(sk::Context& ctx, sk::parallel::FsdpEngine& engine, std::size_t u) {
  engine.gather_exact(u);
  std::vector<std::vector<float>> exact;
  for (std::size_t i = 0; i < engine.param_count(); ++i)
    if (engine.unit_of(i) == u) exact.push_back(sk::to_vector<float>(ctx, engine.param(i)));
  engine.release(u);
  engine.gather(u);
  std::size_t k = 0;
  for (std::size_t i = 0; i < engine.param_count(); ++i) {
    if (engine.unit_of(i) != u) continue;
    CAPTURE(i);
    const auto& values = exact[k++];
    float amax = 0.0f;
    for (float x : values) amax = sk::ops::abs_max(amax, x);
    const float inverse = sk::ops::inverse_step<sk::ops::E4m3Code>(amax);
    const auto gathered = sk::to_vector<float>(ctx, engine.param(i));
    for (std::size_t e = 0; e < gathered.size(); ++e) {
      const float want = sk::ops::E4m3Code::decode(sk::ops::E4m3Code::encode(values[e], inverse),
                                                   amax / sk::ops::kE4m3Max);
      REQUIRE(std::memcmp(&want, &gathered[e], sizeof want) == 0);
    }
  }
  engine.release(u);
}

}  // namespace

// FSDP2's float8 all-gather: E4M3 codes with one scale per parameter, from the maxima of every
// rank's pieces. What a gathered unit holds is each parameter's values through its tensor's
// scale, bit for bit as the host's encode and decode give them, on every rank; the wire
// carries codes alone.
TEST_CASE("qwZ per tensor: a gathered unit holds each parameter through its tensor's E4M3 scale") {
  const std::vector<sk::shard::ParamSpec> specs = {
      {"a", {300}, true}, {"b", {7, 50}, true}, {"c", {10000}, true}, {"d", {3}, true}};
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto options = e4m3_per_tensor();
    sk::parallel::FsdpEngine engine(ctx, comm, {sk::parallel::FsdpUnitParams{"unit", specs}},
                                    dp_test::config_for(OptimizerKind::sgd), options);
    engine.set_full_params([&](std::size_t i, const sk::Tensor& view) {
      std::vector<float> v(static_cast<std::size_t>(view.numel()));
      std::mt19937 gen(static_cast<std::uint32_t>(50 + i));
      // Tensors of very different sizes of values: one scale each keeps each relative.
      std::normal_distribution<float> normal(0.0f, i == 1 ? 1e-4f : i == 3 ? 30.0f : 1.0f);
      for (auto& x : v) x = normal(gen);
      sk::copy(ctx, view, sk::from_vector(ctx, v, view.shape()));
    });
    const auto& flat = engine.group(0).flat();
    const auto& layout = flat.plan().layout();
    std::vector<std::vector<float>> exact;
    {
      auto full = engine.full_params();
      for (std::size_t i = 0; i < engine.param_count(); ++i)
        exact.push_back(sk::to_vector<float>(ctx, engine.param(i)));
    }
    comm.reset_stats();
    engine.gather(0);  // as a step's forward does
    for (std::size_t i = 0; i < engine.param_count(); ++i) {
      CAPTURE(i);
      float amax = 0.0f;
      for (float x : exact[i]) amax = sk::ops::abs_max(amax, x);
      const float inverse = sk::ops::inverse_step<sk::ops::E4m3Code>(amax);
      const float scale = amax / sk::ops::kE4m3Max;
      const auto gathered = sk::to_vector<float>(ctx, engine.param(i));
      std::size_t same = 0;
      for (std::size_t e = 0; e < gathered.size(); ++e) {
        const float want =
            sk::ops::E4m3Code::decode(sk::ops::E4m3Code::encode(exact[i][e], inverse), scale);
        REQUIRE(std::memcmp(&want, &gathered[e], sizeof want) == 0);
        same += gathered[e] == exact[i][e];
        // Relative to each value (1/16), not to a block's largest: the 1e-4 tensor keeps its
        // digits although it shares the unit with a tensor of values near 30.
        CHECK(std::fabs(gathered[e] - exact[i][e]) <=
              std::max(std::fabs(exact[i][e]) / 16, scale / 1024) * 1.00001f);
      }
      CHECK(same < gathered.size());  // quantised, really
    }
    // The codes alone on the wire (each rank's run padded to 16 bytes), and the tensors'
    // maxima all-reduced beside them: one f32 per parameter and one for the padding.
    std::int64_t wire = 0;
    for (int r = 0; r < comm.size(); ++r)
      wire += sk::ops::quant_codes_payload_bytes(flat.plan().numel(r));
    CHECK(comm.stats().of(sk::comm::CollectiveKind::all_gather_v).payload_bytes ==
          static_cast<std::uint64_t>(wire));
    CHECK(comm.stats().of(sk::comm::CollectiveKind::all_reduce).payload_bytes ==
          4 * (layout.size() + 1));
  });
}

// The tensors' maxima change only with the shards: every unit's are all-reduced together at the
// first gather after a step (one small collective a step, not one a gather), and a gather
// after the step uses the new ones.
TEST_CASE("qwZ per tensor: one all-reduce of every unit's maxima a step, fresh after each step") {
  const std::vector<sk::parallel::FsdpUnitParams> units = {
      {"first", {{"a", {300}, true}, {"b", {7, 50}, true}}},
      {"second", {{"c", {1000}, true}}},
      {"third", {{"d", {3}, true}, {"e", {40, 5}, true}}}};
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto options = e4m3_per_tensor();
    sk::parallel::FsdpEngine engine(ctx, comm, units, dp_test::config_for(OptimizerKind::sgd),
                                    options);
    engine.set_full_params([&](std::size_t i, const sk::Tensor& view) {
      sk::Context host({.seed = 70 + i});
      auto values = sk::empty(host, view.shape(), sk::DType::f32);
      sk::normal_(host, values, 0.0, i == 2 ? 0.01 : 1.0);
      sk::copy(ctx, view, values);
    });
    std::uint64_t slots = 0;
    for (std::size_t u = 0; u < engine.unit_count(); ++u)
      slots += engine.group(u).plan().layout().size() + 1;
    const auto all_reduces = [&] { return comm.stats().of(sk::comm::CollectiveKind::all_reduce); };
    comm.reset_stats();
    const int steps = 3;
    for (int s = 0; s < steps; ++s) {
      engine.zero_grad();
      for (std::size_t u = 0; u < engine.unit_count(); ++u) {  // the forward
        engine.gather(u);
        engine.release(u);
      }
      for (std::size_t u = engine.unit_count(); u-- > 0;) {  // the backward
        engine.gather(u);
        for (std::size_t i = 0; i < engine.param_count(); ++i) {
          if (engine.unit_of(i) != u) continue;
          sk::Context host({.seed = 900u + 10u * static_cast<unsigned>(s) + i +
                                    100u * static_cast<unsigned>(comm.rank())});
          auto g = sk::empty(host, engine.grad(i).shape(), sk::DType::f32);
          sk::uniform_(host, g, -1.0, 1.0);
          sk::add_(ctx, engine.grad(i), g);
          engine.ready(i);
        }
        engine.release(u);
      }
      engine.finish();
      engine.step(0.2f);
    }
    // 2 x 3 gathers a step, one all-reduce of every unit's maxima (a float per tensor and one
    // per unit's padding).
    CHECK(all_reduces().calls == static_cast<std::uint64_t>(steps));
    CHECK(all_reduces().payload_bytes == static_cast<std::uint64_t>(steps) * 4 * slots);
    // After the last step: each unit's gather holds its values through the new maxima.
    for (std::size_t u = 0; u < engine.unit_count(); ++u)
      check_tensor_scaled_gather(ctx, engine, u);
  });
}

// The other ways the shards change -- set_full_params, values written through full_params() --
// make the maxima stale too; and a captured step computes its own (a CUDA graph replays only
// what it captured), even when an eager gather since the last step left them fresh.
TEST_CASE("qwZ per tensor: the maxima follow every change of the shards, and a capture") {
  const std::vector<sk::parallel::FsdpUnitParams> units = {
      {"first", {{"a", {300}, true}, {"b", {7, 50}, true}}}, {"second", {{"c", {1000}, true}}}};
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto options = e4m3_per_tensor();
    sk::parallel::FsdpEngine engine(ctx, comm, units, dp_test::config_for(OptimizerKind::sgd),
                                    options);
    const auto set_values = [&](double stddev) {
      engine.set_full_params([&](std::size_t i, const sk::Tensor& view) {
        sk::Context host({.seed = 30 + i});
        auto values = sk::empty(host, view.shape(), sk::DType::f32);
        sk::normal_(host, values, 0.0, stddev);
        sk::copy(ctx, view, values);
      });
    };
    set_values(1.0);
    check_tensor_scaled_gather(ctx, engine, 0);
    set_values(3.0);  // new values, three times as large
    check_tensor_scaled_gather(ctx, engine, 0);
    {
      auto full = engine.full_params();  // written back: every value ten times as large
      for (std::size_t i = 0; i < engine.param_count(); ++i)
        sk::copy(ctx, engine.param(i),
                 sk::from_vector(
                     ctx,
                     [&] {
                       auto v = sk::to_vector<float>(ctx, engine.param(i));
                       for (auto& x : v) x *= 10.0f;
                       return v;
                     }(),
                     engine.param(i).shape()));
    }
    check_tensor_scaled_gather(ctx, engine, 1);

    // A step captured after an eager gather that computed the step's maxima already.
    const auto step = [&] {
      engine.zero_grad();
      for (std::size_t u = 0; u < engine.unit_count(); ++u) {
        engine.gather(u);
        engine.release(u);
      }
      for (std::size_t u = engine.unit_count(); u-- > 0;) {
        engine.gather(u);
        for (std::size_t i = 0; i < engine.param_count(); ++i)
          if (engine.unit_of(i) == u) {
            sk::fill(ctx, engine.grad(i), 0.01 * static_cast<double>(i + 1 + comm.rank()));
            engine.ready(i);
          }
        engine.release(u);
      }
      engine.finish();
      engine.step(0.1f);
    };
    sk::StepGraph graph(ctx, "per-tensor qwZ", {.warmup_steps = 1});
    const auto all_reduces = [&] {
      return comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls;
    };
    graph.run("k", step);  // warm-up, eager
    engine.gather(0);      // an eager gather (an evaluation's, say): the maxima are fresh now
    engine.release(0);
    const auto before = all_reduces();
    graph.run("k", step);  // the capture
    CHECK(graph.stats().captures == 1);
    CHECK(all_reduces() - before == 1);  // its own maxima, in the captured work
    graph.run("k", step);                // a replay
    check_tensor_scaled_gather(ctx, engine, 0);
  });
}

TEST_CASE("qwZ per tensor: FSDP with E4M3 gathers scaled per tensor trains close to exact FSDP") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw})
    for (int world : {2, 3}) {
      const auto [run, exact, quantized] =
          exact_and_compressed(kind, world, [&](sk::parallel::FsdpOptions& o) {
            o.quantized_weights = true;
            o.quantized_weights_format = sk::ops::QuantFormat::f8_e4m3;
            o.quantized_weights_scale = sk::ops::QuantScale::tensor;
          });
      CAPTURE(describe(run));
      CHECK(!dp_test::bitwise_equal(quantized.values, exact.values));  // quantised, really
      const double largest = largest_value(exact), worst = worst_difference(quantized, exact);
      CHECK(std::isfinite(worst));
      // As the per-block E4M3 gathers (3 mantissa bits: within 1/16 of each value).
      if (kind == OptimizerKind::sgd) CHECK(worst <= 0.04 * largest);
      CHECK(std::fabs(quantized.final_loss - exact.final_loss) <= 0.03 * exact.final_loss);
      // A byte per value against f32's four and no scales: a quarter, exactly here (every
      // rank's run is a multiple of 16 values, so no padding either).
      const double ratio = double(quantized.gather_bytes) / double(exact.gather_bytes);
      CHECK(ratio == 0.25);
    }
}

TEST_CASE("qwZ: refused outside fsdp, with shards on the host, and with a block of 0") {
  sk::parallel::ParallelOptions options;
  options.fsdp.quantized_weights = true;
  options.stage = Stage::sdp;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("only fsdp (ZeRO-3) makes; stage sdp"));
  options.stage = Stage::fsdp;
  options.fsdp.quantization_block = 0;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.quantization_block is 0"));
  options.fsdp.quantization_block = 256;
  options.offload.optimizer = true;
  options.offload.params = true;
  CHECK_THROWS_WITH(sk::parallel::resolve(options), doctest::Contains("offload.params"));
  // A scale per tensor: E4M3's (a floating code), and only with the quantised gathers on.
  options.offload = {};
  options.fsdp.quantized_weights_scale = sk::ops::QuantScale::tensor;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("fsdp.quantized_weights_scale tensor with "
                                      "fsdp.quantized_weights_format int8"));
  options.fsdp.quantized_weights = false;
  CHECK_THROWS_WITH(sk::parallel::resolve(options),
                    doctest::Contains("but fsdp.quantized_weights is off"));
  options.fsdp.quantized_weights = true;
  options.fsdp.quantized_weights_format = sk::ops::QuantFormat::f8_e4m3;
  CHECK(sk::parallel::resolve(options).quantized_gather_scale == sk::ops::QuantScale::tensor);
}
