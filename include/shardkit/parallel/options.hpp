// ParallelOptions: everything a user chooses about how a model's states are sharded and how
// they travel, given once -- to DataParallel, FsdpEngine or ShardedModule, and to the memory
// planner -- and settled once by resolve() (policy.hpp) into what those execute. Plain data: the
// names follow PyTorch FSDP and FairScale where they have one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/ops/quantize.hpp"
#include "shardkit/parallel/mixed_precision.hpp"
#include "shardkit/parallel/offload.hpp"
#include "shardkit/parallel/stage.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

// Gradient buckets: gradients go out in buckets of about bucket_bytes, in the backward's order,
// as soon as each is complete; launching one more first waits for the oldest when
// max_in_flight are out (which bounds SDP's and FSDP's transient memory to about
// (max_in_flight + the buckets being filled) x bucket_bytes).
struct BucketOptions {
  std::size_t bucket_bytes = std::size_t{25} << 20;  // PyTorch DDP's 25 MiB
  int max_in_flight = 2;
};

// FSDP's units from a module tree (ShardedModule): explicit module paths, or by size
// (FairScale's / PyTorch's size_based_auto_wrap_policy); fsdp_units.hpp applies it.
struct FsdpWrapPolicy {
  std::vector<std::string> unit_paths;  // explicit units ("layer1.0", "layer1.1", ...)
  std::int64_t min_num_params = 0;      // auto-wrap threshold (0: off)
};

// Small units' gradient buckets are held until this many bytes go out together; held buckets
// and the staging copy cost up to twice this in transient memory, so the default is smaller
// than FairScale's bucket_cap_mb (25): it gathers the tiny units (norms, biases, heads) whose
// collectives are all latency, and leaves units of megabytes alone.
inline constexpr std::size_t kDefaultCoalesceBytes = std::size_t{4} << 20;

struct FsdpOptions {
  FsdpWrapPolicy wrap;  // ShardedModule: which modules become units
  bool reshard_after_forward =
      true;  // free a unit after its forward (gather it again for backward)
  // hpZ (DeepSpeed ZeRO++'s zero_hpz_partition_size, FSDP2's integer reshard_after_forward):
  // after a training forward each rank keeps its 1/G slice of the unit over groups of G
  // consecutive ranks (a node, as launchers place ranks), so the backward's all-gather stays
  // inside the group. Costs Psi/G of the compute dtype per rank between forward and backward.
  // 0: off (the backward gathers over every rank). G must divide the world size.
  int reshard_group_size = 0;
  // Units gathered ahead, forward and backward (0: none). With the shards on disk (offload to
  // NVMe) the shard of the unit after them is read ahead too.
  int prefetch = 1;
  // FairScale's bucket_cap_mb: gradient buckets smaller than this, of any unit, are
  // reduce-scattered together up to this size (one collective for many small units); 0 sends
  // each bucket alone.
  std::size_t coalesce_bytes = kDefaultCoalesceBytes;
  // qwZ (DeepSpeed ZeRO++'s zero_quantized_weights): the parameters' all-gathers for the
  // forward and the backward carry each rank's shard as int8 blocks of `quantization_block`
  // values with an f32 scale each (ops/quantize.hpp; about a quarter of f32's bytes, half of
  // bf16's). The shards, the f32 masters and the optimizer stay exact, so the error never
  // builds up; the forward and backward compute with each value within half its block's step.
  // full_params() (summon_full_params) and checkpoints see exact values.
  bool quantized_weights = false;
  // The gathers' codes: int8 (qwZ's), or FP8 E4M3 (FSDP2's float8 all-gather; a float code
  // keeps a block's small values relative to themselves: |x - x'| <= max(|x| / 16, scale / 1024)
  // against int8's scale / 2), or int4 (half int8's bytes, a step 18 times as coarse; an even
  // block), with an f32 scale per block either way.
  ops::QuantFormat quantized_weights_format = ops::QuantFormat::int8;
  // What a gather's scale covers: a block of quantization_block values (the default), or with
  // f8_e4m3 a whole tensor, as FSDP2's float8 all-gather scales: each rank's |x| maxima of its
  // pieces all-reduced (max) into every tensor's before the gather, the wire then carrying the
  // codes alone (a quarter of f32's bytes, no scales), each value within 1/16 of itself down to
  // the subnormal step amax / 448 / 512 of its tensor.
  ops::QuantScale quantized_weights_scale = ops::QuantScale::block;
  // qgZ (DeepSpeed ZeRO++'s zero_quantized_gradients): the gradients' reduce-scatter becomes an
  // all-to-all of blocks of codes (the same block size), dequantised and summed in f32 by each
  // owner (parallel/quantized_reduce_scatter.hpp): about a quarter of an f32 wire's bytes as
  // int8, an eighth as int4. The reduced gradients are within half a block's step per rank of
  // the exact average (int4's step: amax / 7, int8's amax / 127).
  bool quantized_grads = false;
  // The reduce-scatter's codes: int8, int4 (ZeRO++'s gradient width; the block must then be
  // even), or f8_e4m3.
  ops::QuantFormat quantized_grads_format = ops::QuantFormat::int8;
  // With quantized_grads: each rank keeps what quantisation dropped from its gradients and
  // adds it to the next step's (error feedback), at the cost of an f32 copy of its whole
  // gradient buffer -- under hybrid sharding with quantized_grads_across_groups, at both
  // levels: also an f32 copy of its reduced part (1/G of it) and of the segment of that it
  // owns across the R replicas (1/(G·R)), for the exchange across groups.
  bool grad_error_feedback = false;
  // With quantized_grads under hybrid sharding: the gradients' exchange across groups (the
  // inter-node level, where bandwidth is scarcest) is quantised too, as ZeRO++'s hierarchical
  // qgZ does -- a reduce-scatter of codes across the replicas, then an all-gather of codes
  // (parallel/replica_sync.hpp): about a quarter of the f32 all-reduce's bytes as int8, within
  // half a block's step per replica plus half of the average's. false keeps that level exact.
  bool quantized_grads_across_groups = true;
  std::int64_t quantization_block = ops::kDefaultQuantBlock;  // values per scale, both
};

struct ParallelOptions {
  Stage stage = Stage::ddp;  // ddp, oss (ZeRO-1), sdp (ZeRO-2), fsdp (ZeRO-3): stage.hpp
  // ddp/oss/sdp: the even flat split (padded, FSDP-style) holds exactly 1/N of the state on
  // every rank; greedy keeps whole parameters per rank (FairScale's OSS) at a cost on the most
  // loaded. fsdp always splits evenly.
  shard::PartitionKind partition = shard::PartitionKind::flat;
  BucketOptions buckets;
  // Mixed precision (mixed_precision.hpp): the compute copy's dtype and what gradients travel
  // in (reduce_dtype; in f32 training f16 / bf16 halves the traffic, rounded on the wire only).
  MixedPrecision precision;
  OffloadOptions offload;         // the optimizer (and fsdp's parameter shards) on the host
  bool broadcast_fp16 = false;    // oss/sdp in f32: updated parameters travel as f16
  bool broadcast_buffers = true;  // ShardedModule: rank 0's buffers before each training forward
  FsdpOptions fsdp;
};

}  // namespace shardkit::parallel
