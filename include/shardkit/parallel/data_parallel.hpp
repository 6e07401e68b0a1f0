// DataParallel: DDP, OSS (ZeRO-1) and SDP (ZeRO-2) for training loops whose forward and
// backward the user writes -- the Engine (engine.hpp) over one param group of every parameter.
// The user reads parameters from param(i), adds each gradient into grad(i) and calls ready(i)
// from the backward; finish() waits for the communication; step() updates the parameters.
// Results equal DDP's; memory per rank follows the ZeRO stage:
//
//   ddp: full gradients, averaged in buckets (all-reduce); every rank steps every parameter.
//   oss: as ddp, but optimizer state only for the rank's range; owners update it and the
//        parameters are re-assembled with one all_gather_v (optionally f16 on the wire, while
//        the owner's f32 master stays exact -- FairScale rounds it; we do not).
//   sdp: gradients reduced to their owners (reduce_scatter_v per bucket); a rank keeps only its
//        range's gradients plus transient bucket buffers; then as oss.
//
// Options: ParallelOptions (options.hpp), resolved once (policy.hpp). Mixed precision
// (options.precision): param(i) is the f16/bf16 compute copy, whole on every rank; gradients
// are kept in it and reduced in reduce_dtype; the f32 master lives in the optimizer for the
// pieces this rank updates, and after a step the owners' rounded copies are all-gathered in the
// compute dtype. Initialise with set_full_params (exact f32 masters). CPU offload
// (options.offload.optimizer): the optimizer's master, state and step live on host_context();
// results are the same bits on the CPU path.
#pragma once

#include <utility>
#include <vector>

#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/policy.hpp"

namespace shardkit::parallel {

class DataParallel : public Engine {
 public:
  DataParallel(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
               optim::OptimizerConfig optimizer, const ParallelOptions& options = {})
      : Engine(ctx, comm, nullptr, {ParamGroupSpec{"model", specs}}, std::move(optimizer),
               checked(options)) {}

  // Hybrid sharding: oss and sdp shard inside the mesh's groups and replicate across them
  // (comm/hybrid_mesh.hpp); ddp reduces in two levels. The mesh must outlive the engine.
  DataParallel(Context& ctx, const comm::HybridMesh& mesh,
               const std::vector<shard::ParamSpec>& specs, optim::OptimizerConfig optimizer,
               const ParallelOptions& options = {})
      : Engine(ctx, mesh.shard(), mesh.replicate(), {ParamGroupSpec{"model", specs}},
               std::move(optimizer), checked(options)) {}

  // The one group's plan and buffer.
  const shard::ShardPlan& plan() const { return group(0).plan(); }
  const FlatBuffer& params() const { return group(0).flat().params(); }

 private:
  static ResolvedPolicy checked(const ParallelOptions& options) {
    check(options.stage != Stage::fsdp,
          "DataParallel runs ddp, oss and sdp; for fsdp (ZeRO-3) "
          "use parallel::FsdpEngine (custom loops) or ShardedModule with Stage::fsdp");
    return resolve(options);
  }
};

}  // namespace shardkit::parallel
