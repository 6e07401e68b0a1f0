// ShardedModule (ddp/oss/sdp over an nn::Module) against the hand-written DataParallel loop:
// the same model, batches and optimizer give bitwise the same parameters and buffers; with
// activation checkpointing too; buffers follow DDP's broadcast_buffers semantics.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/param_rows.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using namespace module_test;
using sk::optim::OptimizerKind;
using sk::parallel::Stage;

namespace {

constexpr int kSteps = 6;

float lr_at(int step) { return 0.05f * (1.0f - 0.05f * static_cast<float>(step)); }

// The hand-written loop: a plain module per rank, its gradients copied into DataParallel's
// buckets, DataParallel's parameters copied back, rank 0's buffers broadcast before forwards.
std::vector<float> hand_written(int world, Stage stage, OptimizerKind kind) {
  std::vector<float> rank0;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.partition = sk::shard::PartitionKind::flat;
    options.buckets.bucket_bytes = 4096;
    sk::parallel::DataParallel dp(ctx, comm, sk::parallel::module_param_specs(*net),
                                  dp_test::config_for(kind), options);
    auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, dp.param(i), params[i].data());
    dp.broadcast_parameters(0);
    sk::parallel::broadcast_module_buffers(ctx, *net, comm);
    for (int s = 0; s < kSteps; ++s) {
      for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, params[i].data(), dp.param(i));
      sk::parallel::broadcast_module_buffers(ctx, *net, comm);
      net->zero_grad();
      dp.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, (*net)(ctx, b.x), b.labels));
      for (std::size_t i = params.size(); i-- > 0;) {
        if (!params[i].requires_grad()) continue;
        sk::copy(ctx, dp.grad(i), params[i].grad());
        dp.ready(i);
      }
      dp.finish();
      dp.step(lr_at(s));
    }
    for (std::size_t i = 0; i < params.size(); ++i) sk::copy(ctx, params[i].data(), dp.param(i));
    if (comm.rank() == 0) rank0 = module_values(ctx, *net);
  });
  return rank0;
}

std::vector<float> wrapped(int world, Stage stage, OptimizerKind kind, int checkpoint_segments) {
  std::vector<std::vector<float>> per_rank(static_cast<std::size_t>(world));
  std::int64_t parameter_count = 0;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    if (comm.rank() == 0) parameter_count = net->parameter_count();
    net->set_checkpoint_segments(checkpoint_segments);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 4096;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(kind), options);
    for (int s = 0; s < kSteps; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(lr_at(s));
    }
    // The module's own parameters are views of the flat buffer: reading them reads the result.
    per_rank[static_cast<std::size_t>(comm.rank())] = module_values(ctx, *net);
  });
  // Parameters agree on every rank, bit for bit (buffers are broadcast before each forward but
  // updated by the last forward from each rank's own batch: parameters only, the values'
  // first `parameter_count` entries, as module_values lists parameters first).
  const auto parameter_bytes = static_cast<std::size_t>(parameter_count) * sizeof(float);
  for (std::size_t r = 1; r < per_rank.size(); ++r) {
    CAPTURE(r);
    REQUIRE(per_rank[r].size() == per_rank[0].size());
    REQUIRE(parameter_bytes <= per_rank[0].size() * sizeof(float));
    CHECK(std::memcmp(per_rank[0].data(), per_rank[r].data(), parameter_bytes) == 0);
  }
  return per_rank[0];
}

}  // namespace

TEST_CASE("ShardedModule ddp/oss/sdp equal the hand-written DataParallel loop bitwise") {
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (int world : {1, 2, 3}) {
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
        const auto expected = hand_written(world, stage, kind);
        for (int segments : {0, 2}) {
          const auto got = wrapped(world, stage, kind, segments);
          CHECK_MESSAGE(dp_test::bitwise_equal(got, expected), sk::optim::optimizer_kind_name(kind),
                        " ", sk::parallel::stage_name(stage), " world ", world,
                        " checkpoint segments ", segments);
        }
      }
    }
  }
}

