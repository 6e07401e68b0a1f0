// Bytes that cross group (node) boundaries per FSDP step, plain FSDP over N ranks against
// hybrid sharding in groups of G, on ResNet-50's 161 parameter tensors (25.6 M, f32) in units
// of 16 tensors; counted by the communicators (comm_stats.hpp: bus bytes, what each rank sends
// in a bandwidth-optimal ring), not computed.
//
// One FSDP step moves, per rank: an all-gather before the forward, another before the backward
// (resharded after the forward) and a reduce-scatter of the gradients. Plain FSDP runs all three
// over the world, so they cross the nodes: 3 Psi (N-1)/N. Hybrid runs them inside the group and
// sends across groups only the shard's gradient all-reduce: 2 (Psi/G) (R-1)/R with R = N/G
// groups -- the point of hybrid sharding, paid for with G instead of N in the memory formula.
//
// With qwZ (FsdpOptions::quantized_weights) both all-gathers carry int8 blocks of 256 values with
// an f32 scale each instead of f32: 2 Psi (1 + 4/256) / 4 (N-1)/N + Psi (N-1)/N in f32 bytes
// of Psi, plus the 16-byte padding of each rank's run per unit. Under hybrid sharding the
// gathers stay inside the group, so qwZ cuts the group's traffic, not what crosses groups.
// With qgZ (FsdpOptions::quantized_grads) the reduce-scatter becomes an all-to-all of the same
// int8 blocks, Psi (1 + 4/256) / 4 (N-1)/N; with both, a step moves 3 Psi (1 + 4/256) / 4
// (N-1)/N, 0.254x plain FSDP's. Under hybrid sharding qgZ also quantises what crosses groups
// (FsdpOptions::quantized_grads_across_groups, on by default; ZeRO++'s hierarchical qgZ): the
// reduced shard's exchange becomes a reduce-scatter and an all-gather of the same int8 blocks,
// 2 (Psi/G) (1 + 4/256) / 4 (R-1)/R instead of the exact all-reduce's 2 (Psi/G) (R-1)/R.
// With hpZ (FsdpOptions::reshard_group_size = G', a node) each rank keeps its slice of a unit
// over the node after the forward and the backward gathers inside the node: what leaves it is
// the forward's gather and the reduce-scatter, 2 Psi (N-1)/N, and with qwZ and qgZ as well
// 2 Psi (1 + 4/256) / 4 (N-1)/N, 0.169x plain FSDP's (ZeRO++'s 0.75M of 3M, per rank).
//
// Usage: hybrid_traffic [world size, default 8]   (ranks are threads of this process)
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "workloads/resnet50_params.hpp"

namespace sk = shardkit;

namespace {

struct Traffic {
  double inter_group = 0;  // bus bytes per rank per step on communicators spanning groups
  double intra_group = 0;  // bus bytes per rank per step inside the group
  double state_bytes = 0;  // rank 0's parameters + gradients + optimizer state after the step
};

std::vector<sk::parallel::FsdpUnitParams> resnet50_units() {
  std::vector<sk::parallel::FsdpUnitParams> units;
  const auto& shapes = sk::workloads::kResNet50Shapes;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    char name[48];
    if (i % 16 == 0) {
      std::snprintf(name, sizeof name, "unit%zu", units.size());
      units.push_back({name, {}});
    }
    std::snprintf(name, sizeof name, "p%zu", i);
    units.back().params.push_back({name, shapes[i].shape()});
  }
  return units;
}

// What travels as int8 blocks: the gathers (qwZ), the gradients (qgZ).
struct Quantized {
  bool weights = false, grads = false;
  bool exact_across = false;  // hybrid qgZ: keep the exchange across groups exact
};

