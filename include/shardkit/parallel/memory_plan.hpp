// The memory planner: what a training run will hold per rank, before it runs (DeepSpeed's
// estimate_zero3_model_states_mem_needs, extended to every stage, hybrid sharding, mixed
// precision, communication buffers, FSDP's gathered units and activations).
//
// Model states come from the same plans the engines build (ShardPlan, BucketPlan, PieceTable),
// so they are the bytes the allocator will count, padding included, for the most loaded rank:
//
//   parameters       ddp/oss/sdp: the whole flat buffer in the compute dtype; fsdp: the rank's
//                    shard of every unit, plus frozen parameters whole; and the module's
//                    buffers whole (PlannedRun::buffer_bytes)
//   gradients        ddp/oss: every bucket; sdp/fsdp: the rank's parts (compute dtype); with
//                    qgZ's error feedback an f32 residual of every local gradient as well
//                    (and, across hybrid groups, of every reduced one and of the segment of
//                    them this rank owns across the replicas)
//   optimizer state  f32 per element the rank updates: each state buffer (momentum; Adam's two
//                    moments), plus the f32 master under mixed precision
//
// and the transients are bounds (the allocator's peak stays at or under them):
//
//   communication    bucket buffers being filled and in flight (sdp, fsdp), wire copies (qgZ:
//                    the int8 runs out and in, and the f32 sum), the reduce-scatter
//                    coalescer's staging, f16 parameter broadcasts
//   layer gradients  the backward's gradients of one layer's parameters (a convolution's,
//                    linear's or norm's weight and bias), made whole in the gradients category
//                    before they are added into the engine's buckets or parts and dropped: the
//                    largest layer's (parameters whose names differ in the last part only), in
//                    the compute dtype, 1-D ones at 4 bytes (norms' gradients are in their
//                    statistics' f32) -- for a model with one huge tensor (an embedding) as
//                    large as that tensor
//   gathered         fsdp: the full units held at once -- the root unit, and with resharding
//                    after forward the unit in use plus `prefetch` ahead, each with its
//                    int8 wire under qwZ, and under hpZ every unit's slice over the node
//                    (counted by the allocator under communication, reported apart here)
//   activations      a linear profile in the batch size (ActivationProfile): measure it once
//                    per model, input size and checkpointing setting (profile_activations,
//                    which doubles the batch until the growth per sample settles)
//
// and the wrap (ShardedModule's construction), a peak of its own before training: on top of the
// model states, for a model built eagerly the group being filled (fsdp: one unit's whole buffer
// at a time; every stage: an f32 staging copy of it under mixed precision) and its own f32
// parameters, whole until they are bound; for one built under sk::DeferredParameters
// (core/deferred_init.hpp), every parameter with a recipe, only the f32 staging of what a rank
// keeps (under fsdp its shard, when 16-bit on the device).
//
// Hybrid sharding plans with the group size in place of the world size. CPU offload
// (offload.hpp) moves model states from the device's figures to the host's: the optimizer
// state and f32 master (offload.optimizer), with the gradients -- under sdp and fsdp the
// rank's reduced parts themselves, which the device then keeps none of (each bucket's part
// lands in a transient buffer and comes down as the bucket completes; qgZ's residuals stay
// on the device); under ddp and oss a staging copy of the rank's pieces -- and, under mixed
// precision, the rounded copy on its way up; under fsdp with offload.params the parameter
// shards too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/collectives.hpp"
#include "shardkit/parallel/fsdp_units.hpp"
#include "shardkit/parallel/mixed_precision.hpp"
#include "shardkit/parallel/module_groups.hpp"
#include "shardkit/parallel/offload.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/replica_sync.hpp"
#include "shardkit/parallel/root_recipes.hpp"
#include "shardkit/parallel/stage.hpp"
#include "shardkit/shard/bucket_plan.hpp"
#include "shardkit/shard/piece_table.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

// The run to plan: the options it will be given (the same ParallelOptions, resolved by the
// same resolve() as the engines), the ranks, the optimizer and, under fsdp, the units.
struct PlannedRun {
  ParallelOptions parallel;
  int world_size = 1;
  int group_size = 0;  // hybrid sharding: ranks per shard group (0: the whole world)
  optim::OptimizerConfig optimizer;
  // fsdp: the units as lists of parameter indices (spec order; every trainable parameter in
  // exactly one unit, frozen ones in none). Empty: one unit of every trainable parameter.
  std::vector<std::vector<std::size_t>> fsdp_units;
  int root_unit = -1;  // the unit gathered through the whole forward and backward (-1: none)
  // fsdp: the most units of one family below the root -- a unit, the units nested in it and
  // those it is nested in -- which may be gathered at once: a nested unit is gathered inside
  // the forward and backward of the units around it, and in the backward a unit's pre-hook
  // fires before its nested units' while the prefetch follows the forward order reversed, in
  // which the unit comes after them: its prefetch already reaches past its own family, which
  // stays gathered until its nested units are done. 1 when no unit holds another.
  int unit_family = 1;
  int rank = -1;  // the shard rank to plan; -1: the most loaded (device, then host memory)
  // The module's buffers (batch-norm statistics and counts), whole on every rank's device in
  // their own dtypes, which the allocator counts under parameters (module_planned_run fills it).
  std::int64_t buffer_bytes = 0;
};