TEST_CASE(
    "ShardedModule: parameters stay views, names and frozen flags survive, errors are clear") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 5 + static_cast<std::uint64_t>(comm.rank()));
    const auto names_before = net->named_parameters();
    sk::parallel::ParallelOptions options;
    options.stage = Stage::sdp;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    const auto names_after = net->named_parameters();
    REQUIRE(names_after.size() == names_before.size());
    for (std::size_t i = 0; i < names_after.size(); ++i) {
      CHECK(names_after[i].first == names_before[i].first);
      CHECK(names_after[i].second.data().shares_storage(model.engine().param(0)));
      CHECK(names_after[i].second.requires_grad() == names_before[i].second.requires_grad());
    }
    // Rank 0's parameters everywhere after wrapping.
    auto mine = module_values(ctx, *net);
    std::vector<float> rank0 = mine;
    auto t = sk::from_vector(ctx, rank0, {static_cast<std::int64_t>(rank0.size())});
    comm.broadcast(t, 0).wait();
    CHECK(sk::to_vector<float>(ctx, t) == mine);
  });
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Linear>(ctx, 3, 2, true, sk::DType::f64));
    CHECK_THROWS_WITH(sk::parallel::ShardedModule(ctx, comm, net, {}),
                      doctest::Contains("parameter '0.weight' is f64"));
  });
}

namespace {

// A head like SwAV's: Linear(12 -> 32) -> ReLU -> prototypes Linear(32 -> 10, no bias, "2.weight"),
// every parameter uniform in [-0.5, 0.5) from `seed` (so the prototypes' rows are not unit).
std::shared_ptr<nn::Sequential> prototypes_net(sk::Context& ctx, std::uint64_t seed) {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(ctx, 12, 32));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(ctx, 32, 10, false));
  sk::Context init({.seed = seed});
  for (auto& p : net->parameters()) {
    auto v = sk::empty(init, p.shape(), sk::DType::f32);
    sk::uniform_(init, v, -0.5, 0.5);
    sk::copy(ctx, p.data(), v);
  }
  return net;
}

// prototypes_net trained with the prototypes' rows re-normalised after every step and their
// gradient zeroed in the first `frozen` steps. Rank 0's values of every parameter after `steps`
// steps.
std::vector<float> prototypes_run(int world, Stage stage, OptimizerKind kind, int frozen,
                                  sk::DType dtype = sk::DType::f32, int steps = 4,
                                  bool in_step = false, std::uint64_t* all_gathers = nullptr) {
  std::vector<float> out;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = prototypes_net(ctx, 5);
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 512;
    options.fsdp.wrap.unit_paths = {"2"};
    options.precision = sk::parallel::MixedPrecision::of(dtype);
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(kind), options);
    if (in_step) sk::parallel::normalize_rows_after_step(model.engine(), "2.weight");
    const auto gathers_before = comm.stats().of(sk::comm::CollectiveKind::all_gather_v).calls;
    for (int s = 0; s < steps; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 10, comm.rank(), s);
      auto loss = ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
      ag::backward(ctx, loss);
      if (s < frozen) sk::parallel::zero_grad_of(model.engine(), "2.weight");
      model.step(0.1f);
      if (!in_step) {
        auto state = model.training_state();
        sk::parallel::normalize_rows(ctx, state, "2.weight");
      }
    }
    if (all_gathers != nullptr && comm.rank() == 0)
      *all_gathers = comm.stats().of(sk::comm::CollectiveKind::all_gather_v).calls - gathers_before;
    auto dict = model.state_dict(true);
    if (comm.rank() != 0) return;
    for (const auto& [name, t] : dict) {
      const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, t, sk::DType::f32));
      out.insert(out.end(), v.begin(), v.end());
    }
  });
  return out;
}

}  // namespace

