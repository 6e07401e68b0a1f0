// qgZ (DeepSpeed ZeRO++'s zero_quantized_gradients): a reduce-scatter whose wire carries blocks
// of int8, int4 or E4M3 codes (ops/quantize.hpp) instead of the gradients' dtype. A ring
// reduce-scatter would have to re-quantise a partial sum at every hop, compounding the error N - 1
// times; instead each rank quantises every owner's segment of its gradients once, one all-to-all
// moves the runs to their owners, and the owner dequantises the N runs and sums them in f32, in
// rank order:
//
//   sender q:  run_{q,r} = Q(g_q[segment r])          for every owner r  (once)
//   wire:      all_to_all_v of the runs (quant_payload_bytes(counts[r], block, format) each)
//   owner r:   out = finish(D(run_{0,r}) + D(run_{1,r}) + ... + D(run_{N-1,r}))   (f32)
//
// finish divides by N for an average (comm/reduction.hpp's rule: once, after the sum). The sum's
// order is the rank order, whatever order the runs arrive in, so the result is deterministic.
// Error (int8 and int4): each value is off by at most half its block's step per rank,
// |out - avg(g)| <= sum_q scale_{q,b} / 2 / N (plus f32 rounding), scale = amax / 127 or / 7.
//
// Error feedback (optional, as in 1-bit Adam and EF-SGD): the part the quantisation dropped,
// e_q = (g_q + e_q) - D(Q(g_q + e_q)), is kept by the sender and added to its next gradients,
// so what is lost in one step is sent in a later one instead of never. It costs a persistent f32
// copy of the rank's whole gradient buffer (Psi elements: what ZeRO-2/3 otherwise does not
// keep) and one more pass over it; off by default, as in DeepSpeed's qgZ.
#pragma once

#include <cstdint>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/parallel/collectives.hpp"

namespace shardkit::parallel {

// Error feedback's residual of part `b` in `residuals` (n f32 values, zero until the part's first
// reduction; kept in gradients memory across steps), or an undefined tensor when `residuals`
// is empty (no error feedback).
inline Tensor carried_residual(Context& ctx, std::vector<Tensor>& residuals, std::size_t b,
                               std::int64_t n) {
  if (residuals.empty()) return Tensor();
  if (!residuals[b].defined())
    residuals[b] = zeros(ctx, {n}, DType::f32, MemoryCategory::gradients);
  return residuals[b];
}

// Reduces `send` (a flat f32, f16 or bf16 tensor: the owners' segments of `counts` elements end
// to end) into `out` (f32, counts[rank] elements) with `op` (sum or avg) over blocks of `block`
// values in `format`'s codes. `residual` (f32, send's size; undefined: no error feedback) is added
// to the gradients before they are quantised and replaced by what the quantisation dropped. The
// returned Work completes the reduction (the owner's dequantise-and-sum runs on wait()); `send`
// may be reused at once, `out` must live until then.
[[nodiscard]] inline comm::Work start_quantized_reduce_scatter(
    Context& ctx, comm::Communicator& comm, const Tensor& send,
    const std::vector<std::size_t>& counts, std::int64_t block, comm::ReduceOp op,
    const Tensor& out, const Tensor& residual = Tensor(),
    ops::QuantFormat format = ops::QuantFormat::int8) {
  check(op == comm::ReduceOp::sum || op == comm::ReduceOp::avg, "quantized reduce-scatter: op ",
        comm::reduce_op_name(op), " is not a sum; pass sum or avg");
  const auto bytes = quantized_segment_bytes(counts, block, format);
  const std::size_t ranks = counts.size();
  std::vector<std::int64_t> element_at(ranks + 1, 0), byte_at(ranks + 1, 0);
  for (std::size_t r = 0; r < ranks; ++r) {
    element_at[r + 1] = element_at[r] + static_cast<std::int64_t>(counts[r]);
    byte_at[r + 1] = byte_at[r] + static_cast<std::int64_t>(bytes[r]);
  }
  check(send.numel() >= element_at[ranks] && send.is_contiguous(),
        "quantized reduce-scatter: send holds ", send.numel(),
        " elements but the counts add up to ", element_at[ranks],
        "; pass a contiguous buffer covering every owner's segment");
  const auto own = static_cast<std::size_t>(comm.rank());
  check(out.dtype() == DType::f32 && out.numel() == static_cast<std::int64_t>(counts[own]),
        "quantized reduce-scatter: out must be f32 of counts[rank] = ", counts[own],
        " elements, got ", out);

  // g + e, in f32, when error feedback is on; the gradients themselves otherwise.
  Tensor source = send.view({send.numel()}).slice(0, 0, element_at[ranks]);
  if (residual.defined()) {
    check(residual.dtype() == DType::f32 && residual.numel() == element_at[ranks],
          "quantized reduce-scatter: the error feedback residual must be f32 of ",
          element_at[ranks], " elements, got ", residual);
    Tensor corrected = empty(ctx, {element_at[ranks]}, DType::f32, MemoryCategory::communication);
    copy(ctx, corrected, source);
    add_(ctx, corrected, residual);
    source = corrected;
  }
  const Tensor wire = empty(ctx, {byte_at[ranks]}, DType::u8, MemoryCategory::communication);
  for (std::size_t r = 0; r < ranks; ++r)
    ops::quantize_blocks(ctx, format, source.slice(0, element_at[r], element_at[r + 1]), block,
                         wire.slice(0, byte_at[r], byte_at[r + 1]));
  if (residual.defined()) {
    // residual <- source - D(Q(source)): the dequantised runs, negated (x / -1 is exact), plus
    // the source -- one f32 subtraction per element, rounded once.
    for (std::size_t r = 0; r < ranks; ++r)
      ops::dequantize_blocks(ctx, format, wire.slice(0, byte_at[r], byte_at[r + 1]), block,
                             residual.slice(0, element_at[r], element_at[r + 1]));
    divide_(ctx, residual, -1.0);
    add_(ctx, residual, source);
  }

  const auto run = static_cast<std::int64_t>(bytes[own]);
  const Tensor arrived = empty(ctx, {run * static_cast<std::int64_t>(ranks)}, DType::u8,
                               MemoryCategory::communication);
  comm::Work moved = comm.all_to_all_v(wire, arrived, bytes);
  return comm::then(std::move(moved), [&ctx, wire, arrived, out, run, ranks, block, op, format] {
    (void)wire;  // held by this lambda until the runs have left
    if (out.numel() == 0) return;
    // One pass per run, dequantised and added into the sum (no temporary), in rank order.
    ops::dequantize_blocks(ctx, format, arrived.slice(0, 0, run), block, out);
    for (std::size_t q = 1; q < ranks; ++q) {
      const auto at = static_cast<std::int64_t>(q) * run;
      ops::dequantize_add_blocks(ctx, format, arrived.slice(0, at, at + run), block, out);
    }
    if (op == comm::ReduceOp::avg) divide_(ctx, out, static_cast<double>(ranks));
  });
}

}  // namespace shardkit::parallel
