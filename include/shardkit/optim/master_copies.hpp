// MasterCopies: where an optimizer's f32 values live and how they reach the parameters it
// updates -- the precision side of the sharded optimizer.
//
//   f32 parameters, optimizer on their own context: the parameters are the masters (no copy).
//   mixed precision (f16 / bf16 piece views), or an offloaded optimizer: an f32 master of the
//     pieces (MemoryCategory::optimizer_state, as the ZeRO paper counts it; laid out like the
//     state buffers) on the optimizer's home context, from which the parameters take their
//     (rounded) values;
//   offloaded mixed precision with the compute copy on the device: also a rounded copy on the
//     host (`low`), which the fused pass writes and which goes up as it is.
#pragma once

#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

// Rank `rank`'s views of a buffer laid out like its optimizer state (one per piece).
inline std::vector<Tensor> state_views(const shard::PieceTable& table, int rank,
                                       const Tensor& buffer) {
  std::vector<Tensor> views;
  for (const auto& piece : table.pieces(rank))
    views.push_back(buffer.slice(0, piece.state_offset, piece.state_offset + piece.numel()));
  return views;
}

class MasterCopies {
 public:
  // `params_here`: the piece views live where the update runs (`home`; no offload, or FSDP's
  // parameter shards offloaded with it). A separate master is made on `master_home` (on disk
  // under offload to NVMe; `home` otherwise).
  MasterCopies(Context& ctx, Context& home, const shard::PieceTable& table, int rank,
               std::vector<Tensor> piece_params, bool params_here, Context* master_home = nullptr)
      : ctx_(&ctx), home_(&home), piece_params_(std::move(piece_params)) {
    const DType dtype = compute_dtype();
    for (const auto& p : piece_params_)
      check(p.dtype() == dtype &&
                (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16),
            "ShardedOptimizer: parameter views are f32, or all f16 / all bf16 (mixed "
            "precision), got ",
            dtype_name(p.dtype()), " beside ", dtype_name(dtype));
    if (dtype == DType::f32 && params_here) {
      master_ = piece_params_;
      return;
    }
    master_buffer_ = zeros(master_home != nullptr ? *master_home : home, {table.state_numel(rank)},
                           DType::f32, MemoryCategory::optimizer_state);
    master_ = state_views(table, rank, master_buffer_);
    if (dtype != DType::f32 && !params_here) {
      low_buffer_ = zeros(home, {table.state_numel(rank)}, dtype, MemoryCategory::parameters);
      low_ = state_views(table, rank, low_buffer_);
    }
    from_params();
  }

  DType compute_dtype() const {
    return piece_params_.empty() ? DType::f32 : piece_params_[0].dtype();
  }
  bool mixed_precision() const { return compute_dtype() != DType::f32; }
  // Whether the masters are a copy apart from the parameters: then values written into the
  // parameters must reach the masters (from_params), and masters written the parameters
  // (to_params).
  bool separate() const { return master_buffer_.defined(); }
  const std::vector<Tensor>& piece_params() const { return piece_params_; }
  // The f32 values the update writes (what checkpoints save).
  const std::vector<Tensor>& masters() const { return master_; }
  // The fused pass's rounded output: none in f32; the host copy when offloaded with the compute
  // copy on the device; else the compute copy itself.
  const std::vector<Tensor>& low_copies() const {
    return !mixed_precision() ? none_ : low_.empty() ? piece_params_ : low_;
  }
  // What goes up to parameter k after an offloaded update: the rounded copy, or the f32 master.
  const Tensor& outgoing(std::size_t k) const { return low_.empty() ? master_[k] : low_[k]; }

  // Piece k's master takes exact f32 values (a view of piece k's elements, on any device); the
  // parameter follows (rounded under mixed precision).
  void set(std::size_t k, const Tensor& values) {
    check(k < master_.size(), "ShardedOptimizer::set_master: no piece ", k);
    copy(*ctx_, master_[k], values);
    if (separate()) push(k);
  }
  // After the masters were written (a checkpoint load): the parameters take their (rounded)
  // values. Nothing to do when the parameters are the masters.
  void to_params() {
    if (!separate()) return;
    for (std::size_t k = 0; k < master_.size(); ++k) push(k);
  }
  // After the parameters were written (e.g. broadcast): the masters take their values.
  void from_params() {
    if (!separate()) return;
    for (std::size_t k = 0; k < master_.size(); ++k) {
      if (low_.empty()) {
        copy(*ctx_, master_[k], piece_params_[k]);  // one device, or f32 between two
      } else {  // 16 bits on the device, f32 on the host: come down as they are, widen here
        copy(*ctx_, low_[k], piece_params_[k]);
        copy(*home_, master_[k], low_[k]);
      }
    }
  }

 private:
  // Master k to parameter k: rounded on the host and sent up as 16 bits when offloaded under
  // mixed precision, else one copy (rounding on one device, or f32 between two).
  void push(std::size_t k) {
    if (low_.empty()) return copy(*ctx_, piece_params_[k], master_[k]);
    copy(*home_, low_[k], master_[k]);
    copy(*ctx_, piece_params_[k], low_[k]);
  }

  Context* ctx_;   // the parameters' context
  Context* home_;  // where the masters live: ctx_, or the offload host context
  std::vector<Tensor> piece_params_;
  Tensor master_buffer_;        // mixed precision or offload: the f32 master of the pieces
  std::vector<Tensor> master_;  // per piece: views of it, or piece_params_ without
  Tensor low_buffer_;           // offloaded mixed precision: the rounded copy, on its way up
  std::vector<Tensor> low_;     // per piece: views of it (empty otherwise)
  std::vector<Tensor> none_;
};

}  // namespace shardkit::optim