TEST_CASE("normalize_rows and zero_grad_of: exact and alike under every stage") {
  for (auto dtype : {sk::DType::f32, sk::DType::bf16}) {
    for (auto kind : {OptimizerKind::sgd, OptimizerKind::larc_sgd}) {
      const auto ddp = prototypes_run(3, Stage::ddp, kind, 0, dtype);
      // The prototypes (the last 10 x 32 values) have unit rows.
      REQUIRE(ddp.size() == 12 * 32 + 32 + 32 * 10);
      for (int r = 0; r < 10; ++r) {
        double s = 0;
        for (int c = 0; c < 32; ++c) s += double(ddp[416 + r * 32 + c]) * ddp[416 + r * 32 + c];
        CHECK(std::sqrt(s) == doctest::Approx(1.0).epsilon(dtype == sk::DType::f32 ? 1e-6 : 1e-2));
      }
      for (auto stage : {Stage::oss, Stage::sdp, Stage::fsdp}) {
        CAPTURE(sk::parallel::stage_name(stage));
        CHECK(prototypes_run(3, stage, kind, 0, dtype) == ddp);
      }
      // Inside the step: the same bits, and OSS/SDP gather the parameters once per step, not twice.
      for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
        CAPTURE(sk::parallel::stage_name(stage));
        std::uint64_t separate = 0, inside = 0;
        CHECK(prototypes_run(3, stage, kind, 0, dtype, 4, false, &separate) == ddp);
        CHECK(prototypes_run(3, stage, kind, 0, dtype, 4, true, &inside) == ddp);
        if (stage == Stage::oss || stage == Stage::sdp)  // one parameter gather fewer per step
          CHECK(separate == inside + 4);
      }
    }
  }
  // Frozen for all 4 steps under LARC: the prototypes keep their (normalised) start.
  for (auto stage : {Stage::ddp, Stage::sdp, Stage::fsdp}) {
    const auto frozen = prototypes_run(2, stage, OptimizerKind::larc_sgd, 4);
    const auto once = prototypes_run(2, stage, OptimizerKind::larc_sgd, 1);
    const auto moving = prototypes_run(2, stage, OptimizerKind::larc_sgd, 0);
    const std::vector<float> protos(frozen.begin() + 416, frozen.end());
    const auto start = prototypes_run(2, stage, OptimizerKind::larc_sgd, 0, sk::DType::f32, 0);
    for (int r = 0; r < 10; ++r) {
      double norm = 0;
      for (int c = 0; c < 32; ++c)
        norm += double(start[416 + r * 32 + c]) * start[416 + r * 32 + c];
      for (int c = 0; c < 32; ++c)
        CHECK(protos[r * 32 + c] ==
              doctest::Approx(start[416 + r * 32 + c] / std::sqrt(norm)).epsilon(1e-6));
    }
    CHECK(protos != std::vector<float>(moving.begin() + 416, moving.end()));
    CHECK(protos != std::vector<float>(once.begin() + 416, once.end()));
    // The rest of the network trained all the same.
    CHECK(std::vector<float>(frozen.begin(), frozen.begin() + 416) !=
          std::vector<float>(moving.begin(), moving.begin() + 416));
  }
}

