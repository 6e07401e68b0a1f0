// SwAV's codes: the distributed Sinkhorn-Knopp iteration as VISSL's distributed_sinkhornknopp
// computes it (docs/swav.md, "Codes"). Each rank holds the scores of its own samples; the
// prototype sums and the global maximum and total are all-reduced, the per-sample sums stay
// local, so every rank ends with the codes of its samples under one global equipartition.
// The iteration runs on the context's device, its all-reduces too: a step reads nothing back.
#pragma once

#include <cstdint>

#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/comm/reduction.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace swav {

namespace sk = shardkit;

struct SinkhornOptions {
  double epsilon = 0.05;              // softness of the codes: exp(scores / epsilon)
  int num_iters = 3;                  // alternating normalisations
  bool use_double_precision = false;  // compute in f64 instead of f32
  bool hard_assignment = false;       // one-hot codes (VISSL's temp_hard_assignment_iters)
};

// Codes [code_rows, k] (f32, on the context's device) of the first `code_rows` rows of this
// rank's `scores` [rows, k] (f32, contiguous, on the context's device). Every step runs on the
// device (autograd's sinkhorn_* kernels) and so do the all-reduces: `all_reduce(tensor, op)`
// reduces a tensor on the context's device over the ranks in place, ordered on the context's
// stream (sum or max); every rank must call with the same rows and k. Nothing is read back,
// so a captured step can hold the whole iteration.
//
// VISSL's guard against an empty prototype (some column sum 0: add 1e-12 everywhere, sum
// again) is a branch on a reduced value; here each iteration sums once more into `u_again`,
// which the kernels fill only when the guard fires and otherwise leave 0, and all-reduces it:
// one more all-reduce of k values per iteration instead of a host read.
template <class AllReduce>
sk::Tensor distributed_sinkhorn(sk::Context& ctx, const sk::Tensor& scores, std::int64_t code_rows,
                                int world_size, const SinkhornOptions& options,
                                AllReduce&& all_reduce) {
  sk::check(scores.dim() == 2 && scores.dtype() == sk::DType::f32 && scores.is_contiguous(),
            "distributed_sinkhorn: scores ", sk::shape_text(scores.shape()), " ",
            sk::dtype_name(scores.dtype()),
            " are not a contiguous f32 [samples, prototypes] matrix; cast them to f32 first");
  const std::int64_t rows = scores.size(0), k = scores.size(1);
  sk::check(rows > 0 && k > 0 && code_rows >= 0 && code_rows <= rows,
            "distributed_sinkhorn: ", code_rows, " code rows of scores ",
            sk::shape_text(scores.shape()), " (samples x prototypes; the code rows come first)");
  sk::check(options.epsilon > 0, "distributed_sinkhorn: epsilon ", options.epsilon,
            " must be positive (VISSL's default is 0.05; 0.03 against collapse)");
  sk::check(options.num_iters >= 1, "distributed_sinkhorn: num_iters ", options.num_iters,
            " must be at least 1 (VISSL's default is 3)");
  namespace ag = shardkit::autograd;
  const auto& kernels = ag::kernels_for(ctx, scores);
  const sk::DType dtype = options.use_double_precision ? sk::DType::f64 : sk::DType::f32;
  const sk::Tensor q = sk::empty(ctx, {rows, k}, dtype);
  const sk::Tensor shift = sk::empty(ctx, {1}, dtype), total = sk::empty(ctx, {1}, dtype);
  const sk::Tensor u = sk::empty(ctx, {k}, dtype), u_again = sk::empty(ctx, {k}, dtype);
  const sk::Tensor v = sk::empty(ctx, {k}, dtype);
  // exp(scores / epsilon - global max): the shift cancels in the normalisation below and keeps
  // exp from overflowing (VISSL shifts in f32; in f64 nothing can overflow, the shift only
  // changes rounding).
  kernels.sinkhorn_scale(ctx, scores, q, shift, options.epsilon);
  all_reduce(shift, sk::comm::ReduceOp::max);
  kernels.sinkhorn_exp(ctx, q, shift, total);
  all_reduce(total, sk::comm::ReduceOp::sum);
  for (int it = 0; it < options.num_iters; ++it) {
    // The first column sums divide by the total on the way.
    kernels.sinkhorn_column_sums(ctx, q, it == 0 ? total : sk::Tensor(), sk::Tensor(), u, rows, k);
    all_reduce(u, sk::comm::ReduceOp::sum);
    kernels.sinkhorn_column_sums(ctx, q, sk::Tensor(), u, u_again, rows, k);
    if (world_size > 1) all_reduce(u_again, sk::comm::ReduceOp::sum);
    kernels.sinkhorn_scale_rows(ctx, q, u, u_again, v, rows, k, rows * std::int64_t{world_size});
  }
  // Every sample's code sums to 1.
  sk::Tensor codes = sk::empty(ctx, {code_rows, k}, sk::DType::f32);
  kernels.sinkhorn_codes(ctx, q, codes, code_rows, k, options.hard_assignment);
  return codes;
}

}  // namespace swav
