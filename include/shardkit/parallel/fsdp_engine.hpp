// FsdpEngine: ZeRO-3 for training loops whose forward and backward the user writes -- the
// Engine (engine.hpp) over one sharded param group per unit: a rank keeps only its 1/N shard of
// each unit's flat parameter (the f32 master), of its gradient and of its optimizer state; one
// sharded optimizer updates every unit's shard.
//
// A custom loop drives it as it drives DataParallel, with gather/release around each use:
//
//   for each unit u in forward order:  engine.gather(u); ...forward with engine.param(i)...;
//                                       engine.release_after_forward(u);  // reshard
//   for each unit u in backward order: engine.gather(u); ...backward: add into engine.grad(i),
//                                       engine.ready(i)...; engine.release(u);
//   engine.finish(); engine.step(lr); engine.zero_grad();
//
// start_gather(u) begins a unit's all-gather without waiting (prefetch); gather(u) waits for
// it. release_after_forward(u) is release(u) but, with hpZ (options.fsdp.reshard_group_size),
// keeps this rank's slice over its node so that u's next gather stays inside the node. A unit's
// gradients are reduce-scattered bucket by bucket as they become ready (averaged, added into the
// rank's gradient shard); the full-gradient buckets are transient (MemoryCategory::communication)
// and freed once reduced; buckets smaller than options.fsdp.coalesce_bytes, of any unit, go out
// together. Accumulation: synchronised backwards add each one's average into the shard (A +
// avg(g)); no_sync() keeps full local gradients (the whole model's f32 gradients on every rank) and
// reduces their sum once.
//
// Mixed precision (options.precision): each rank keeps its shard of the compute copy (f16 /
// bf16) and the optimizer the f32 master of it; units are gathered in the compute dtype,
// gradients kept in it and reduce-scattered in reduce_dtype; the fused step updates the
// master and writes the rounded shard. full_params() is then for reading (writes would not
// reach the masters): set values with set_full_params.
//
// CPU offload (options.offload, offload.hpp): `optimizer` puts the master, the optimizer state
// and the step on host_context(); `params` also keeps each unit's parameter shard there, sent
// up into the gathered buffer at each gather, so between uses the device holds no parameters.
#pragma once

#include <utility>
#include <vector>

#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/policy.hpp"

namespace shardkit::parallel {

// One unit: a name (for messages; a module path under ShardedModule) and its parameters, all
// trainable (frozen parameters stay outside FSDP units: whole on every rank).
using FsdpUnitParams = ParamGroupSpec;

class FsdpEngine : public Engine {
 public:
  // options.stage must be fsdp (what this engine runs).
  FsdpEngine(Context& ctx, comm::Communicator& comm, std::vector<FsdpUnitParams> units,
             optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : Engine(ctx, comm, nullptr, std::move(units), std::move(optimizer), checked(options)) {}

  // Hybrid sharding (PyTorch's HYBRID_SHARD): each unit is sharded inside the mesh's group and
  // replicated across groups; gathers stay inside the group, and only each shard's gradient
  // all-reduce crosses groups (comm/hybrid_mesh.hpp). The mesh must outlive the engine.
  FsdpEngine(Context& ctx, const comm::HybridMesh& mesh, std::vector<FsdpUnitParams> units,
             optim::OptimizerConfig optimizer, const ParallelOptions& options)
      : Engine(ctx, mesh.shard(), mesh.replicate(), std::move(units), std::move(optimizer),
               checked(options)) {}

 private:
  static ResolvedPolicy checked(const ParallelOptions& options) {
    check(options.stage == Stage::fsdp, "FsdpEngine runs fsdp (ZeRO-3), but options.stage is ",
          stage_name(options.stage),
          "; set options.stage = Stage::fsdp, or use DataParallel for ddp, oss and sdp");
    return resolve(options);
  }
};

}  // namespace shardkit::parallel