// What the host waits for in a training step (Context::host_waits: device values read, host
// values uploaded, stream synchronisations, collectives waited for), counted on the CPU where
// the same calls are made as on a GPU: none, under every stage, for a plain step -- forward
// with batch-norm, backward with bucketed collectives, the fused step (its collectives are
// waited for on the stream: Work::wait_on_stream) --, a loss-scaled one (the scaler's state and
// the step gate stay on the device: ops/step_gate.hpp; LARC's coefficients read the gate's
// factor there) and a clipped one (the norm is returned on the device and its coefficient
// reaches the pass through the gate), for SGD, AdamW and LARC (sharded LARC's whole-parameter
// norms are exchanged and finished on the device: ParamNorms::roots). So a step can run ahead
// of a GPU and be captured. A new wait in a step fails here.
TEST_CASE("a training step's host waits: none, plain, loss-scaled or clipped, under every stage") {
  enum Variant { plain, loss_scaled, clipped };
  constexpr int kWarmup = 2, kMeasured = 3;
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
      for (auto variant : {plain, loss_scaled, clipped}) {
        sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
          sk::parallel::ParallelOptions options;
          options.stage = stage;
          options.buckets.bucket_bytes = 4096;
          sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(kind), options);
          sk::optim::DynamicLossScaler scaler;
          std::vector<Batch> batches;  // on the device before the steps, as a loader's would be
          for (int s = 0; s < kWarmup + kMeasured; ++s)
            batches.push_back(batch(ctx, {6, 12}, 7, comm.rank(), s));
          sk::HostWaits before;
          for (int s = 0; s < kWarmup + kMeasured; ++s) {
            if (s == kWarmup) before = ctx.host_waits();
            model.zero_grad();
            const auto& b = batches[static_cast<std::size_t>(s)];
            auto loss = ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
            if (variant == loss_scaled) {
              ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
              model.step(lr_at(s), scaler);
            } else {
              ag::backward(ctx, loss);
              if (variant == clipped) (void)model.clip_grad_norm(1.0);
              model.step(lr_at(s));
            }
          }
          const auto got = ctx.host_waits() - before;
          CHECK_MESSAGE(got.total() == 0, sk::optim::optimizer_kind_name(kind), " ",
                        sk::parallel::stage_name(stage), " variant ", int(variant), " rank ",
                        comm.rank(), ": ", got.reads, " reads, ", got.uploads, " uploads, ",
                        got.synchronizations, " synchronisations, ", got.collective_waits,
                        " collective waits in ", kMeasured, " steps");
        });
      }
    }
  }
}

// The same steps through a StepGraph (core/step_graph.hpp): two warm-up steps, a capture, two
// replays (on the CPU a replay runs the step again under the capture's rules: no host wait, no
// drifting host value) against eager steps, bit for bit, under every stage -- plain, loss-scaled
// with an overflow at a replayed step (an inf in the input), clipped -- for SGD, AdamW and LARC,
// with a learning-rate schedule: one capture, the rate set before each run (set_lr, read on the
// device). The step reads fixed input tensors, refilled before each step.
TEST_CASE("steps through a StepGraph equal eager steps bit for bit, under every stage") {
  enum Variant { plain, loss_scaled, clipped };
  constexpr int kSteps = 5;
  for (auto kind : {OptimizerKind::sgd, OptimizerKind::adamw, OptimizerKind::larc_sgd}) {
    for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
      for (auto variant : {plain, loss_scaled, clipped}) {
        sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          std::vector<std::vector<unsigned char>> finals;
          for (bool graphed : {false, true}) {
            auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
            sk::parallel::ParallelOptions options;
            options.stage = stage;
            options.buckets.bucket_bytes = 4096;
            sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(kind), options);
            sk::optim::DynamicLossScaler scaler;
            const auto x = sk::empty(ctx, {6, 12}, sk::DType::f32);
            const auto labels = sk::empty(ctx, {6}, sk::DType::i64);
            float lr = 0;  // the eager steps' rate
            const auto step = [&] {
              model.zero_grad();
              auto loss = ag::cross_entropy(ctx, model(ctx, ag::Variable(x)), labels);
              if (variant == loss_scaled) {
                ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
                graphed ? model.step(scaler) : model.step(lr, scaler);
              } else {
                ag::backward(ctx, loss);
                if (variant == clipped) (void)model.clip_grad_norm(0.5);
                graphed ? model.step() : model.step(lr);
              }
            };
            sk::StepGraph graph(ctx, "mlp");
            std::vector<sk::StepRun> runs;
            for (int s = 0; s < kSteps; ++s) {
              const auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
              sk::copy(ctx, x, b.x.data());
              sk::copy(ctx, labels, b.labels);
              if (variant == loss_scaled && s == 3 && comm.rank() == 1)
                sk::fill(ctx, x.slice(0, 2, 3), std::numeric_limits<double>::infinity());
              lr = lr_at(s);
              if (graphed) {
                model.set_lr(lr);
                runs.push_back(graph.run("6x12", step));
              } else {
                step();
              }
            }
            if (variant == loss_scaled)  // the overflow backed the scale off, once
              CHECK(scaler.scale() == sk::optim::LossScalerOptions{}.init_scale / 2);
            if (graphed) {
              CHECK(graph.stats().eager == 2);
              CHECK(graph.stats().captures == 1);
              CHECK(graph.stats().replays == 2);
            }
            std::vector<unsigned char> bytes;
            for (const auto& [name, t] : model.state_dict(false)) {
              const auto* p = static_cast<const unsigned char*>(t.data_ptr());
              bytes.insert(bytes.end(), p, p + t.nbytes());
            }
            finals.push_back(std::move(bytes));
          }
          CHECK_MESSAGE(finals[0] == finals[1], sk::optim::optimizer_kind_name(kind), " ",
                        sk::parallel::stage_name(stage), " variant ", int(variant), " rank ",
                        comm.rank());
        });
      }
    }
  }
}

