// The collectives over flat parameters, as free functions (FSDP2's foreach_all_gather and
// friends): what keeps the ranks' copies of a FlatParam in step. Each is collective over the
// FlatParam's communicator (and, under hybrid sharding, its replicas where it says so).
//
//   start_all_gather   sharded: the whole buffer back from the ranks' shards (async)
//   all_gather_owned   oss/sdp after a step: the owners' updated ranges to everyone
//   broadcast_from     world rank `root`'s values to every rank (hybrid: across groups too)
//   set_from_f32       every parameter from exact f32 values, rank `root`'s everywhere
//   set_kept_from_f32  the values this rank keeps, made here (rank root's recipes): no traffic
//   check_same_fingerprint / check_same_layout
//                      the ranks agree on what they hold before any traffic pairs up wrongly
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/parallel/flat_param.hpp"

namespace shardkit::parallel {

// Ranks compare a fingerprint (as two exact 32-bit halves in f64) with one max all-reduce of
// the values and their negatives; `what` says what differs and how to fix it.
inline void check_same_fingerprint(Context& ctx, comm::Communicator& comm, std::uint64_t print,
                                   std::string_view what) {
  std::vector<double> values = {
      static_cast<double>(print >> 32), static_cast<double>(print & 0xffffffffu),
      -static_cast<double>(print >> 32), -static_cast<double>(print & 0xffffffffu)};
  Tensor t = from_vector(ctx, values, {4});
  comm.all_reduce(t, comm::ReduceOp::max).wait();
  const auto reduced = to_vector<double>(ctx, t);
  check(reduced[0] == -reduced[2] && reduced[1] == -reduced[3], what, " (rank ", comm.rank(),
        " has fingerprint ", print, ")");
}

// Every rank of the group and of its replicas must hold the same layout (`print` of it).
inline void check_same_layout(const FlatParam& flat, std::uint64_t print, std::string_view what) {
  check_same_fingerprint(flat.context(), flat.communicator(), print, what);
  if (flat.replicas() != nullptr)
    check_same_fingerprint(flat.context(), *flat.replicas(), print, what);
}

// `values` <- world rank `root`'s, on every rank. Hybrid: world rank g * G + s is rank s of
// group g (HybridMesh's layout), so root's column first carries it to every group, then each
// group's rank s to the group.
inline void broadcast_from(const FlatParam& flat, const Tensor& values, int root) {
  comm::Communicator& group = flat.communicator();
  if (flat.replicas() != nullptr) {
    const int world = group.size() * flat.replicas()->size();
    check(root >= 0 && root < world, "broadcast: root ", root, " is not a rank of the world of ",
          world, " ranks");
    flat.replicas()->broadcast(values, root / group.size()).wait();
    root %= group.size();
  }
  group.broadcast(values, root).wait();
}

// The bytes of each owner's run of blocks (ops/quantize.hpp) for per-owner element `counts`:
// what a quantised collective moves per owner, and what the memory planner counts for it.
inline std::vector<std::size_t> quantized_segment_bytes(const std::vector<std::size_t>& counts,
                                                        std::int64_t block,
                                                        ops::QuantFormat format) {
  std::vector<std::size_t> bytes;
  bytes.reserve(counts.size());
  for (const std::size_t count : counts)
    bytes.push_back(static_cast<std::size_t>(
        ops::quant_payload_bytes(static_cast<std::int64_t>(count), block, format)));
  return bytes;
}

// qwZ: each rank's run of its shard on the wire, rank by rank (with per-tensor scales, its codes
// alone, padded to 16 bytes).
inline std::vector<std::size_t> quantized_run_bytes(
    const shard::ShardPlan& plan, std::int64_t block, ops::QuantFormat format,
    ops::QuantScale scale = ops::QuantScale::block) {
  if (scale == ops::QuantScale::block) return quantized_segment_bytes(plan.counts(), block, format);
  std::vector<std::size_t> bytes;
  for (const std::size_t count : plan.counts())
    bytes.push_back(
        static_cast<std::size_t>(ops::quant_codes_payload_bytes(static_cast<std::int64_t>(count))));
  return bytes;
}

// A quantised all-gather: this rank's `own` values (counts[rank] of them) travel as one run of
// `format` blocks of `block` values (ops/quantize.hpp), the runs laid end to end as bytes; once
// they are here, every run -- this rank's too, so that all ranks hold the same values -- is
// dequantised into `out` (counts laid end to end, any float dtype). `own` stays exact, so it
// must not lie in `out` (its run dequantised there would overwrite it with the rounded values);
// the returned work completes the gather.
[[nodiscard]] inline comm::Work start_quantized_all_gather_v(Context& ctx, comm::Communicator& comm,
                                                             const Tensor& own, const Tensor& out,
                                                             const std::vector<std::size_t>& counts,
                                                             std::int64_t block,
                                                             ops::QuantFormat format) {
  const auto bytes = quantized_segment_bytes(counts, block, format);
  const std::size_t ranks = bytes.size();
  std::vector<std::int64_t> at(ranks + 1, 0);    // where each rank's run starts on the wire
  std::vector<std::int64_t> from(ranks + 1, 0);  // and where its values go in `out`
  for (std::size_t r = 0; r < ranks; ++r) {
    at[r + 1] = at[r] + static_cast<std::int64_t>(bytes[r]);
    from[r + 1] = from[r] + static_cast<std::int64_t>(counts[r]);
  }
  const auto mine = static_cast<std::size_t>(comm.rank());
  check(ranks == static_cast<std::size_t>(comm.size()) &&
            own.numel() == static_cast<std::int64_t>(counts[mine]) && out.numel() >= from[ranks],
        "quantized all-gather: ", ranks, " counts for ", comm.size(), " ranks, own ", own,
        " for counts[", mine, "] = ", counts[mine], ", out ", out, " for ", from[ranks],
        " values; pass a count per rank, this rank's values, and room for them all");
  check(own.storage() != out.storage() || own.offset() + own.numel() <= out.offset() ||
            out.offset() + out.numel() <= own.offset(),
        "quantized all-gather: own ", own, " lies in out ", out,
        ", where its dequantised run would overwrite it; pass this rank's values separately");
  const Tensor wire = empty(ctx, {at[ranks]}, DType::u8, MemoryCategory::communication);
  ops::quantize_blocks(ctx, format, own, block, wire.slice(0, at[mine], at[mine + 1]));
  const Tensor flat_out = out.view({out.numel()});
  return comm::then(comm.all_gather_v(wire, bytes),
                    [&ctx, wire, flat_out, at, from, block, format] {
                      for (std::size_t r = 0; r + 1 < at.size(); ++r)
                        ops::dequantize_blocks(ctx, format, wire.slice(0, at[r], at[r + 1]), block,
                                               flat_out.slice(0, from[r], from[r + 1]));
                    });
}

namespace detail {

// qwZ: every rank's shard travels as one run of int8 (or E4M3, or int4) blocks and comes back
// into the whole buffer, dequantised alike on every rank. The shard stays exact.
[[nodiscard]] inline comm::Work start_quantized_all_gather(FlatParam& flat, std::int64_t block,
                                                           ops::QuantFormat format) {
  flat.materialize();
  return start_quantized_all_gather_v(flat.context(), flat.communicator(), flat.shard(),
                                      flat.params().flat(), flat.plan().counts(), block, format);
}

// qwZ with a scale per tensor (FSDP2's float8 all-gather; ops/quantize.hpp): with `amax`, the
// tensors' |x| maxima over the group's shards (tensor_scales.hpp; f32, one per slot), this
// rank's shard's codes and an all-gather of the codes; every run, this rank's too, is
// dequantised with the same scales into the buffer.
[[nodiscard]] inline comm::Work start_tensor_scaled_all_gather(FlatParam& flat,
                                                               ops::QuantFormat format,
                                                               const Tensor& amax) {
  flat.materialize();
  Context& ctx = flat.context();
  comm::Communicator& comm = flat.communicator();
  const auto& chunks = flat.slot_chunks();
  const int rank = comm.rank();
  const auto mine = static_cast<std::size_t>(rank);
  check(amax.dtype() == DType::f32 && amax.numel() == chunks.slots,
        "per-tensor-scaled all-gather: the maxima must be f32 of ", chunks.slots, " slots, got ",
        amax, "; pass the unit's TensorScales::scales(u) (parallel/tensor_scales.hpp)");
  const auto bytes = quantized_run_bytes(flat.plan(), 0, format, ops::QuantScale::tensor);
  std::vector<std::int64_t> at(bytes.size() + 1, 0);  // where each rank's run starts on the wire
  for (std::size_t r = 0; r < bytes.size(); ++r)
    at[r + 1] = at[r] + static_cast<std::int64_t>(bytes[r]);
  const Tensor wire = empty(ctx, {at.back()}, DType::u8, MemoryCategory::communication);
  const std::int64_t codes_end = at[mine] + flat.plan().numel(rank);
  ops::quantize_by_slots(ctx, format, flat.shard(), chunks.of(rank), amax,
                         wire.slice(0, at[mine], codes_end));
  // The padding after this rank's codes goes on the wire too: zeroed, so every rank's bytes
  // are defined (the other runs arrive whole).
  if (codes_end < at[mine + 1]) fill(ctx, wire.slice(0, codes_end, at[mine + 1]), 0.0);
  return comm::then(comm.all_gather_v(wire, bytes), [&flat, wire, amax, at, format] {
    const auto& plan = flat.plan();
    const auto& chunks = flat.slot_chunks();
    for (std::size_t r = 0; r + 1 < at.size(); ++r) {
      const int owner = static_cast<int>(r);
      ops::dequantize_by_slots(
          flat.context(), format, wire.slice(0, at[r], at[r] + plan.numel(owner)), chunks.of(owner),
          amax, flat.params().flat().slice(0, plan.begin(owner), plan.end(owner)));
    }
  });
}

}  // namespace detail

// Sharded residency: the whole buffer back -- this rank's shard copied in, the others
// all-gathered; the returned work completes it (wait before use: prefetch overlaps it). With
// `quantized_block` (qwZ) the values travel as blocks of that many `format` codes and come back
// within the format's bound of the shards' (int8: half a block's step). With a scale per tensor
// the tensors' maxima over the group are `amax` (tensor_scales.hpp).
[[nodiscard]] inline comm::Work start_all_gather(FlatParam& flat, std::int64_t quantized_block = 0,
                                                 ops::QuantFormat format = ops::QuantFormat::int8,
                                                 ops::QuantScale scale = ops::QuantScale::block,
                                                 const Tensor& amax = Tensor()) {
  if (quantized_block > 0 && scale == ops::QuantScale::tensor)
    return detail::start_tensor_scaled_all_gather(flat, format, amax);
  if (quantized_block > 0) return detail::start_quantized_all_gather(flat, quantized_block, format);
  flat.materialize();
  const auto& plan = flat.plan();
  flat.upload_shard();
  return flat.communicator().all_gather_v(flat.params().flat().slice(0, 0, plan.trainable_end()),
                                          plan.counts());
}

// Owners send their updated ranges to everyone: one all_gather_v over the rank-ordered ranges.
// With `f16_wire` only the wire is f16: every rank's f32 master of its own range stays exact
// (FairScale's broadcast_fp16 rounds it).
inline void all_gather_owned(FlatParam& flat, bool f16_wire) {
  Context& ctx = flat.context();
  comm::Communicator& comm = flat.communicator();
  const auto& plan = flat.plan();
  const int rank = comm.rank();
  const auto counts = plan.counts();
  const Tensor trainable = flat.params().flat().slice(0, 0, plan.trainable_end());
  if (!f16_wire || trainable.dtype() != DType::f32) {  // (a 16-bit buffer travels as it is)
    comm.all_gather_v(trainable, counts).wait_on_stream();
    return;
  }
  Tensor wire = empty(ctx, {plan.trainable_end()}, DType::f16, MemoryCategory::communication);
  copy(ctx, wire.slice(0, plan.begin(rank), plan.end(rank)),
       trainable.slice(0, plan.begin(rank), plan.end(rank)));
  comm.all_gather_v(wire, counts).wait_on_stream();
  for (int r = 0; r < comm.size(); ++r)
    if (r != rank && plan.numel(r) > 0)
      copy(ctx, trainable.slice(0, plan.begin(r), plan.end(r)),
           wire.slice(0, plan.begin(r), plan.end(r)));
}

// Sets every parameter from exact f32 values on every rank: fill(i, view) writes parameter i
// into an f32 view, rank `root`'s values are broadcast, and the FlatParam keeps them in its
// dtype (rounded under mixed precision); master(k, values) receives the f32 values of updated
// piece k (`pieces`, e.g. for the optimizer's master). The whole buffer must be there
// (materialized when sharded).
template <class Fill, class Master>
void set_from_f32(FlatParam& flat, Fill&& fill, Master&& master,
                  const std::vector<shard::ParamPiece>& pieces, int root) {
  Context& ctx = flat.context();
  const Tensor& buffer = flat.params().flat();
  const bool low = buffer.dtype() != DType::f32;
  Tensor wide =
      low ? zeros(ctx, buffer.shape(), DType::f32, MemoryCategory::communication) : buffer;
  if (!low) flat.fill_zero();  // the padding too: no undefined bytes anywhere
  const auto& layout = flat.plan().layout();
  for (std::size_t i = 0; i < layout.size(); ++i)
    fill(i, wide.flat_view(layout[i].offset, layout[i].shape));
  broadcast_from(flat, wide, root);
  for (std::size_t k = 0; k < pieces.size(); ++k)
    master(k, wide.slice(0, pieces[k].flat_begin, pieces[k].flat_begin + pieces[k].numel()));
  if (low) copy(ctx, buffer, wide);
  if (flat.sharded()) flat.copy_range_to_shard();
}

// Sets the values this rank keeps -- its range of the plan under sharded residency (fsdp), else
// the whole buffer -- from values every rank can make itself (rank root's recipes,
// root_recipes.hpp), with no collective: fill_range(i, first, view) writes elements
// [first, first + view.numel()) of parameter i into an f32 view. Otherwise as set_from_f32:
// padding zero, master(k, values) for each updated piece, the buffer's dtype rounded. Under
// fsdp the whole buffer is never materialised: the wrap holds the shard, and an f32 staging of
// it where the shard is 16-bit -- in the shard's own memory, so the host's for an offloaded one
// (a copy between host and device does not convert).
template <class FillRange, class Master>
void set_kept_from_f32(FlatParam& flat, FillRange&& fill_range, Master&& master,
                       const std::vector<shard::ParamPiece>& pieces) {
  Context& ctx = flat.context();
  const auto& plan = flat.plan();
  const int rank = flat.communicator().rank();
  const Tensor& kept = flat.sharded() ? flat.shard() : flat.params().flat();
  const std::int64_t lo = flat.sharded() ? plan.begin(rank) : 0;
  const std::int64_t hi = lo + kept.numel();
  Context& home = flat.sharded() ? flat.shard_context() : ctx;
  const bool direct = kept.dtype() == DType::f32;
  const Tensor wide =
      direct ? kept : empty(home, {kept.numel()}, DType::f32, MemoryCategory::communication);
  fill(home, wide, 0.0);  // the padding too: no undefined bytes anywhere
  const auto& layout = plan.layout();
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::int64_t begin = std::max(lo, layout[i].offset);
    const std::int64_t end = std::min(hi, layout[i].offset + layout[i].numel);
    if (begin < end) fill_range(i, begin - layout[i].offset, wide.slice(0, begin - lo, end - lo));
  }
  for (std::size_t k = 0; k < pieces.size(); ++k)
    master(k,
           wide.slice(0, pieces[k].flat_begin - lo, pieces[k].flat_begin - lo + pieces[k].numel()));
  if (!direct) copy(home, kept, wide);
}

}  // namespace shardkit::parallel
