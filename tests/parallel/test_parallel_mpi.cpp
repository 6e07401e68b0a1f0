// The stages through MPI with real processes (meson runs it with mpirun -np 4): after 20 steps
// OSS and SDP parameters equal DDP's on every rank; hybrid sharding over 2 "nodes" of 2
// processes equals DDP; FSDP over a module equals DDP; a sharded checkpoint written by 4
// processes under FSDP loads under SDP. Part of test_parallel, whose main (doctest_mpi_main.cpp)
// runs these cases when mpirun started it, and the rest when run alone.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/comm/mpi_communicator.hpp"
#include "shardkit/core/mpi_check.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using sk::parallel::Stage;

// Inside a namespace of its own: this file is compiled in one unit with the layer's other
// tests (a unity build), whose anonymous namespaces would otherwise meet this one's.
namespace parallel_mpi_cases {

TEST_SUITE_BEGIN("mpi");

namespace {

std::vector<sk::shard::ParamSpec> specs() {
  return {{"a.weight", {33, 17}}, {"a.bias", {33}}, {"b.weight", {7, 33}},
          {"b.bias", {7}},        {"c", {129}},     {"d", {1}}};
}

std::vector<float> train(Stage stage, sk::optim::OptimizerKind kind,
                         sk::shard::PartitionKind partition) {
  sk::Context ctx;
  auto comm = sk::comm::MpiCommunicator::world(ctx);
  sk::optim::OptimizerConfig config;
  config.kind = kind;
  config.sgd.momentum = 0.9f;
  config.sgd.weight_decay = 1e-4f;
  config.larc.trust_coefficient = 0.001f;
  config.larc.clip = false;
  config.adam.weight_decay = 0.01f;
  sk::parallel::ParallelOptions options;
  options.stage = stage;
  options.partition = partition;
  options.buckets.bucket_bytes = 1024;
  sk::parallel::DataParallel dp(ctx, *comm, specs(), config, options);
  ctx.manual_seed(static_cast<std::uint64_t>(comm->rank()) + 5);  // different on every rank
  for (std::size_t i = 0; i < dp.params().size(); ++i) sk::uniform_(ctx, dp.param(i), -0.5, 0.5);
  dp.broadcast_parameters(0);
  for (int step = 0; step < 20; ++step) {
    dp.zero_grad();
    for (std::size_t i = dp.params().size(); i-- > 0;) {
      sk::Context noise_ctx({.seed = 7919ull * static_cast<std::uint64_t>(step) +
                                     104729ull * static_cast<std::uint64_t>(comm->rank()) + i});
      auto noise = sk::empty(noise_ctx, dp.param(i).shape(), sk::DType::f32);
      sk::normal_(noise_ctx, noise, 0.0, 1.0);
      const auto g = dp.grad(i);
      for (std::int64_t e = 0; e < g.numel(); ++e)
        g.data<float>()[e] += 0.5f * dp.param(i).data<float>()[e] + noise.data<float>()[e];
      dp.ready(i);
    }
    dp.finish();
    dp.step(kind == sk::optim::OptimizerKind::larc_sgd ? 0.5f : 0.05f);
  }
  std::vector<float> out;
  for (std::size_t i = 0; i < dp.params().size(); ++i) {
    const auto v = sk::to_vector<float>(ctx, dp.param(i));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) /
                                std::max(1e-3, std::fabs(static_cast<double>(b[i]))));
  return worst;
}

}  // namespace

TEST_CASE("through MPI, OSS and SDP equal DDP after 20 steps") {
  for (auto kind : {sk::optim::OptimizerKind::sgd, sk::optim::OptimizerKind::larc_sgd,
                    sk::optim::OptimizerKind::adamw})
    for (auto partition : {sk::shard::PartitionKind::greedy, sk::shard::PartitionKind::flat}) {
      const auto ddp = train(Stage::ddp, kind, partition);
      for (auto stage : {Stage::oss, Stage::sdp}) {
        const auto sharded = train(stage, kind, partition);
        REQUIRE(sharded.size() == ddp.size());
        // MPI may sum an all-reduce and a reduce-scatter in different orders: equal up to f32
        // rounding, not necessarily bit for bit.
        CHECK_MESSAGE(max_relative_difference(sharded, ddp) <= 1e-5,
                      sk::optim::optimizer_kind_name(kind), " ", sk::parallel::stage_name(stage));
      }
      // And every rank holds the same parameters as rank 0.
      std::vector<float> root = ddp;
      sk::Context ctx;
      auto comm = sk::comm::MpiCommunicator::world(ctx);
      comm->broadcast(root, 0).wait();
      CHECK(std::memcmp(root.data(), ddp.data(), ddp.size() * sizeof(float)) == 0);
    }
}