// What a captured ShardedModule step cannot hold is refused by name: an offloaded optimizer
// (its backward brings the gradients to the host, its step runs there), a learning rate that
// changed under the same key.
TEST_CASE("a captured ShardedModule step refuses offload and a drifting learning rate") {
  for (bool offload : {true, false}) {
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
      sk::parallel::ParallelOptions options;
      options.stage = Stage::sdp;
      options.offload.optimizer = offload;
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                        options);
      const auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
      float lr = 0.05f;
      const auto step = [&] {
        model.zero_grad();
        ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
        model.step(lr);
      };
      sk::StepGraph graph(ctx, "mlp", {.warmup_steps = 1});
      graph.run("k", step);
      std::string message;
      try {
        graph.run("k", step);
        if (!offload) {
          lr = 0.04f;
          graph.run("k", step);
        }
      } catch (const sk::CaptureRefused& e) {
        message = e.what();
      }
      if (offload)
        CHECK(message.find("an offloaded optimizer") != std::string::npos);
      else
        CHECK(message.find("was built with the optimizer's lr (set_lr, step(lr, ...)) = 0.05 "
                           "but this replay has 0.04") != std::string::npos);
      CHECK_FALSE(ctx.capturing());
    });
  }
}

// clip_grad_norm's max_norm and inv_grad_scale are kernel arguments of the captured step (the
// norm's coefficient and the step's fold): a GPU replay would use the captured ones, so a CPU
// replay with another refuses it by name -- a loss scale read on the host into a captured
// clip is caught here rather than clipping by a stale scale on the GPU.
TEST_CASE("a captured step refuses a clip_grad_norm scale that drifted, by name") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = Stage::fsdp;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    const auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
    float inv_scale = 1.0f;
    const auto step = [&] {
      model.zero_grad();
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      (void)model.clip_grad_norm(0.5, inv_scale);
      model.step();
    };
    model.set_lr(0.05f);
    sk::StepGraph graph(ctx, "mlp", {.warmup_steps = 1});
    graph.run("k", step);
    CHECK(graph.run("k", step) == sk::StepRun::captured);
    CHECK(graph.run("k", step) == sk::StepRun::replayed);
    inv_scale = 0.5f;
    std::string message;
    try {
      graph.run("k", step);
    } catch (const sk::CaptureRefused& e) {
      message = e.what();
    }
    CHECK(message.find("was built with clip_grad_norm's inv_grad_scale = 1 but this replay has "
                       "0.5") != std::string::npos);
    CHECK_FALSE(ctx.capturing());
  });
}