// One measured step of FSDP on `world` ranks; `group` = 0 for plain FSDP over the world;
// `node` > 0: hpZ over nodes of that many ranks (their gathers counted inside the group).
Traffic measure(int world, int group, Quantized quantized = {}, int node = 0) {
  Traffic out;
  sk::comm::RunRanksOptions ranks;
  ranks.cpu_threads_per_rank = 1;
  sk::comm::run_ranks(
      world,
      [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        std::unique_ptr<sk::comm::HybridMesh> mesh;
        if (group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(comm, group);
        sk::optim::OptimizerConfig config;
        config.kind = sk::optim::OptimizerKind::larc_sgd;
        config.sgd.momentum = 0.9f;
        sk::parallel::ParallelOptions options;
        options.stage = sk::parallel::Stage::fsdp;
        options.fsdp.quantized_weights = quantized.weights;
        options.fsdp.quantized_grads = quantized.grads;
        options.fsdp.quantized_grads_across_groups = !quantized.exact_across;
        options.fsdp.reshard_group_size = node;
        using Engine = sk::parallel::FsdpEngine;
        auto engine = mesh ? std::make_unique<Engine>(ctx, *mesh, resnet50_units(), config, options)
                           : std::make_unique<Engine>(ctx, comm, resnet50_units(), config, options);
        sk::comm::Communicator* inter = mesh ? mesh->replicate() : &comm;
        sk::comm::Communicator* intra = mesh ? &mesh->shard() : engine->node();
        if (inter != nullptr) inter->reset_stats();
        if (intra != nullptr) intra->reset_stats();
        const auto units = engine->unit_count();
        for (std::size_t u = 0; u < units; ++u) {  // forward
          engine->gather(u);
          engine->release_after_forward(u);
        }
        engine->zero_grad();
        std::size_t next = engine->param_count();
        for (std::size_t u = units; u-- > 0;) {  // backward
          engine->gather(u);
          while (next > 0 && engine->unit_of(next - 1) == u) {
            --next;
            sk::fill(ctx, engine->grad(next), 1e-3 * static_cast<double>(next + 1));
            engine->ready(next);
          }
          engine->release(u);
        }
        engine->finish();
        engine->step(0.1f);
        if (comm.rank() != 0) return;
        out.inter_group =
            inter != nullptr ? static_cast<double>(inter->stats().total_bus_bytes()) : 0;
        out.intra_group =
            intra != nullptr ? static_cast<double>(intra->stats().total_bus_bytes()) : 0;
        const auto memory = ctx.memory_stats().snapshot();
        out.state_bytes =
            static_cast<double>(memory.current_of(sk::MemoryCategory::parameters) +
                                memory.current_of(sk::MemoryCategory::gradients) +
                                memory.current_of(sk::MemoryCategory::optimizer_state));
      },
      ranks);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 8;
  if (world < 2) {
    std::fprintf(stderr, "hybrid_traffic: the world size must be at least 2, got '%s'\n",
                 argc > 1 ? argv[1] : "");
    return 2;
  }
  const double psi = static_cast<double>(sk::workloads::kResNet50Params) * 4;  // f32 bytes
  const double mb = 1e6;
  std::printf("ResNet-50 (%.1f MB of f32 parameters), FSDP with LARC-SGD, N = %d ranks\n", psi / mb,
              world);
  std::printf("%-28s %14s %14s %14s %14s %12s\n", "sharding", "inter-group MB", "formula MB",
              "intra-group MB", "vs plain", "state MB/rank");
  const double ring = static_cast<double>(world - 1) / world;
  const Traffic plain = measure(world, 0);
  auto row = [&](const char* name, const Traffic& t, double formula) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.3fx", t.inter_group / plain.inter_group);
    char intra[32] = "-";
    if (t.intra_group > 0) std::snprintf(intra, sizeof intra, "%.1f", t.intra_group / mb);
    std::printf("%-28s %14.1f %14.1f %14s %14s %12.1f\n", name, t.inter_group / mb, formula / mb,
                intra, ratio, t.state_bytes / mb);
    std::fflush(stdout);
  };
  row("plain fsdp", plain, 3 * psi * ring);
  // qwZ: the two gathers at 1 + 4/256 bytes a value (of 4), the reduce-scatter in f32.
  const double int8 = (1 + 4.0 / 256) / 4;  // an int8 and its share of a scale, per f32 byte
  row("fsdp + qwZ", measure(world, 0, {true, false}), (2 * int8 + 1) * psi * ring);
  row("fsdp + qgZ", measure(world, 0, {false, true}), (2 + int8) * psi * ring);
  row("fsdp + qwZ + qgZ", measure(world, 0, {true, true}), 3 * int8 * psi * ring);
  // hpZ over nodes of N/2: the backward's gather leaves the world's count for the node's (a
  // node of 2 ranks or more that divides the world: an even world of 4 or more).
  const int node = world / 2;
  char name[48];
  if (node >= 2 && world % node == 0) {
    std::snprintf(name, sizeof name, "fsdp + hpZ(%d)", node);
    row(name, measure(world, 0, {}, node), 2 * psi * ring);
    std::snprintf(name, sizeof name, "fsdp + qwZ+qgZ+hpZ(%d)", node);
    row(name, measure(world, 0, {true, true}, node), 2 * int8 * psi * ring);
  }
  // Small groups hold 3 Psi / G each: at N = 64 the groups under 8 would need tens of GB in
  // this one process (its ranks are threads), so large worlds stop at G = N / 8.
  const int smallest = world > 16 ? world / 8 : 1;
  for (int group = world / 2; group >= smallest; --group) {
    if (world % group != 0) continue;
    const int groups = world / group;
    std::snprintf(name, sizeof name, "hybrid G=%d", group);
    const double across = 2 * psi / group * (groups - 1) / groups;
    row(name, measure(world, group), across);
    if (group == world / 2 && group > 1) {
      std::snprintf(name, sizeof name, "hybrid G=%d + qwZ", group);
      row(name, measure(world, group, {true, false}), across);
      std::snprintf(name, sizeof name, "hybrid G=%d + qwZ+qgZ(group)", group);
      row(name, measure(world, group, {true, true, true}), across);
      std::snprintf(name, sizeof name, "hybrid G=%d + qwZ + qgZ", group);
      row(name, measure(world, group, {true, true}), int8 * across);
    }
  }
  return 0;
}