// Peak activation bytes of one training step as fixed + per_sample x batch, and never below
// `floor_bytes` (the peak measured at the smallest batch: buffers that do not grow with it).
struct ActivationProfile {
  double fixed_bytes = 0;
  double bytes_per_sample = 0;
  double floor_bytes = 0;
  std::int64_t at(std::int64_t batch) const {
    if (batch <= 0) return 0;
    return static_cast<std::int64_t>(
        std::max(floor_bytes, fixed_bytes + bytes_per_sample * static_cast<double>(batch)));
  }
};

// The line through two measured peaks (batch b1 -> peak1, b2 -> peak2, b1 < b2).
inline ActivationProfile fit_activation_profile(std::int64_t b1, std::int64_t peak1,
                                                std::int64_t b2, std::int64_t peak2) {
  check(b1 > 0 && b2 > b1, "fit_activation_profile: batches ", b1, " and ", b2,
        " do not give a line; pass two batch sizes 0 < b1 < b2");
  ActivationProfile p;
  p.bytes_per_sample =
      std::max(0.0, static_cast<double>(peak2 - peak1) / static_cast<double>(b2 - b1));
  p.fixed_bytes = std::max(0.0, static_cast<double>(peak1) - p.bytes_per_sample * b1);
  return p;
}

struct MemoryPlan {
  int rank = 0;  // the shard rank whose figures these are (the most loaded)
  std::int64_t parameters = 0;
  std::int64_t gradients = 0;
  std::int64_t optimizer_state = 0;
  std::int64_t communication = 0;    // bound
  std::int64_t gathered = 0;         // fsdp bound
  std::int64_t layer_gradients = 0;  // bound: one layer's gradients, whole, in the backward
  std::int64_t activations = 0;      // for the planned batch
  // Bytes this rank sends per step (bus bytes of bandwidth-optimal rings, comm_stats.hpp)
  // inside its shard group and across groups (hybrid sharding's replicate all-reduce). Without
  // hybrid sharding the group is the world: on more than one node, all of it crosses nodes.
  double sent_in_group = 0;
  double sent_across_groups = 0;
  // CPU offload: what the host holds for this rank (exact, as the model states), and the bytes
  // that cross between host and device per step (gradients down; parameters up after the step,
  // or under offload.params the shards at every gather).
  std::int64_t host_parameters = 0;
  std::int64_t host_gradients = 0;
  std::int64_t host_optimizer_state = 0;
  double host_transfer = 0;
  // Offload to NVMe (offload.nvme_path): the f32 master and optimizer state in files (and with
  // offload.params fsdp's shards: disk_parameters), the bytes read and written there per step
  // (the gathers' reads of the shards included), and the RAM a step holds of them at once (a bound:
  // the three chunks in flight -- the one being written back, the one updated, the one read
  // in -- each rounded out to whole pages; under LARC with pieces split over ranks, the whole
  // master, read before the chunks, and the chunks of the other files). Between steps RAM
  // holds the chunk a step ended with, which the next step starts with (the chunks are walked
  // in turn from either end), so a step reads all of the files but that chunk (a state of one
  // chunk: none) and writes all of them; disk_transfer averages the two ends' chunks. With the
  // shards on disk, the forward and backward add two units' shards to that chunk: one in a
  // gather, the next read ahead.
  std::int64_t disk_optimizer_state = 0;
  std::int64_t disk_parameters = 0;  // fsdp's shards there too (offload.params)
  double disk_transfer = 0;
  std::int64_t disk_streaming = 0;
  // The wrap's transient above the model states (a bound), besides the wrap's checks' few
  // scalars (kWrapScalarBytes) and, before the groups are filled, the table of rank 0's recipes
  // (kRecipeBytes a parameter). An eager build: the group being filled whole and broadcast
  // (wrap_transient), and the module's own f32 parameters (eager_build). A build under
  // sk::DeferredParameters whose parameters all have recipes: what each rank makes of its own
  // range (deferred_transient: its f32 staging where the kept values are not f32 on the device).
  static constexpr std::int64_t kWrapScalarBytes = 64;
  static constexpr std::int64_t kRecipeBytes = sizeof(detail::RecipeEntry);
  std::int64_t wrap_transient = kWrapScalarBytes;
  std::int64_t deferred_transient = kWrapScalarBytes;
  std::int64_t eager_build = 0;
  // Device memory (the figures above are the device's).
  std::int64_t model_states() const { return parameters + gradients + optimizer_state; }
  std::int64_t wrap_peak(bool deferred) const {
    return model_states() + (deferred ? deferred_transient : wrap_transient + eager_build);
  }
  std::int64_t total() const {
    return model_states() + communication + gathered + layer_gradients + activations;
  }
  // The host's RAM for model states at a step's peak: offload's ledgers, and under NVMe the
  // chunks a step holds of the files (between steps one of them: the chunk the last step
  // ended with, which the next starts with).
  std::int64_t host_total() const {
    return host_parameters + host_gradients + host_optimizer_state + disk_streaming;
  }
};