// The prototypes' normalisation inside a loss-scaled step (normalize_rows_after_step registers
// a gated hook: it reads the step gate on the device, not the verdict on the host): no host
// wait in a step, so the step can be captured; and after a step the gate skipped (an overflow:
// an inf in one rank's input) the parameters are untouched -- the hook ran, but its pass wrote
// nothing (the start is not normalised: a pass that ran would change it).
TEST_CASE(
    "normalize_rows_after_step in a loss-scaled step: no host wait; a skipped step untouched") {
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
    CAPTURE(sk::parallel::stage_name(stage));
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = prototypes_net(ctx, 6);
      sk::parallel::ParallelOptions options;
      options.stage = stage;
      options.buckets.bucket_bytes = 512;
      options.fsdp.wrap.unit_paths = {"2"};
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                        options);
      sk::parallel::normalize_rows_after_step(model.engine(), "2.weight");
      auto values = [&] {  // collective; rank 0 gets the consolidated values, the others none
        std::vector<float> out;
        for (const auto& [name, t] : model.state_dict(true)) {
          const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, t, sk::DType::f32));
          out.insert(out.end(), v.begin(), v.end());
        }
        return out;
      };
      std::vector<Batch> batches;  // on the device before the steps, as a loader's would be
      for (int s = 0; s < 5; ++s) batches.push_back(batch(ctx, {6, 12}, 10, comm.rank(), s));
      Batch overflowing_batch = batch(ctx, {6, 12}, 10, comm.rank(), 9);
      if (comm.rank() == 1)
        sk::fill(ctx, overflowing_batch.x.data().slice(0, 2, 3),
                 std::numeric_limits<double>::infinity());
      auto step = [&](sk::optim::DynamicLossScaler& scaler, int s) {
        model.zero_grad();
        const auto& b = s < 0 ? overflowing_batch : batches[static_cast<std::size_t>(s)];
        auto loss = ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
        ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
        model.step(0.1f, scaler);
      };
      const auto start = values();
      sk::optim::DynamicLossScaler scaler;
      step(scaler, -1);
      CHECK(scaler.found_inf());
      const auto after_skip = values();
      if (comm.rank() == 0) CHECK(after_skip == start);
      sk::HostWaits before;
      for (int s = 0; s < 5; ++s) {
        if (s == 2) before = ctx.host_waits();
        step(scaler, s);
      }
      CHECK((ctx.host_waits() - before).total() == 0);
      const auto trained = values();
      if (comm.rank() != 0) return;
      REQUIRE(trained.size() == 12 * 32 + 32 + 32 * 10);
      CHECK(trained != start);
      for (int r = 0; r < 10; ++r) {  // the prototypes (the last 10 x 32 values): unit rows
        double sum = 0;
        for (int c = 0; c < 32; ++c)
          sum += double(trained[416 + r * 32 + c]) * trained[416 + r * 32 + c];
        CHECK(std::sqrt(sum) == doctest::Approx(1.0).epsilon(1e-6));
      }
    });
  }
}

