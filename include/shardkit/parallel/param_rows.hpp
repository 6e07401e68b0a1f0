// Changes to one trainable parameter outside the optimizer's rule, under any stage, on the
// pieces each rank updates:
//
//   normalize_rows   w[r] <- w[r] / max(|w[r]|_2, eps) for every row of a 2-D parameter
//                    (SwAV's prototypes after each step; torch.nn.functional.normalize). The
//                    row norms come from 16-element leaf sums of squares (ops/norm_tree.hpp's
//                    leaf order) exchanged once, so they have the same bits whether a rank holds
//                    the whole row (DDP) or a piece of it (OSS/SDP flat split, FSDP shards);
//                    all of it on the parameter's device, nothing read back.
//                    Writes the f32 masters, rounds the compute copies from them, and makes the
//                    ranks agree again (OSS/SDP: the parameter all-gather; DDP and FSDP: none).
//                    normalize_rows_after_step registers it as an engine's post-step hook,
//                    which runs on the owners' pieces before the all-gather OSS/SDP do anyway
//                    (normalize_owned_rows): no second gather.
//   zero_grad_of     the parameter's averaged gradient is set to 0 before the step (VISSL's
//                    frozen parameters; with LARC a zero gradient leaves the parameter, its
//                    momentum and its weight decay untouched, as apex's zero-norm rule says).
#pragma once

#include <span>
#include <string>

#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/training_state.hpp"

namespace shardkit::parallel {

namespace detail {

inline std::size_t table_param(const shard::PieceTable& table, const std::string& name,
                               const char* op) {
  for (std::size_t p = 0; p < table.params().size(); ++p)
    if (table.params()[p].name == name) return p;
  std::string known;
  for (const auto& p : table.params()) known += (known.empty() ? "" : ", ") + p.name;
  fail<InvalidArgument>(op, ": no trainable parameter '", name, "' (frozen parameters have no ",
                        "pieces); trainable ones: ", known);
}

// The table index of a parameter whose rows can be normalised exactly, or a clear error.
inline std::size_t row_param(const shard::PieceTable& table, const std::string& name) {
  const std::size_t p = table_param(table, name, "normalize_rows");
  const auto& param = table.params()[p];
  check(param.shape.size() == 2, "normalize_rows: '", name, "' has shape ", shape_text(param.shape),
        "; rows need a 2-D parameter");
  check(param.shape[1] % ops::kNormLeaf == 0, "normalize_rows: rows of '", name, "' hold ",
        param.shape[1], " elements; exact norms under sharding need a multiple of ", ops::kNormLeaf,
        " (e.g. an embedding dimension of 128)");
  return p;
}

}  // namespace detail

// normalize_rows on this rank's pieces only: the ranks' copies of the parameter agree again
// once the owners' ranges are gathered (OSS/SDP), or at once (DDP, FSDP). Collective when the
// table is sharded (the row norms' leaves are exchanged). Runs where the parameter lives: the
// leaf sums, their exchange (ordered on the stream) and the division by the row norms are
// device work, with nothing read back -- a captured step can hold it. After a step the step
// gate skipped (an overflow), nothing changes.
inline void normalize_owned_rows(Context& ctx, optim::ShardedOptimizer& optimizer,
                                 comm::Communicator* comm, const std::string& name,
                                 double eps = 1e-12) {
  const auto& table = optimizer.table();
  const std::size_t p = detail::row_param(table, name);
  const auto& param = table.params()[p];
  const std::int64_t cols = param.shape[1];
  // Where the f32 masters live: the parameters' context, or the host's under CPU offload.
  Context& where = optimizer.host_context();
  // This rank's leaves (others stay 0; every leaf lies in exactly one rank's pieces, and pieces
  // start on leaf boundaries).
  const Tensor leaves = zeros(where, {param.numel / ops::kNormLeaf}, DType::f64);
  const auto& pieces = optimizer.pieces();
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (pieces[k].param != p) continue;
    const std::int64_t first = pieces[k].param_begin / ops::kNormLeaf;
    const Tensor piece = optimizer.master_params()[k];
    ops::leaf_sums_of_squares(where, std::span<const Tensor>(&piece, 1),
                              leaves.slice(0, first, first + ops::norm_leaves(piece.numel())));
  }
  if (!table.replicated() && table.world_size() > 1) {
    check(comm != nullptr, "normalize_rows: '", name, "' is sharded but no communicator was given");
    // x + 0 + ... + 0: exact. Offloaded masters' leaves go through the device (NCCL reduces
    // device memory only); an offloaded step waits for its host side anyway.
    if (leaves.device() == ctx.device()) {
      comm->all_reduce(leaves, comm::ReduceOp::sum).wait_on_stream();
    } else {
      const Tensor staged = to_device(ctx, leaves, ctx.device());
      comm->all_reduce(staged, comm::ReduceOp::sum).wait();
      copy(ctx, leaves, staged);
    }
  }
  // The gate is the device's; under offload the hook runs after applied steps only.
  const Tensor& gate = optimizer.step_gate();
  for (std::size_t k = 0; k < pieces.size(); ++k)
    if (pieces[k].param == p)
      ops::normalize_rows_by_leaves(
          where, optimizer.master_params()[k], pieces[k].param_begin, cols, leaves, eps,
          gate.defined() && gate.device() == where.device() ? gate : Tensor());
  optimizer.copy_masters_to_params();  // mixed precision: the compute copies follow
  optimizer.spill_state();             // (offload to NVMe: the written rows out of RAM)
}

inline void normalize_rows(Context& ctx, TrainingState& state, const std::string& name,
                           double eps = 1e-12) {
  normalize_owned_rows(ctx, *state.optimizer, state.comm, name, eps);
  if (state.after_load) state.after_load();
}

// From now on every applied step of `engine` ends with normalize_rows(name), on the pieces this
// rank updated, before the owners' ranges are gathered: a post-step hook (VISSL's
// NormalizePrototypesHook, exact and alike under every stage).
inline void normalize_rows_after_step(Engine& engine, const std::string& name, double eps = 1e-12) {
  (void)detail::row_param(engine.table(), name);  // refused now, not at the first step
  // Gated (the pass reads the step gate) where the masters live on the gate's device; an
  // offloaded optimizer's hook runs after applied steps only.
  engine.register_post_step_hook(
      [name, eps](Engine& e) {
        normalize_owned_rows(e.context(), e.optimizer(), &e.communicator(), name, eps);
      },
      !engine.optimizer().offloaded());
}

// Between the backward and the step: `name`'s averaged gradient is 0 on every rank.
inline void zero_grad_of(Engine& engine, const std::string& name) {
  const auto& optimizer = engine.optimizer();
  const std::size_t p = detail::table_param(optimizer.table(), name, "zero_grad_of");
  const auto& pieces = optimizer.pieces();
  for (std::size_t k = 0; k < pieces.size(); ++k)
    if (pieces[k].param == p) fill(engine.grads_context(), engine.piece_grads()[k], 0.0);
}

}  // namespace shardkit::parallel
