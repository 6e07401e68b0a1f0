// The policy a run executes: ParallelOptions (options.hpp) checked once and every derived choice
// made once -- how the parameters reside, how gradients are reduced and in which dtypes, how
// big a bucket is. The engines execute it and the memory planner reads it, so the plan cannot
// drift from what runs.
//
//   stage  residency    gradients        updates               after the step
//   ddp    replicated   all-reduce       every rank, all       --
//   oss    replicated   all-reduce       owners, their range   owners' ranges all-gathered
//   sdp    replicated   reduce-scatter   owners, their range   owners' ranges all-gathered
//   fsdp   sharded      reduce-scatter   owners, their shard   -- (gathered at the next use)
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/parallel/options.hpp"

namespace shardkit::parallel {

// Where a group's parameters live: whole on every rank, or a 1/N shard per rank that is
// gathered around its use (flat_param.hpp).
enum class Residency { replicated, sharded };

// How a bucket of gradients is reduced (grad_bucketer.hpp): averaged in place on every rank, or
// averaged into each owner's part.
enum class GradSync { all_reduce, reduce_scatter };

// How gradients are bucketed and sent: what the bucketer and the coalescer run on.
struct BucketPolicy {
  std::int64_t capacity = 0;  // elements per bucket (bucket_bytes over 4)
  int max_in_flight = 2;
  DType grad_dtype = DType::f32;  // gradients as autograd forms them: the compute dtype
  DType wire_dtype = DType::f32;  // what they travel in: precision.reduce_dtype
  // fsdp with quantized_grads: reduce-scatters travel as blocks of this many values (0:
  // wire_dtype, exact) of quantized_format's codes, with or without error feedback.
  std::int64_t quantized_block = 0;
  ops::QuantFormat quantized_format = ops::QuantFormat::int8;
  bool error_feedback = false;
  // Under hybrid sharding with quantized_block: the exchange across groups quantised too.
  bool quantized_across_groups = false;
};

struct ResolvedPolicy {
  Stage stage = Stage::ddp;
  Residency residency = Residency::replicated;
  shard::PartitionKind partition = shard::PartitionKind::flat;
  GradSync grad_sync = GradSync::all_reduce;
  bool every_rank_updates = true;  // ddp: a replicated piece table, every parameter everywhere
  bool gather_after_step = false;  // oss/sdp: the owners' updated ranges all-gathered
  DType param_dtype = DType::f32;  // the compute copy (the flat buffers' dtype)
  BucketPolicy buckets;
  std::size_t coalesce_bytes = 0;  // fsdp: small buckets reduce-scattered together (0: alone)
  bool reshard_after_forward = true;
  int reshard_group = 0;  // fsdp with hpZ: the secondary shard's group size (0: none)
  int prefetch = 1;
  // fsdp with quantized_weights: the training gathers carry int8 blocks of this many values
  // (0: the compute dtype, exact).
  std::int64_t quantized_gather_block = 0;
  ops::QuantFormat quantized_gather_format = ops::QuantFormat::int8;  // its codes
  ops::QuantScale quantized_gather_scale = ops::QuantScale::block;    // and its scales
  OffloadOptions offload;
  bool broadcast_fp16 = false;
  bool broadcast_buffers = true;
  FsdpWrapPolicy wrap;
  bool mixed_precision() const { return param_dtype != DType::f32; }
};

// Checks `options` and settles every choice; throws naming the option, its value and the fix.
inline ResolvedPolicy resolve(const ParallelOptions& options) {
  validate(options.precision);
  validate(options.offload, options.stage);
  const auto& buckets = options.buckets;
  check(buckets.bucket_bytes > 0, "bucket size is 0 bytes; pass a positive size (PyTorch DDP ",
        "uses 25 MiB, FairScale SDP 2^23 elements)");
  check(buckets.max_in_flight >= 1, "buckets.max_in_flight is ", buckets.max_in_flight,
        "; allow at least one bucket in flight");
  check(options.fsdp.prefetch >= 0, "FSDP prefetch depth ", options.fsdp.prefetch, " must be >= 0");
  check(!options.broadcast_fp16 || !options.precision.enabled(),
        "broadcast_fp16 is for f32 training; under mixed precision the parameters already travel "
        "in ",
        dtype_name(options.precision.param_dtype));
  const bool fsdp = options.stage == Stage::fsdp;
  check(!fsdp || options.partition == shard::PartitionKind::flat,
        "sharded parameters (fsdp) use the even flat split; got the ",
        shard::partition_kind_name(options.partition), " partition");
  const FsdpOptions& f = options.fsdp;
  check(!f.grad_error_feedback || f.quantized_grads,
        "fsdp.grad_error_feedback carries the quantisation error of the gradients' wire, but "
        "fsdp.quantized_grads is off; turn quantized_grads on, or leave error feedback off");
  if (f.quantized_grads)
    check(fsdp, "fsdp.quantized_grads quantises fsdp's (ZeRO-3's) gradient reduce-scatter; stage ",
          stage_name(options.stage), " does not run it: use Stage::fsdp, or leave it off");
  if (f.quantized_weights || f.quantized_grads)
    check(f.quantization_block >= 1 && f.quantization_block <= ops::kMaxQuantBlock,
          "fsdp.quantization_block is ", f.quantization_block,
          "; pass 1 to 2^24 values per scale (DeepSpeed's ZeRO++ uses ", ops::kDefaultQuantBlock,
          ")");
  for (const auto& [on, format, key] :
       {std::tuple{f.quantized_weights, f.quantized_weights_format, "quantized_weights_format"},
        std::tuple{f.quantized_grads, f.quantized_grads_format, "quantized_grads_format"}})
    check(!on || ops::quant_block_fits(format, f.quantization_block), "fsdp.quantization_block is ",
          f.quantization_block, " with fsdp.", key, " ", ops::quant_format_name(format),
          ", which packs two codes to a byte (a block must start on one): pass an even block");
  if (f.quantized_weights) {
    check(fsdp, "fsdp.quantized_weights quantises the parameters' all-gathers, which only fsdp ",
          "(ZeRO-3) makes; stage ", stage_name(options.stage),
          " keeps whole parameters on every rank: use Stage::fsdp, or leave it off");
    check(!options.offload.params,
          "fsdp.quantized_weights with offload.params: the shards live on the host, where the "
          "gather would have to quantise them; keep the shards on the device (offload.params = "
          "false) or gather exactly (quantized_weights = false)");
  }
  if (f.quantized_weights_scale == ops::QuantScale::tensor) {
    check(f.quantized_weights,
          "fsdp.quantized_weights_scale is tensor, but fsdp.quantized_weights is off: turn "
          "quantized_weights on (with quantized_weights_format f8_e4m3), or leave the scale at "
          "block");
    check(f.quantized_weights_format == ops::QuantFormat::f8_e4m3,
          "fsdp.quantized_weights_scale tensor with fsdp.quantized_weights_format ",
          ops::quant_format_name(f.quantized_weights_format),
          ": one scale per tensor suits a floating code, which keeps small values relative; "
          "int8's and int4's uniform steps would flush a tensor's small values to 0 -- use "
          "f8_e4m3, or scale per block");
  }
  if (f.reshard_group_size != 0) {
    check(fsdp, "fsdp.reshard_group_size keeps a unit sharded over a node after fsdp's (ZeRO-3's) ",
          "forward; stage ", stage_name(options.stage),
          " keeps whole parameters on every rank: use Stage::fsdp, or leave it 0");
    check(f.reshard_group_size >= 2, "fsdp.reshard_group_size is ", f.reshard_group_size,
          "; pass the ranks of a node (>= 2), or 0 for none (to keep the whole unit between "
          "forward and backward, set reshard_after_forward = false)");
    check(f.reshard_after_forward,
          "fsdp.reshard_group_size reshards after the forward, but reshard_after_forward is "
          "false (the unit stays whole until its backward); turn one of them off");
  }
  ResolvedPolicy p;
  p.stage = options.stage;
  p.residency = fsdp ? Residency::sharded : Residency::replicated;
  p.partition = options.partition;
  p.grad_sync =
      options.stage == Stage::sdp || fsdp ? GradSync::reduce_scatter : GradSync::all_reduce;
  p.every_rank_updates = options.stage == Stage::ddp;
  p.gather_after_step = options.stage == Stage::oss || options.stage == Stage::sdp;
  p.param_dtype = options.precision.param_dtype;
  p.buckets.capacity =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(buckets.bucket_bytes / 4));
  p.buckets.max_in_flight = buckets.max_in_flight;
  p.buckets.grad_dtype = options.precision.param_dtype;
  p.buckets.wire_dtype = options.precision.reduce_dtype;
  p.buckets.quantized_block = fsdp && f.quantized_grads ? f.quantization_block : 0;
  p.buckets.quantized_format = f.quantized_grads_format;
  p.buckets.error_feedback = fsdp && f.quantized_grads && f.grad_error_feedback;
  p.buckets.quantized_across_groups = fsdp && f.quantized_grads && f.quantized_grads_across_groups;
  p.coalesce_bytes = fsdp ? options.fsdp.coalesce_bytes : 0;
  p.reshard_after_forward = options.fsdp.reshard_after_forward;
  p.reshard_group = fsdp ? f.reshard_group_size : 0;
  p.prefetch = options.fsdp.prefetch;
  p.quantized_gather_block = fsdp && f.quantized_weights ? f.quantization_block : 0;
  p.quantized_gather_format = f.quantized_weights_format;
  p.quantized_gather_scale = f.quantized_weights_scale;
  p.offload = options.offload;
  p.broadcast_fp16 = options.broadcast_fp16 && options.stage != Stage::ddp;
  p.broadcast_buffers = options.broadcast_buffers;
  p.wrap = options.fsdp.wrap;
  return p;
}

}  // namespace shardkit::parallel