namespace {

// Rank 0's parameters and buffers after three steps whose second meets a backward cut short
// by an exception (`cut`), or -- the reference -- the same two forwards with no backward.
// Every rank's hook throws at the same point, after the head's buckets went out.
// With qgZ's error feedback (`quantized`) the close starts its residuals from zero: the
// reference does the same there.
std::vector<float> run_with_cut_backward(Stage stage, bool accumulate, bool quantized, bool cut) {
  std::vector<float> rank0;
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = stage;
    options.buckets.bucket_bytes = 1024;
    options.fsdp.wrap.unit_paths = {"0", "5"};
    options.fsdp.quantized_grads = quantized;
    options.fsdp.grad_error_feedback = quantized;
    options.fsdp.quantization_block = 64;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    bool fail = false;
    const auto hook = net->at(3).register_backward_hook([&](nn::Module&, const sk::Tensor&) {
      if (fail) throw sk::InvalidArgument("the hook failed");
    });
    auto backward = [&](int s, int micro) {
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s * 4 + micro);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    };
    auto forward_only = [&](int s, int micro) {
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s * 4 + micro);
      (void)model(ctx, b.x);
    };
    const auto reductions = [&] {
      return comm.stats().of(sk::comm::CollectiveKind::all_reduce).calls +
             comm.stats().of(sk::comm::CollectiveKind::reduce_scatter_v).calls;
    };
    for (int s = 0; s < 3; ++s) {
      model.zero_grad();
      if (accumulate) backward(s, 0);  // a first synchronised backward: averages held
      if (s == 1 && cut) {
        fail = true;
        const auto before = reductions();
        CHECK_THROWS_WITH(backward(s, 1), "the hook failed");
        fail = false;
        if (stage == Stage::ddp) CHECK(reductions() > before);  // buckets went out before
        CHECK_THROWS_WITH(model.step(lr_at(s)), doctest::Contains("while a backward is open"));
        CHECK_THROWS_WITH(backward(s, 2), doctest::Contains("the last one is still open"));
        model.zero_grad();  // closes it: what it launched waited for and dropped
        if (accumulate) backward(s, 0);
      } else if (s == 1) {
        forward_only(s, 1);
        forward_only(s, 2);
        model.engine().reset_error_feedback();
        if (accumulate) {
          model.zero_grad();
          backward(s, 0);
        }
      }
      backward(s, 3);
      model.step(lr_at(s));
    }
    net->at(3).remove_hook(hook);
    std::vector<float> values;
    if (stage == Stage::fsdp) {
      auto full = model.full_params();
      values = module_values(ctx, *net);
    } else {
      values = module_values(ctx, *net);
    }
    if (comm.rank() == 0) rank0 = std::move(values);
  });
  return rank0;
}

}  // namespace

// A backward cut short by an exception (a hook, a gather out of memory) left its ready marks
// and launched buckets behind: the next backward was refused as "marked ready twice" whatever
// the user did, and a step after a sharded accumulation's second backward cut short took the
// first's averages with some of its buckets added. Now the step and the next backward are
// refused by name until zero_grad(), which closes it; training then goes on with the bits of
// a run in which that backward never ran.
TEST_CASE("a backward cut short: refused until zero_grad, then the bits of a run without it") {
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
    for (bool accumulate : {false, true}) {
      for (bool quantized : {false, true}) {
        if (quantized && stage != Stage::fsdp) continue;  // (fsdp's)
        const auto expected = run_with_cut_backward(stage, accumulate, quantized, false);
        const auto got = run_with_cut_backward(stage, accumulate, quantized, true);
        CHECK_MESSAGE(dp_test::bitwise_equal(got, expected), sk::parallel::stage_name(stage),
                      " accumulate ", accumulate, " qgZ ", quantized);
      }
    }
  }
}

namespace {

// Rank 0's values after three fsdp steps, each with one forward more than its backward (a
// probe, as an evaluation that forgot no_grad): with grad mode on (`probe_with_grad`) the root
// unit -- every unit without resharding -- stays gathered into the step; without, every unit
// is freed at the end of the forward. The batch-norm statistics move alike either way.
std::vector<float> run_with_probe(bool reshard, bool probe_with_grad) {
  std::vector<float> rank0;
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = Stage::fsdp;
    options.buckets.bucket_bytes = 1024;
    options.fsdp.wrap.unit_paths = {"0", "5"};
    options.fsdp.reshard_after_forward = reshard;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    for (int s = 0; s < 3; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      auto probe = batch(ctx, {6, 12}, 7, comm.rank(), 100 + s);
      if (probe_with_grad) {
        (void)model(ctx, probe.x);
      } else {
        ag::NoGradGuard no_grad(ctx);
        (void)model(ctx, probe.x);
      }
      model.step(lr_at(s));
    }
    auto full = model.full_params();
    if (comm.rank() == 0) rank0 = module_values(ctx, *net);
  });
  return rank0;
}

}  // namespace