namespace detail {

inline int planned_group(const PlannedRun& o) {
  check(o.world_size >= 1, "memory plan: world size ", o.world_size, "; pass at least 1");
  const int group = o.group_size == 0 ? o.world_size : o.group_size;
  check(group >= 1 && group <= o.world_size && o.world_size % group == 0,
        "memory plan: a shard group of ", group, " ranks does not divide the world of ",
        o.world_size, "; pass a divisor");
  return group;
}

inline std::int64_t bytes_of(DType dtype) { return static_cast<std::int64_t>(dtype_size(dtype)); }

inline std::int64_t largest_bucket(const shard::BucketPlan& buckets) {
  std::int64_t most = 0;
  for (const auto& b : buckets.buckets()) most = std::max(most, b.numel);
  return most;
}

// The largest layer's parameter gradients as the backward makes them (MemoryPlan::layer_gradients):
// a layer's parameters share their name but for its last part ("layer4.1.conv2.weight").
inline std::int64_t layer_gradient_bytes(const std::vector<shard::ParamSpec>& specs,
                                         DType compute) {
  std::map<std::string_view, std::int64_t> layers;
  std::int64_t most = 0;
  for (const auto& s : specs) {
    if (!s.trainable) continue;
    const auto dot = s.name.rfind('.');
    const std::string_view layer =
        dot == std::string::npos ? std::string_view() : std::string_view(s.name).substr(0, dot);
    const std::int64_t each =
        s.shape.size() <= 1 ? std::max<std::int64_t>(4, bytes_of(compute)) : bytes_of(compute);
    most = std::max(most, layers[layer] += shape_numel(s.shape) * each);
  }
  return most;
}

// The bucketer's transient buffers for one plan on `rank`. `kept_on_host`: offload keeps the
// reduced parts on the host, so every reduce-scatter lands in a transient buffer (cast to the
// kept dtype, one bucket at a time, before it comes down). `any_order` (an FSDP unit's
// reduce-scatter, whose bucket buffers are made at a gradient's first touch): the gradients may
// come in any order, so every bucket of the plan may be touched before the first can go; in
// backward order (DDP's assumption, and the replicated stages') one is filled at a time.
inline std::int64_t bucket_transients(const shard::BucketPlan& buckets, bool reduce_scatter,
                                      const BucketPolicy& policy, bool kept_on_host = false,
                                      bool any_order = false) {
  const DType grad = policy.grad_dtype, wire = policy.wire_dtype;
  const std::int64_t in_flight = policy.max_in_flight + 1;  // in flight, plus the one being filled
  const std::int64_t largest = largest_bucket(buckets);
  // The buckets touched beyond those in flight, waiting for their turn.
  const std::int64_t waiting =
      any_order
          ? std::max<std::int64_t>(0, buckets.total_numel() - in_flight * largest) * bytes_of(grad)
          : 0;
  if (reduce_scatter && policy.quantized_block > 0) {
    // qgZ: the full-gradient bucket, its runs of codes out and the owners' runs in, the f32 sum
    // (each run dequantised and added into it in place: ops::dequantize_add_blocks); under
    // error feedback, one bucket at a time, an f32 temporary g + e.
    std::int64_t sent = 0, arrived = 0, own = 0;
    for (const auto& b : buckets.buckets()) {
      std::int64_t runs = 0;
      for (const std::size_t bytes :
           quantized_segment_bytes(b.counts, policy.quantized_block, policy.quantized_format))
        runs += static_cast<std::int64_t>(bytes);
      sent = std::max(sent, runs);
      arrived = std::max(arrived, static_cast<std::int64_t>(b.counts.size()) *
                                      ops::quant_payload_bytes(b.own_numel, policy.quantized_block,
                                                               policy.quantized_format));
      own = std::max(own, b.own_numel);
    }
    return waiting + in_flight * (largest * bytes_of(grad) + sent + arrived + 4 * own) +
           (policy.error_feedback ? 4 * largest : 0) +
           (kept_on_host && grad != DType::f32 ? own * bytes_of(grad) : 0);
  }
  std::int64_t per_bucket = 0;
  if (reduce_scatter) per_bucket += largest * bytes_of(grad);  // the full-gradient bucket
  if (wire != grad) per_bucket += largest * bytes_of(wire);    // its copy on the wire
  std::int64_t own = 0;
  for (const auto& b : buckets.buckets()) own = std::max(own, b.own_numel);
  // Where a bucket's part lands, when not in place: one buffer per bucket in flight, each a
  // different bucket's part of the rank's own range, so together at most that range.
  std::int64_t landing = 0;
  if (reduce_scatter && (wire != grad || kept_on_host))
    landing = std::min(in_flight * own, buckets.owned_numel()) * bytes_of(wire);
  const std::int64_t cast = kept_on_host && wire != grad ? own * bytes_of(grad) : 0;
  return waiting + in_flight * per_bucket + landing + cast;
}

// Hybrid qgZ's exchange across groups (replica_sync.hpp), every bucket's at once: the replica's
// f32 segment of the average, the reduce-scatter's runs out and in, the all-gather's runs;
// under error feedback, one bucket at a time, an f32 temporary of the group sum + residual.
inline std::int64_t quantized_exchange_bytes(const shard::BucketPlan& buckets, int replicas,
                                             const BucketPolicy& policy) {
  std::int64_t total = 0, corrected = 0;
  for (const auto& b : buckets.buckets()) {
    if (b.own_numel == 0) continue;
    if (policy.error_feedback) corrected = std::max(corrected, 4 * b.own_numel);
    const auto counts = replica_segments(b.own_numel, replicas, policy.quantized_block);
    std::int64_t runs = 0;
    for (const std::size_t bytes :
         quantized_segment_bytes(counts, policy.quantized_block, policy.quantized_format))
      runs += static_cast<std::int64_t>(bytes);
    const std::int64_t largest = static_cast<std::int64_t>(counts[0]);
    total += 4 * largest + 2 * runs +
             replicas *
                 ops::quant_payload_bytes(largest, policy.quantized_block, policy.quantized_format);
  }
  return total + corrected;
}

// Per-step traffic of one rank: the gradients reduced (and, under oss / sdp, the parameters
// re-gathered; under fsdp gathered twice, for the forward and again for the backward) inside the
// group, and the reduced gradients all-reduced across the R groups.
inline void plan_traffic(MemoryPlan& p, const std::vector<shard::ParamSpec>& specs,
                         const PlannedRun& o, const ResolvedPolicy& policy, int group) {
  double psi = 0;
  for (const auto& s : specs)
    if (s.trainable) psi += static_cast<double>(shape_numel(s.shape));
  const double param = static_cast<double>(dtype_size(policy.param_dtype));
  const double grad = static_cast<double>(dtype_size(policy.buckets.wire_dtype));
  const double g = group, r = static_cast<double>(o.world_size / group);
  const double ring = (g - 1) / g, across = (r - 1) / r;
  switch (policy.stage) {
    case Stage::ddp:
      p.sent_in_group = 2 * psi * grad * ring;
      p.sent_across_groups = 2 * psi * grad * across;
      break;
    case Stage::oss:
      p.sent_in_group = 2 * psi * grad * ring + psi * param * ring;
      p.sent_across_groups = 2 * psi * grad * across;
      break;
    case Stage::sdp:
      p.sent_in_group = psi * grad * ring + psi * param * ring;
      p.sent_across_groups = 2 * psi / g * grad * across;
      break;
    case Stage::fsdp: {
      // qwZ: a gathered value travels as its code and a share of its block's f32 scale (with
      // per-tensor scales, its code alone); qgZ: a reduced gradient the same way.
      const double gathered = policy.quantized_gather_block == 0 ? param
                              : policy.quantized_gather_scale == ops::QuantScale::tensor
                                  ? ops::quant_code_bits(policy.quantized_gather_format) / 8.0
                                  : ops::quant_bytes_per_value(policy.quantized_gather_block,
                                                               policy.quantized_gather_format);
      const double reduced = policy.buckets.quantized_block > 0
                                 ? ops::quant_bytes_per_value(policy.buckets.quantized_block,
                                                              policy.buckets.quantized_format)
                                 : grad;
      // hpZ: the backward's gather inside a node of G' ranks, from the slices kept over it.
      const double node = policy.reshard_group;
      const double backward_ring = node > 0 ? (node - 1) / node : ring;
      const double backward =
          policy.reshard_after_forward ? psi * (node > 0 ? param : gathered) * backward_ring : 0;
      p.sent_in_group = psi * reduced * ring + psi * gathered * ring + backward;
      // Hybrid qgZ: the exchange across groups in codes too (a reduce-scatter and an
      // all-gather), or, without quantized_grads_across_groups, the f32 group sums it holds.
      const double exchanged = policy.buckets.quantized_block == 0      ? grad
                               : policy.buckets.quantized_across_groups ? reduced
                                                                        : 4.0;
      p.sent_across_groups = 2 * psi / g * exchanged * across;
      break;
    }
  }
}

inline std::int64_t state_elements_bytes(const optim::OptimizerConfig& config, bool mixed) {
  return 4 * static_cast<std::int64_t>(optim::state_buffer_names(config).size() + (mixed ? 1 : 0));
}

// Pages of RAM hold mapped files (MappedFileAllocator): a range of them takes whole pages.
inline constexpr std::int64_t kPageBytes = 4096;

// CPU offload moves rank p's optimizer state (state_numel elements) to the host with an f32
// master of its own unless the parameters already are that master (f32 shards on the host),
// the gradients (sdp, fsdp: the rank's reduced parts, `kept_grad_bytes`, no longer on the
// device; ddp, oss: a staging copy of its pieces), and the compute copy on its way up (mixed
// precision, parameters on the device); offload.params moves fsdp's shards (`shard_numel`: the
// rank's elements of each unit, one after the other in its state's layout) as well -- into files
// under offload to NVMe.
inline void plan_offload(MemoryPlan& p, const PlannedRun& o, const ResolvedPolicy& policy,
                         const shard::PieceTable& table, int rank,
                         const std::vector<std::int64_t>& shard_numel,
                         std::int64_t kept_grad_bytes) {
  const std::int64_t state_numel = table.state_numel(rank);
  if (!policy.offload.enabled()) return;
  const DType param = policy.param_dtype, grad = policy.buckets.grad_dtype;
  const bool mixed = param != DType::f32;
  const bool params_on_host = policy.offload.params;
  std::int64_t shard_bytes = 0;
  for (auto numel : shard_numel) shard_bytes += numel * bytes_of(param);
  const auto buffers = static_cast<std::int64_t>(optim::state_buffer_names(o.optimizer).size());
  p.optimizer_state = 0;
  p.host_optimizer_state = 4 * state_numel * (buffers + (mixed || !params_on_host ? 1 : 0));
  const bool kept = policy.grad_sync == GradSync::reduce_scatter;
  p.host_gradients = kept ? kept_grad_bytes : state_numel * bytes_of(grad);
  p.host_transfer = static_cast<double>(p.host_gradients);
  if (params_on_host) {
    p.parameters -= shard_bytes;
    p.host_parameters = shard_bytes;
    p.host_transfer +=
        (policy.reshard_after_forward ? 2.0 : 1.0) * static_cast<double>(shard_bytes);
  } else {
    if (mixed) p.host_parameters = state_numel * bytes_of(param);
    p.host_transfer += static_cast<double>(state_numel * bytes_of(param));
  }
  // Offload to NVMe: the master and state in files instead (RAM holds a few chunks of them at a
  // step: disk_streaming), and under offload.params the shards too, one file a unit (in f32 they
  // are the master); each step writes all of them once and reads all but the chunk the step
  // before kept in RAM, and the gathers read the shards again (each gather drops what it read).
  // (LARC with its pieces split over ranks reads the whole master before the chunks, which then
  // find it in RAM -- read once still, unless the kernel had to drop it meanwhile -- and drop
  // its pages with theirs.)
  if (policy.offload.on_disk()) {
    p.disk_optimizer_state = p.host_optimizer_state;
    p.host_optimizer_state = 0;
    const bool params_on_disk = params_on_host;
    if (params_on_disk) {
      p.disk_parameters = p.host_parameters;
      p.host_parameters = 0;
    }
    const bool separate_master = mixed || !params_on_host;  // (else the shards are the master)
    const auto& pieces = table.pieces(rank);
    {  // (the kept chunk: the first or the last, in turn)
      std::int64_t first = 0, last = 0, total = 0;
      for (std::size_t begin = 0, end = 0; begin < pieces.size(); begin = end) {
        end = optim::offload_chunk_end(pieces, begin, policy.offload.chunk_numel);
        std::int64_t numel = 0;
        for (std::size_t k = begin; k < end; ++k) numel += pieces[k].numel();
        if (begin == 0) first = numel;
        last = numel;
        total += numel;
      }
      const double kept =
          total > 0 ? static_cast<double>(first + last) / (2.0 * static_cast<double>(total)) : 1.0;
      p.disk_transfer =
          (2.0 - kept) * static_cast<double>(p.disk_optimizer_state + p.disk_parameters);
      // The gathers read the shards again, but for the kept chunk's part (in RAM; they leave
      // it there; spread evenly over the units here, an estimate): twice a unit resharded after the
      // forward -- forward and backward --, once the root unit (kept from its forward to its
      // backward), or a unit whose backward gathers from hpZ's slice over the node or that is not
      // resharded.
      if (params_on_disk) {
        double gathered = 0;
        for (std::size_t u = 0; u < shard_numel.size(); ++u) {
          const bool twice = policy.reshard_after_forward && policy.reshard_group == 0 &&
                             static_cast<std::int64_t>(u) != o.root_unit;
          gathered += (twice ? 2.0 : 1.0) * static_cast<double>(shard_numel[u] * bytes_of(param));
        }
        p.disk_transfer += (1.0 - kept) * gathered;
      }
    }
    // LARC whose pieces are split over ranks (its norms exchanged) reads the whole master
    // before the chunks: RAM holds it all, and each chunk adds only the other files' spans.
    bool split = !table.replicated() && table.world_size() > 1;
    for (const auto& piece : pieces)
      split = split || piece.param_begin != 0 || piece.numel() != table.params()[piece.param].numel;
    const bool whole_master = o.optimizer.kind == optim::OptimizerKind::larc_sgd && split;
    // (f32 buffers, one a file: the state's, and a separate master's unless read whole)
    const std::int64_t files = buffers + (separate_master && !whole_master ? 1 : 0);
    // The shards streamed per chunk: f32 ones that are the master are read whole instead.
    const bool shard_chunks = params_on_disk && !(whole_master && !separate_master);
    // (The units' shards one after the other, in the state's coordinates: where each ends.)
    std::vector<std::int64_t> unit_end;
    for (auto numel : shard_numel)
      unit_end.push_back((unit_end.empty() ? 0 : unit_end.back()) + numel);
    std::vector<std::int64_t> chunks;  // bytes of RAM each chunk takes, whole pages
    for (std::size_t begin = 0, end = 0; begin < pieces.size(); begin = end) {
      end = optim::offload_chunk_end(pieces, begin, policy.offload.chunk_numel);
      // (What a chunk loads and drops is the span of its pieces in each file, their alignment
      // gaps included, rounded out to pages: at most two more -- per shard it touches.)
      std::int64_t lo = INT64_MAX, hi = 0;
      for (std::size_t k = begin; k < end; ++k)
        if (pieces[k].numel() > 0) {
          lo = std::min(lo, pieces[k].state_offset);
          hi = std::max(hi, pieces[k].state_offset + pieces[k].numel());
        }
      std::int64_t bytes = lo < hi ? files * (4 * (hi - lo) + 2 * kPageBytes) : 0;
      if (shard_chunks && lo < hi) {
        bytes += bytes_of(param) * (hi - lo);
        for (std::size_t u = 0; u < unit_end.size(); ++u)
          if ((u == 0 ? 0 : unit_end[u - 1]) < hi && lo < unit_end[u]) bytes += 2 * kPageBytes;
      }
      chunks.push_back(bytes);
    }
    for (std::size_t k = 0; k < chunks.size(); ++k)
      p.disk_streaming =
          std::max(p.disk_streaming, chunks[k] + (k > 0 ? chunks[k - 1] : 0) +
                                         (k + 1 < chunks.size() ? chunks[k + 1] : 0));
    if (whole_master) {
      const auto master_files =
          separate_master ? std::int64_t{1} : static_cast<std::int64_t>(shard_numel.size());
      p.disk_streaming += 4 * state_numel + 2 * kPageBytes * master_files;
    }
    // Between steps RAM holds the chunk kept for the next step, a unit's shard while its gather
    // sends it up (read in whole, dropped once sent) and the next unit's, read ahead: the two
    // largest shards, whole pages.
    if (params_on_disk && !chunks.empty()) {
      std::vector<std::int64_t> bytes;
      for (auto numel : shard_numel) bytes.push_back(numel * bytes_of(param) + 2 * kPageBytes);
      std::sort(bytes.begin(), bytes.end(), std::greater<>());
      const std::int64_t shards = bytes.empty() ? 0 : bytes[0] + (bytes.size() > 1 ? bytes[1] : 0);
      p.disk_streaming =
          std::max(p.disk_streaming, std::max(chunks.front(), chunks.back()) + shards);
    }
  }
}

}  // namespace detail