namespace {

// 12 steps of `stage` over MPI with gradients rounded to multiples of 2^-10 (their sums are
// exact in any order), on a hybrid mesh of groups of `group` processes (0: none).
std::vector<float> train_exact(Stage stage, int group) {
  sk::Context ctx;
  auto world = sk::comm::MpiCommunicator::world(ctx);
  std::unique_ptr<sk::comm::HybridMesh> mesh;
  if (group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(*world, group);
  const auto config = dp_test::config_for(sk::optim::OptimizerKind::larc_sgd);
  sk::parallel::ParallelOptions options;
  options.stage = stage;
  options.partition = sk::shard::PartitionKind::flat;
  options.buckets.bucket_bytes = 1024;
  auto dp =
      mesh ? std::make_unique<sk::parallel::DataParallel>(ctx, *mesh, specs(), config, options)
           : std::make_unique<sk::parallel::DataParallel>(ctx, *world, specs(), config, options);
  dp->set_full_params([&](std::size_t i, const sk::Tensor& view) {
    sk::Context host({.seed = 77ull + i});
    sk::uniform_(host, view, -0.5, 0.5);
  });
  for (int step = 0; step < 12; ++step) {
    dp->zero_grad();
    for (std::size_t i = dp->params().size(); i-- > 0;) {
      sk::Context noise_ctx({.seed = 7919ull * static_cast<std::uint64_t>(step) +
                                     104729ull * static_cast<std::uint64_t>(world->rank()) + i});
      auto noise = sk::empty(noise_ctx, dp->param(i).shape(), sk::DType::f32);
      sk::normal_(noise_ctx, noise, 0.0, 1.0);
      const auto g = dp->grad(i);
      for (std::int64_t e = 0; e < g.numel(); ++e) {
        const float v = 0.5f * dp->param(i).data<float>()[e] + noise.data<float>()[e];
        g.data<float>()[e] = std::ldexp(std::nearbyint(std::ldexp(v, 10)), -10);
      }
      dp->ready(i);
    }
    dp->finish();
    dp->step(dp_test::lr_at(sk::optim::OptimizerKind::larc_sgd, step));
  }
  std::vector<float> out;
  for (std::size_t i = 0; i < dp->params().size(); ++i) {
    const auto v = sk::to_vector<float>(ctx, dp->param(i));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

}  // namespace

TEST_CASE("through MPI, 4 processes as 2 nodes: hybrid OSS and SDP equal DDP bitwise") {
  const auto ddp = train_exact(Stage::ddp, 0);
  for (auto stage : {Stage::oss, Stage::sdp}) {
    const auto hybrid = train_exact(stage, 2);
    REQUIRE(hybrid.size() == ddp.size());
    CHECK_MESSAGE(std::memcmp(hybrid.data(), ddp.data(), ddp.size() * sizeof(float)) == 0,
                  sk::parallel::stage_name(stage));
  }
}

namespace {

// A module trained under `stage` over MPI: every rank's view of the parameters and buffers
// afterwards (gathered under fsdp). With `save_to` / `load_from`: a sharded checkpoint after
// (before) training.
// `quantized`: the gathers carry quantised blocks (qwZ), the gradients' reduce-scatter too (qgZ),
// each in its format; with `group` > 0 the world is a hybrid mesh of groups of that many
// processes ("nodes").
struct Quantized {
  bool weights = false, grads = false;
  sk::ops::QuantFormat weights_format = sk::ops::QuantFormat::int8;
  sk::ops::QuantFormat grads_format = sk::ops::QuantFormat::int8;
  bool error_feedback = false;  // qgZ's, at every quantised level
};
std::vector<float> train_module(Stage stage, sk::optim::OptimizerKind kind, int steps,
                                const std::string& save_to = {}, const std::string& load_from = {},
                                Quantized quantized = {}, int group = 0, int node = 0) {
  sk::Context ctx;
  auto comm = sk::comm::MpiCommunicator::world(ctx);
  std::unique_ptr<sk::comm::HybridMesh> mesh;
  if (group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(*comm, group);
  auto net = module_test::mlp(ctx, 300 + static_cast<std::uint64_t>(comm->rank()));
  sk::parallel::ParallelOptions options;
  options.stage = stage;
  options.buckets.bucket_bytes = 4096;
  options.fsdp.wrap.unit_paths = {"0", "3"};
  options.fsdp.quantized_weights = quantized.weights;
  options.fsdp.quantized_grads = quantized.grads;
  options.fsdp.quantized_weights_format = quantized.weights_format;
  options.fsdp.quantized_grads_format = quantized.grads_format;
  options.fsdp.grad_error_feedback = quantized.error_feedback;
  options.fsdp.reshard_group_size = node;
  auto model_on = [&] {
    return mesh ? std::make_unique<sk::parallel::ShardedModule>(ctx, *mesh, net,
                                                                dp_test::config_for(kind), options)
                : std::make_unique<sk::parallel::ShardedModule>(ctx, *comm, net,
                                                                dp_test::config_for(kind), options);
  };
  auto owned = model_on();
  sk::parallel::ShardedModule& model = *owned;
  if (!load_from.empty()) (void)sk::checkpoint::load_checkpoint(load_from, model.training_state());
  for (int s = 0; s < steps; ++s) {
    model.zero_grad();
    auto b = module_test::batch(ctx, {6, 12}, 7, comm->rank(), s);
    sk::autograd::backward(ctx, sk::autograd::cross_entropy(ctx, model(ctx, b.x), b.labels));
    model.step(dp_test::lr_at(kind, s));
  }
  if (!save_to.empty()) {
    sk::checkpoint::CheckpointOptions o;
    o.layout = sk::checkpoint::CheckpointLayout::sharded;
    sk::checkpoint::save_checkpoint(save_to, model.training_state(), o);
  }
  if (stage != Stage::fsdp) return module_test::module_values(ctx, *net);
  auto full = model.full_params();
  return module_test::module_values(ctx, *net);
}

int world_rank() {
  int rank = 0;
  SK_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

// How many parameter elements module_test's MLP has (the values before its buffers).
std::size_t mlp_param_count() {
  sk::Context host;
  std::size_t params = 0;
  for (const auto& p : module_test::mlp(host, 1)->parameters())
    params += static_cast<std::size_t>(p.numel());
  return params;
}

// A scratch folder every process agrees on (rank 0 makes it, its path is broadcast).
std::string shared_scratch() {
  char path[512] = {};
  int rank = 0;
  SK_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  if (rank == 0) {
    std::string pattern = (std::filesystem::temp_directory_path() / "shardkit_mpi_XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    std::strncpy(path, pattern.c_str(), sizeof path - 1);
  }
  SK_MPI_CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD));
  return path;
}

}  // namespace

TEST_CASE(
    "through MPI, FSDP over a module equals DDP, and its sharded checkpoint loads under SDP") {
  for (auto kind : {sk::optim::OptimizerKind::sgd, sk::optim::OptimizerKind::larc_sgd,
                    sk::optim::OptimizerKind::adamw}) {
    const auto ddp = train_module(Stage::ddp, kind, 10);
    const auto fsdp = train_module(Stage::fsdp, kind, 10);
    REQUIRE(fsdp.size() == ddp.size());
    CHECK_MESSAGE(max_relative_difference(fsdp, ddp) <= 1e-5, sk::optim::optimizer_kind_name(kind));
  }
  const auto dir = shared_scratch();
  const auto kind = sk::optim::OptimizerKind::adamw;
  const auto saved = train_module(Stage::fsdp, kind, 4, dir);
  const auto loaded = train_module(Stage::sdp, kind, 0, {}, dir);
  const int rank = world_rank();
  // Parameters agree on every rank; the batch-norm statistics are rank 0's in the checkpoint
  // (each rank's last forward updated its own: DDP's broadcast_buffers semantics).
  const std::size_t compared = rank == 0 ? saved.size() : mlp_param_count();
  REQUIRE(loaded.size() == saved.size());
  CHECK(std::memcmp(saved.data(), loaded.data(), compared * sizeof(float)) == 0);
  SK_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  if (rank == 0) std::filesystem::remove_all(dir);
}

// qwZ and qgZ through MPI: the gathers and the gradients' all-to-all move quantised bytes
// between processes (MPI_UINT8_T) -- int8, int4 (two codes to a byte) and E4M3 gathers -- on the
// world and on 2 "nodes" of 2 (hybrid: gathered and reduced inside a node, the reduced shard
// exchanged across nodes in the gradients' codes too), also with error feedback; training
// follows exact FSDP closely (int4's 16 levels less closely), and every process ends with the
// same parameters.
TEST_CASE(
    "through MPI, 4 processes (also as 2 nodes): FSDP with int8, int4 and E4M3 gathers and "
    "gradients follows exact FSDP") {
  using F = sk::ops::QuantFormat;
  const auto kind = sk::optim::OptimizerKind::sgd;
  const std::size_t params = mlp_param_count();
  for (const Quantized q :
       {Quantized{true, false}, Quantized{false, true}, Quantized{true, true},
        Quantized{false, true, F::int8, F::int4}, Quantized{true, false, F::int4, F::int8},
        Quantized{true, true, F::f8_e4m3, F::int4}, Quantized{false, true, F::int8, F::int8, true},
        Quantized{true, true, F::int8, F::int4, true}})
    for (int group : {0, 2}) {
      CAPTURE(group);
      CAPTURE(q.weights);
      CAPTURE(q.grads);
      CAPTURE(sk::ops::quant_format_name(q.weights_format));
      CAPTURE(sk::ops::quant_format_name(q.grads_format));
      CAPTURE(q.error_feedback);
      const bool coarse =
          (q.weights && q.weights_format == F::int4) || (q.grads && q.grads_format == F::int4);
      const auto exact = train_module(Stage::fsdp, kind, 10, {}, {}, {}, group);
      const auto quantized = train_module(Stage::fsdp, kind, 10, {}, {}, q, group);
      REQUIRE(quantized.size() == exact.size());
      double largest = 0, worst = 0;
      for (std::size_t i = 0; i < params; ++i) {
        largest = std::max(largest, std::fabs(static_cast<double>(exact[i])));
        worst = std::max(worst, std::fabs(static_cast<double>(quantized[i]) - exact[i]));
      }
      CHECK(worst > 0);  // the gathers or the gradients were quantised
      CHECK(worst <= (coarse ? 0.1 : 0.02) * largest);
      // The parameters are the same on every process (rank 0's broadcast to compare).
      std::vector<float> rank0(quantized.begin(), quantized.begin() + static_cast<long>(params));
      SK_MPI_CHECK(MPI_Bcast(rank0.data(), static_cast<int>(params), MPI_FLOAT, 0, MPI_COMM_WORLD));
      CHECK(std::memcmp(rank0.data(), quantized.data(), params * sizeof(float)) == 0);
    }
}

// hpZ through MPI: 4 processes as 2 nodes of 2; the backward gathers inside each node from the
// slices kept after the forward, and training equals plain FSDP bit for bit (also with qwZ).
TEST_CASE("through MPI, 4 processes as 2 nodes: hpZ's in-node backward gathers change no bit") {
  const auto kind = sk::optim::OptimizerKind::adamw;
  for (const bool weights : {false, true}) {
    CAPTURE(weights);
    const auto everywhere = train_module(Stage::fsdp, kind, 6, {}, {}, {weights, false});
    const auto in_nodes = train_module(Stage::fsdp, kind, 6, {}, {}, {weights, false}, 0, 2);
    REQUIRE(in_nodes.size() == everywhere.size());
    CHECK(std::memcmp(in_nodes.data(), everywhere.data(), in_nodes.size() * sizeof(float)) == 0);
  }
}

TEST_SUITE_END();

}  // namespace parallel_mpi_cases