// A unit still gathered at the step held the values from before it: the next forward computed
// with them, and a full_params() scope wrote them back over the step.
TEST_CASE("fsdp: a forward without its backward before a step leaves no unit with old values") {
  for (const bool reshard : {true, false}) {
    CAPTURE(reshard);
    CHECK(dp_test::bitwise_equal(run_with_probe(reshard, true), run_with_probe(reshard, false)));
  }
}

// no_sync switched the groups one by one and threw at the first with a backward open, leaving
// the ones before it switched off for good: every later step was refused. Now it is refused
// before any switches, naming zero_grad(), and training goes on after it.
TEST_CASE("no_sync with a backward open is refused whole, and training goes on after zero_grad") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = Stage::fsdp;
    options.buckets.bucket_bytes = 1024;
    options.fsdp.wrap.unit_paths = {"0", "5"};
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    bool fail = true;
    const auto hook = net->at(3).register_backward_hook([&](nn::Module&, const sk::Tensor&) {
      if (fail) throw sk::InvalidArgument("the hook failed");
    });
    auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
    model.zero_grad();
    CHECK_THROWS_WITH(ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels)),
                      "the hook failed");
    fail = false;
    CHECK_THROWS_WITH_AS((void)model.no_sync(), doctest::Contains("call zero_grad() first"),
                         sk::StateError);
    model.zero_grad();
    CHECK(model.engine().sync_enabled());
    {
      auto accumulate = model.no_sync();
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    }
    ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    CHECK_NOTHROW(model.step(lr_at(0)));
    net->at(3).remove_hook(hook);
  });
}

// A post-step hook that throws used to leave oss/sdp's replicas out of step -- each rank's own
// range updated, the others' ranges not gathered -- in silence. The step's gathers now run
// first, and the hook's error after them.
TEST_CASE("a post-step hook's error leaves the replicas alike under oss and sdp") {
  for (const auto stage : {Stage::oss, Stage::sdp}) {
    CAPTURE(sk::parallel::stage_name(stage));
    std::vector<std::vector<float>> values(2);
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, 100);  // (every rank the same model: replicas)
      sk::parallel::ParallelOptions options;
      options.stage = stage;
      options.buckets.bucket_bytes = 1024;
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                        options);
      model.register_post_step_hook(
          [](sk::parallel::Engine&) { throw sk::InvalidArgument("the post-step hook failed"); });
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, 0, 0);  // (one batch: the batch-norm statistics alike)
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      const auto before = module_values(ctx, *net);
      CHECK_THROWS_WITH(model.step(lr_at(0)), "the post-step hook failed");
      values[static_cast<std::size_t>(comm.rank())] = module_values(ctx, *net);
      CHECK_FALSE(dp_test::bitwise_equal(values[static_cast<std::size_t>(comm.rank())], before));
    });
    CHECK(dp_test::bitwise_equal(values[0], values[1]));
  }
}

// PyTorch's clip_grad_norm_ scales the gradients there and then; ours is applied at the step,
// so a backward between the two would have its gradients scaled by a coefficient measured
// without them. Refused by name; zero_grad() drops the clip.
TEST_CASE("a step after clip_grad_norm and another backward is refused, naming the fix") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 100 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ParallelOptions options;
    options.stage = Stage::sdp;
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options);
    auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
    auto backward = [&] { ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels)); };
    model.zero_grad();
    backward();
    (void)model.clip_grad_norm(1.0);
    backward();
    CHECK_THROWS_WITH_AS(model.step(lr_at(0)),
                         doctest::Contains("after clip_grad_norm and another backward"),
                         sk::StateError);
    model.zero_grad();
    backward();
    backward();
    (void)model.clip_grad_norm(1.0);  // after the last backward: fine
    CHECK_NOTHROW(model.step(lr_at(0)));
  });
}