// The plan for `specs` (names, shapes, trainable flags in registration order) for the run `o`,
// with activations for `batch` samples per rank from `activations`. Collective-free: runs
// anywhere.
inline MemoryPlan plan_memory(const std::vector<shard::ParamSpec>& specs, const PlannedRun& o,
                              const ActivationProfile& activations = {}, std::int64_t batch = 0) {
  const int group = detail::planned_group(o);
  const ResolvedPolicy policy = resolve(o.parallel);  // the engines' own choices
  if (policy.reshard_group > 0)  // (what the engines check when they split the nodes)
    check(group == o.world_size && o.world_size % policy.reshard_group == 0,
          "memory plan: fsdp.reshard_group_size ", policy.reshard_group,
          " needs plain sharding over a world it divides; got ", o.world_size, " ranks",
          group != o.world_size ? " in hybrid groups" : "");
  const DType param = policy.param_dtype;
  const DType grad = policy.buckets.grad_dtype;
  const std::int64_t state_bytes =
      detail::state_elements_bytes(o.optimizer, policy.mixed_precision());
  MemoryPlan best;
  best.parameters = -1;
  check(o.rank >= -1 && o.rank < group, "memory plan: rank ", o.rank,
        " is not a rank of the shard group of ", group, "; pass 0..", group - 1,
        " or -1 for the most loaded");
  check(o.buffer_bytes >= 0, "memory plan: buffer_bytes ", o.buffer_bytes,
        " is negative; pass the module's buffer bytes (module_planned_run counts them) or 0");
  // The wrap's table of rank 0's recipes (parallel/root_recipes.hpp), sent either way.
  const std::int64_t recipes = MemoryPlan::kWrapScalarBytes +
                               MemoryPlan::kRecipeBytes * static_cast<std::int64_t>(specs.size());
  for (int rank = 0; rank < group; ++rank) {
    if (o.rank >= 0 && rank != o.rank) continue;
    MemoryPlan p;
    p.rank = rank;
    const bool reduce_scatter = policy.grad_sync == GradSync::reduce_scatter;
    if (policy.residency == Residency::replicated) {
      const shard::ShardPlan plan(specs, group, policy.partition);
      const shard::BucketPlan buckets(plan, rank, policy.buckets.capacity);
      const auto table = shard::PieceTable::of_plan(plan, policy.every_rank_updates);
      p.parameters = plan.layout().padded_numel() * detail::bytes_of(param);
      if (param != DType::f32) p.wrap_transient += plan.layout().padded_numel() * 4;
      p.wrap_transient = std::max(p.wrap_transient, recipes);
      p.deferred_transient = p.wrap_transient;  // (the whole buffer either way)
      for (const auto& s : specs) p.eager_build += 4 * shape_numel(s.shape);
      // (offload keeps reduce-scattered gradients on the host: plan_offload)
      const bool grads_on_host = reduce_scatter && policy.offload.enabled();
      const std::int64_t kept_grads =
          (reduce_scatter ? buckets.owned_numel() : buckets.total_numel()) * detail::bytes_of(grad);
      p.gradients = grads_on_host ? 0 : kept_grads;
      p.optimizer_state = table.state_numel(rank) * state_bytes;
      p.communication =
          detail::bucket_transients(buckets, reduce_scatter, policy.buckets, grads_on_host);
      // Hybrid: every bucket's reduced part waits on the device for the exchange across groups
      // (ReplicaSync) at the backward's end -- in a buffer of its own when it is kept on the
      // host (sdp) or travels in a dtype of its own: the rank's part of each bucket under a
      // reduce-scatter, each whole bucket under an all-reduce. (Otherwise it landed in place.)
      if (group < o.world_size && policy.buckets.quantized_block == 0 &&
          (grads_on_host || policy.buckets.wire_dtype != grad))
        p.communication += (reduce_scatter ? buckets.owned_numel() : buckets.total_numel()) *
                           detail::bytes_of(policy.buckets.wire_dtype);
      if (policy.broadcast_fp16)
        p.communication = std::max(p.communication, plan.trainable_end() * 2);
      detail::plan_offload(p, o, policy, table, rank, {}, kept_grads);
    } else {
      std::vector<std::vector<std::size_t>> units = o.fsdp_units;
      if (units.empty()) {
        units.emplace_back();
        for (std::size_t i = 0; i < specs.size(); ++i)
          if (specs[i].trainable) units.back().push_back(i);
      }
      shard::PieceTable table(group, false);
      std::int64_t shard_bytes = 0;
      std::vector<std::int64_t> shard_numel;  // the rank's elements of each unit
      std::vector<std::int64_t> unit_bytes;
      std::int64_t transients = 0, node_slices = 0, held_sums = 0, kept_grads = 0;
      // Per-tensor qwZ: every unit's tensors' maxima, kept between steps (tensor_scales.hpp).
      std::int64_t maxima = 0;
      for (const auto& unit : units) {
        std::vector<shard::ParamSpec> unit_specs;
        for (auto i : unit) {
          check(i < specs.size() && specs[i].trainable, "memory plan: FSDP unit parameter #", i,
                " is not a trainable parameter of the ", specs.size(), " given");
          unit_specs.push_back(specs[i]);
        }
        if (unit_specs.empty()) {  // (a model without trainable parameters: no unit)
          check(o.fsdp_units.empty(), "memory plan: FSDP unit #", &unit - units.data(),
                " has no parameter; FsdpEngine refuses empty units (leave it out, and count "
                "root_unit without it)");
          continue;
        }
        const shard::ShardPlan plan(unit_specs, group, policy.partition);
        const shard::BucketPlan buckets(plan, rank, policy.buckets.capacity);
        table.append_plan(plan, false);
        shard_bytes += plan.numel(rank) * detail::bytes_of(param);
        shard_numel.push_back(plan.numel(rank));
        kept_grads += buckets.owned_numel() * detail::bytes_of(grad);
        if (!policy.offload.enabled())  // (offload keeps them on the host: plan_offload)
          p.gradients += buckets.owned_numel() * detail::bytes_of(grad);
        if (policy.buckets.error_feedback) {  // qgZ's residual: f32 for every local gradient
          p.gradients += buckets.total_numel() * 4;
          // and, for hybrid qgZ's exchange across groups (replica_sync.hpp), f32 for every
          // reduced one and for the segments of them this rank owns across the replicas
          if (policy.buckets.quantized_across_groups && group < o.world_size) {
            p.gradients += buckets.owned_numel() * 4;
            for (const auto& b : buckets.buckets())  // the first segment is the largest
              p.gradients +=
                  4 * static_cast<std::int64_t>(replica_segments(b.own_numel, o.world_size / group,
                                                                 policy.buckets.quantized_block)
                                                    .front());
          }
        }
        std::int64_t held = plan.layout().padded_numel() * detail::bytes_of(param);
        p.wrap_transient =
            std::max({p.wrap_transient, recipes,
                      MemoryPlan::kWrapScalarBytes + held +
                          (param != DType::f32 ? plan.layout().padded_numel() * 4 : 0)});
        for (const auto& s : unit_specs) p.eager_build += 4 * shape_numel(s.shape);
        // Deferred: the rank's range made in place, or in f32 staging beside a 16-bit shard (in
        // host memory for an offloaded one: not the device's).
        const bool staged = param != DType::f32 && !policy.offload.params;
        p.deferred_transient =
            std::max({p.deferred_transient, recipes,
                      MemoryPlan::kWrapScalarBytes + (staged ? 4 * plan.numel(rank) : 0)});
        if (policy.quantized_gather_block > 0) {  // qwZ: the wire's runs until they are unpacked
          for (const std::size_t bytes :
               quantized_run_bytes(plan, policy.quantized_gather_block,
                                   policy.quantized_gather_format, policy.quantized_gather_scale))
            held += static_cast<std::int64_t>(bytes);
          if (policy.quantized_gather_scale == ops::QuantScale::tensor)
            maxima += 4 * (static_cast<std::int64_t>(plan.layout().size()) + 1);
        }
        unit_bytes.push_back(held);
        if (policy.reshard_group > 0)  // hpZ: its slice over the node, from forward to backward
          node_slices += plan.trainable_end() / policy.reshard_group * detail::bytes_of(param);
        transients =
            std::max(transients, detail::bucket_transients(buckets, true, policy.buckets,
                                                           policy.offload.enabled(), true));
        // Hybrid qgZ: each bucket's f32 group sum is held until the exchange across groups at
        // the end of the backward (ReplicaSync), every unit's at once.
        // Hybrid fsdp kept on the host (offload), or with a wire dtype of its own: so are the
        // wire's parts, every unit's.
        if ((policy.offload.enabled() || policy.buckets.wire_dtype != grad) &&
            policy.buckets.quantized_block == 0 && group < o.world_size)
          held_sums += buckets.owned_numel() * detail::bytes_of(policy.buckets.wire_dtype);
        if (policy.buckets.quantized_block > 0 && group < o.world_size) {
          held_sums += 4 * buckets.owned_numel();
          if (policy.buckets.quantized_across_groups)
            held_sums +=
                detail::quantized_exchange_bytes(buckets, o.world_size / group, policy.buckets);
        }
      }
      p.parameters = shard_bytes;
      std::int64_t frozen = 0;
      for (const auto& s : specs)
        if (!s.trainable) frozen += shape_numel(s.shape);
      p.parameters += frozen * detail::bytes_of(param);
      // Frozen parameters stay whole outside the units: in f32 from the build (or nn::materialize
      // for a deferred one) until cast to a 16-bit compute dtype.
      if (param != DType::f32) {
        p.wrap_transient = std::max(p.wrap_transient, MemoryPlan::kWrapScalarBytes + 4 * frozen);
        p.deferred_transient =
            std::max(p.deferred_transient, MemoryPlan::kWrapScalarBytes + 4 * frozen);
        p.eager_build += 4 * frozen;
      }
      p.optimizer_state = table.state_numel(rank) * state_bytes;
      detail::plan_offload(p, o, policy, table, rank, shard_numel, kept_grads);
      // Gathered at once: the root unit, and the unit in use -- with its family of nested units
      // -- with `prefetch` more ahead (every unit without resharding after forward).
      std::int64_t root = 0;
      if (o.root_unit >= 0 && static_cast<std::size_t>(o.root_unit) < unit_bytes.size()) {
        root = unit_bytes[static_cast<std::size_t>(o.root_unit)];
        unit_bytes.erase(unit_bytes.begin() + o.root_unit);
      }
      std::sort(unit_bytes.rbegin(), unit_bytes.rend());
      const std::size_t held =
          policy.reshard_after_forward
              ? std::min(unit_bytes.size(),
                         static_cast<std::size_t>(policy.prefetch + std::max(1, o.unit_family)))
              : unit_bytes.size();
      p.gathered = root + node_slices;  // (every unit's slice: the bound after a forward)
      for (std::size_t k = 0; k < held; ++k) p.gathered += unit_bytes[k];
      p.communication =
          transients + held_sums + maxima + 2 * static_cast<std::int64_t>(policy.coalesce_bytes);
    }
    p.parameters += o.buffer_bytes;
    p.layer_gradients = detail::layer_gradient_bytes(specs, param);
    p.activations = activations.at(batch);
    detail::plan_traffic(p, specs, o, policy, group);
    const bool more = p.total() > best.total() ||
                      (p.total() == best.total() && p.host_total() > best.host_total());
    if (more || best.parameters < 0) best = p;
  }
  return best;
}

