// MixedPrecision: the precision policy of a sharded run, with the knobs users of PyTorch FSDP's
// MixedPrecision and FairScale's mixed_precision / fp32_reduce_scatter know:
//
//   param_dtype   the compute copy of the parameters: f32 (mixed precision off), f16 or bf16.
//                 The f32 master and the optimizer state stay f32, kept by the sharded
//                 optimizer for the pieces each rank updates; the fused step writes the
//                 rounded compute copy in the same pass.
//   reduce_dtype  what gradients travel in: param_dtype (PyTorch's default), or f32
//                 (FairScale's fp32_reduce_scatter: the sums are not rounded on the wire).
//                 Gradients are kept in param_dtype either way, as autograd forms them. In f32
//                 training (param_dtype f32) f16 or bf16 halves the traffic: the gradients are
//                 rounded on the wire and kept in f32.
//   buffer_dtype  module buffers (batch-norm statistics): f32. Statistics accumulated in
//                 16 bits lose accuracy (PyTorch issue 91879); VISSL's AMP keeps them in f32.
//   batch norm    computes in f32 whatever its input's dtype (autograd's batch_norm), as
//                 apex O1 / VISSL keep it.
//
// Per stage (N ranks, K = 12 bytes of Adam state per parameter counting the f32 master, as
// the ZeRO paper does): ddp (2 + 2 + K)Ψ; oss 4Ψ + KΨ/N; sdp 2Ψ + (2 + K)Ψ/N; fsdp
// (2 + 2 + K)Ψ/N (a compute-dtype shard of the parameters, all-gathered in the compute dtype).
#pragma once

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::parallel {

struct MixedPrecision {
  DType param_dtype = DType::f32;
  DType reduce_dtype = DType::f32;
  DType buffer_dtype = DType::f32;

  // The usual policies: compute and reduce in `dtype`.
  static MixedPrecision of(DType dtype) { return {dtype, dtype, DType::f32}; }
  bool enabled() const { return param_dtype != DType::f32; }
};

inline void validate(const MixedPrecision& p) {
  check(p.param_dtype == DType::f32 || p.param_dtype == DType::f16 || p.param_dtype == DType::bf16,
        "mixed precision: param_dtype must be f32, f16 or bf16, got ", dtype_name(p.param_dtype));
  check(
      p.reduce_dtype == DType::f32 || p.reduce_dtype == DType::f16 || p.reduce_dtype == DType::bf16,
      "mixed precision: gradients travel as f32, f16 or bf16, not reduce_dtype ",
      dtype_name(p.reduce_dtype));
  // A 16-bit wire of the other 16-bit format would round (f16 -> bf16 loses mantissa) or
  // overflow (bf16 -> f16 loses range) without anyone asking for it.
  check(p.reduce_dtype == DType::f32 || p.reduce_dtype == p.param_dtype ||
            p.param_dtype == DType::f32,
        "mixed precision: gradients computed in ", dtype_name(p.param_dtype),
        " cannot be reduced in ", dtype_name(p.reduce_dtype), " (that loses ",
        p.param_dtype == DType::bf16 ? "range: f16 overflows at 65504" : "precision",
        " silently); use reduce_dtype ", dtype_name(p.param_dtype), " or f32");
  check(p.buffer_dtype == DType::f32, "mixed precision: buffer_dtype ", dtype_name(p.buffer_dtype),
        " is not supported: batch-norm statistics in 16 bits lose accuracy (PyTorch issue "
        "91879), so shardkit keeps buffers in f32");
}

}  // namespace shardkit::parallel