// `o` for an nn::Module trained by ShardedModule: its buffers' bytes, and under fsdp the units
// o.parallel.fsdp.wrap makes of its parameters (registration order, module_param_specs), the
// root unit gathered throughout.
inline PlannedRun module_planned_run(nn::Module& module, PlannedRun o) {
  o.buffer_bytes = 0;
  for (const auto& [name, buffer] : module.named_buffers())
    o.buffer_bytes += static_cast<std::int64_t>(buffer.nbytes());
  if (o.parallel.stage != Stage::fsdp) return o;
  const auto specs = module_param_specs(module);
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < specs.size(); ++i) index.emplace(specs[i].name, i);
  o.fsdp_units.clear();
  o.root_unit = -1;
  o.unit_family = 1;
  const auto units = plan_fsdp_units(module, o.parallel.fsdp.wrap);
  for (const auto& unit : units) {
    if (unit.path.empty()) continue;
    int family = 1;  // (itself, the units around it and the units inside it)
    for (const auto& other : units)
      if (!other.path.empty() &&
          (detail::is_below(unit.path, other.path) || detail::is_below(other.path, unit.path)))
        ++family;
    o.unit_family = std::max(o.unit_family, family);
  }
  for (const auto& unit : units) {
    std::vector<std::size_t> members;
    for (const auto& name : unit.params)
      if (specs[index.at(name)].trainable) members.push_back(index.at(name));
    if (members.empty()) continue;  // (FSDP keeps no unit of frozen parameters only)
    if (unit.path.empty()) o.root_unit = static_cast<int>(o.fsdp_units.size());
    o.fsdp_units.push_back(std::move(members));
  }
  return o;
}

// The plan of an nn::Module trained by ShardedModule in the run `o`.
inline MemoryPlan plan_module_memory(nn::Module& module, const PlannedRun& o,
                                     const ActivationProfile& activations = {},
                                     std::int64_t batch = 0) {
  return plan_memory(module_param_specs(module), module_planned_run(module, o), activations, batch);
}

// The largest batch per rank whose plan fits in `device_bytes`; 0 when not even one sample
// fits beside the model states.
inline std::int64_t largest_batch(const std::vector<shard::ParamSpec>& specs, const PlannedRun& o,
                                  const ActivationProfile& activations, std::int64_t device_bytes) {
  check(activations.bytes_per_sample > 0,
        "largest_batch: the activation profile has no per-sample bytes; measure one with "
        "profile_activations (or fit_activation_profile) first");
  const double left =
      static_cast<double>(device_bytes - plan_memory(specs, o).total()) - activations.fixed_bytes;
  std::int64_t batch =
      left <= 0 ? 0 : static_cast<std::int64_t>(left / activations.bytes_per_sample);
  while (batch > 0 && plan_memory(specs, o, activations, batch).total() > device_bytes) --batch;
  return batch;
}

// A model's activation profile from measured steps: `peak_at(batch)` runs one training step
// (forward and backward) at `batch` samples on a fresh context and returns the peak of
// MemoryCategory::activations.
//
// The peak is the largest of the live bytes over the step, each moment's a line in the batch,
// so the peak is a convex, piecewise-linear function of the batch: flat while fixed buffers
// (workspaces, weight reorders, a checkpointed segment's recompute) dominate, then growing at
// the largest per-sample rate. A line through two small batches can sit in the flat part and
// under-plan large ones, so this measures b1 and 2 b1, then keeps doubling until the growth per
// sample of the last two doublings agrees within `settle` (or max_batch is reached), and fits
// the line through the last two batches, with the peak at b1 as its floor.
template <class PeakAt>
ActivationProfile profile_activations(PeakAt&& peak_at, std::int64_t b1 = 2,
                                      std::int64_t max_batch = 64, double settle = 0.02) {
  check(b1 > 0 && max_batch >= 2 * b1, "profile_activations: start at a batch b1 > 0 and allow ",
        "max_batch >= 2 b1; got b1 = ", b1, ", max_batch = ", max_batch);
  std::int64_t low = b1, high = 2 * b1;
  std::int64_t low_peak = peak_at(low), high_peak = peak_at(high);
  const std::int64_t floor = low_peak;
  double slope = static_cast<double>(high_peak - low_peak) / static_cast<double>(high - low);
  while (2 * high <= max_batch) {
    const std::int64_t next = 2 * high;
    const std::int64_t next_peak = peak_at(next);
    const double next_slope =
        static_cast<double>(next_peak - high_peak) / static_cast<double>(next - high);
    low = high, low_peak = high_peak, high = next, high_peak = next_peak;
    const bool settled = std::abs(next_slope - slope) <= settle * std::abs(next_slope);
    slope = next_slope;
    if (settled) break;
  }
  ActivationProfile p = fit_activation_profile(low, low_peak, high, high_peak);
  p.floor_bytes = static_cast<double>(floor);
  return p;
}

}  // namespace shardkit::parallel
