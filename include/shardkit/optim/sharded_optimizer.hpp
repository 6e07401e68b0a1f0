// ShardedOptimizer: SGD, LARC-SGD, Adam or AdamW over the pieces of parameters one rank
// updates (a PieceTable row), with optimizer state for those pieces only (MemoryCategory::
// optimizer_state). Under DDP the pieces are every parameter; under OSS/SDP the rank's range of
// the flat buffer; under FSDP the rank's shard of every unit.
//
// LARC needs each parameter's whole norm: ParamNorms forms it from the pieces, with the same
// bits however the parameter is split (one small all_gather_v when pieces sit on several
// ranks), so LARC under every stage is bitwise LARC of whole tensors.
//
// CPU offload (OptimizerOffload; DeepSpeed's ZeRO-Offload, PyTorch FSDP's CPUOffload,
// FairScale's move_grads_to_cpu): the f32 master, the state buffers and the step live on a host
// context and run on its threads with the same fused functors (ops::Cpu), so an offloaded step
// computes the same bits as one on the CPU without offload. The gradients come down in one batch
// of copies before the step; the updated parameters go back up in chunks of pieces, each chunk's
// copy queued while the next chunk is updated. Device memory then holds no optimizer state.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/adam.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/op_args.hpp"
#include "shardkit/ops/sgd.hpp"
#include "shardkit/optim/param_norms.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

enum class OptimizerKind { sgd, larc_sgd, adam, adamw };

inline std::string_view optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::sgd:
      return "sgd";
    case OptimizerKind::larc_sgd:
      return "larc_sgd";
    case OptimizerKind::adam:
      return "adam";
    case OptimizerKind::adamw:
      return "adamw";
  }
  return "?";
}

inline OptimizerKind parse_optimizer_kind(std::string_view name) {
  for (auto kind :
       {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adam, OptimizerKind::adamw})
    if (optimizer_kind_name(kind) == name) return kind;
  fail<InvalidArgument>("unknown optimizer '", name, "'; use sgd, larc_sgd, adam or adamw");
}

inline bool is_adam(OptimizerKind kind) {
  return kind == OptimizerKind::adam || kind == OptimizerKind::adamw;
}

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  ops::SgdOptions sgd;    // sgd, larc_sgd (lr is set per step)
  ops::LarcOptions larc;  // larc_sgd: takes sgd.weight_decay over
  ops::AdamOptions adam;  // adam, adamw
  // Trainable parameters (state-dict names) that get no weight decay: PyTorch's parameter group
  // with weight_decay 0, which VISSL builds for batch-norm parameters and biases when
  // regularize_bn / regularize_bias are False. Under LARC the decay is also left out of the
  // trust ratio, as apex's LARC reads it from the group. sgd and larc_sgd.
  std::vector<std::string> no_weight_decay;
};

// PyTorch's names of the state buffers an optimizer keeps per parameter, in order.
inline std::vector<std::string_view> state_buffer_names(const OptimizerConfig& config) {
  if (is_adam(config.kind)) return {"exp_avg", "exp_avg_sq"};
  if (config.sgd.momentum != 0) return {"momentum_buffer"};
  return {};
}

// One state buffer of a rank: its PyTorch name and its values over the rank's state range.
struct StateBuffer {
  std::string_view name;
  Tensor values;
};

// Where an optimizer keeps its master, state and step (see the top): on the parameters' context
// (host == nullptr), or offloaded to a CPU context.
struct OptimizerOffload {
  Context* host = nullptr;  // a CPU context (sk::make_host_context); nullptr: no offload
  // The piece views given are themselves in `host`'s memory (FSDP's offloaded parameter
  // shards): the step then updates them in place, nothing goes back up.
  bool params_on_host = false;
  // Offloaded updates run in chunks of whole pieces of at least this many elements; each
  // chunk's parameters are queued for the device before the next chunk is updated.
  std::int64_t chunk_numel = std::int64_t{1} << 22;
  bool enabled() const { return host != nullptr; }
};

class ShardedOptimizer {
 public:
  // Updates the pieces `table.pieces(rank)`; `piece_params[k]` views piece k's parameter
  // elements. f32 views are the parameters themselves. f16/bf16 views are the compute copy of
  // mixed precision: the optimizer then keeps an f32 master of its pieces (MemoryCategory::
  // optimizer_state, as the ZeRO paper counts it; laid out like the state buffers), starting
  // from the copy's values (set_master for exact ones), updates the master and writes the
  // rounded copy in the same fused pass. `norm_comm` joins the table's ranks for norms of
  // parameters split over them (nullptr: one rank, or a replicated table). `offload` moves the
  // master (f32 training too), the state and the step to a host context (see the top).
  ShardedOptimizer(Context& ctx, const shard::PieceTable& table, int rank,
                   std::vector<Tensor> piece_params, OptimizerConfig config,
                   comm::Communicator* norm_comm, OptimizerOffload offload = {})
      : ctx_(&ctx),
        host_(offload.enabled() ? offload.host : &ctx),
        offload_(offload),
        table_(&table),
        rank_(rank),
        piece_params_(std::move(piece_params)),
        config_(config),
        norms_(ctx, table, rank, norm_comm) {
    check(piece_params_.size() == table.pieces(rank).size(),
          "ShardedOptimizer: ", piece_params_.size(), " parameter views for ",
          table.pieces(rank).size(), " pieces; pass one per piece, in the table's order");
    check(!offload.enabled() || offload.host->device().is_cpu(),
          "ShardedOptimizer: the offload context is on ", host_->device().str(),
          "; offload needs a CPU context (sk::make_host_context(ctx))");
    check(offload.chunk_numel > 0, "ShardedOptimizer: offload chunk_numel must be > 0, got ",
          offload.chunk_numel);
    if (config_.kind == OptimizerKind::larc_sgd) {
      // LARC takes the weight decay over (docs/semantics.md): the wrapped SGD runs without it.
      if (config_.larc.weight_decay == 0) config_.larc.weight_decay = config_.sgd.weight_decay;
      config_.sgd.weight_decay = 0;
      ops::validate(config_.larc);
    }
    if (config_.kind == OptimizerKind::adamw) config_.adam.decoupled_weight_decay = true;
    set_decay_groups();
    const DType dtype = piece_params_.empty() ? DType::f32 : piece_params_[0].dtype();
    for (const auto& p : piece_params_)
      check(p.dtype() == dtype &&
                (dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16),
            "ShardedOptimizer: parameter views are f32, or all f16 / all bf16 (mixed "
            "precision), got ",
            dtype_name(p.dtype()), " beside ", dtype_name(dtype));
    const bool params_here = !offload.enabled() || offload.params_on_host;
    if (dtype == DType::f32 && params_here) {
      master_ = piece_params_;
    } else {
      master_buffer_ =
          zeros(*host_, {table.state_numel(rank)}, DType::f32, MemoryCategory::optimizer_state);
      master_ = state_views(master_buffer_);
      // Offloaded mixed precision with the compute copy on the device: the fused pass writes
      // the rounded copy here, and it goes up as it is.
      if (dtype != DType::f32 && !params_here) {
        low_buffer_ = zeros(*host_, {table.state_numel(rank)}, dtype, MemoryCategory::parameters);
        low_ = state_views(low_buffer_);
      }
      copy_params_to_masters();
    }
    for (auto name : state_buffer_names(config_))
      buffers_.push_back(StateBuffer{name, zeros(*host_, {table.state_numel(rank)}, DType::f32,
                                                 MemoryCategory::optimizer_state)});
  }

  // One step. `grads` holds one gradient view per piece, in pieces() order. `lr` overrides the
  // configured rate (schedules); `inv_grad_scale` unscales loss-scaled gradients.
  void step(const std::vector<Tensor>& grads, float lr, float inv_grad_scale = 1.0f) {
    const auto& pieces = this->pieces();
    check(grads.size() == pieces.size(), "ShardedOptimizer::step: ", grads.size(),
          " gradients for ", pieces.size(), " pieces; pass one per piece, in pieces() order");
    inv_grad_scale *= clip_coefficient_;  // from clip_grad_norm, for this step only
    clip_coefficient_ = 1.0f;
    ++steps_;
    if (!offloaded()) return update(*ctx_, grads, lr, inv_grad_scale);
    update(*host_, staged_grads(grads), lr, inv_grad_scale);
  }

  // torch.nn.utils.clip_grad_norm_ over the whole model (docs/semantics.md): the L2 norm of
  // every parameter's gradient (`grads` as for step(), times inv_grad_scale), exact under every
  // stage -- per-parameter norms from ParamNorms, added in the order of the parameters' names
  // -- and returned; when it exceeds max_norm, the next step() scales the gradients by
  // max_norm / (norm + 1e-6) in its fused pass. Collective when the table is sharded.
  double clip_grad_norm(const std::vector<Tensor>& grads, double max_norm,
                        float inv_grad_scale = 1.0f) {  // (1 / the loss scale, if any)
    check(max_norm > 0, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
    const auto sums = norms_.sums({grads})[0];
    if (by_name_.empty()) {
      for (std::size_t p = 0; p < table_->params().size(); ++p) by_name_.push_back(p);
      std::sort(by_name_.begin(), by_name_.end(), [&](std::size_t a, std::size_t b) {
        return table_->params()[a].name < table_->params()[b].name;
      });
    }
    double total = 0;
    for (auto p : by_name_) total += sums[p];
    const double norm = std::sqrt(total) * static_cast<double>(inv_grad_scale);
    const double coefficient = max_norm / (norm + 1e-6);
    // (A NaN or inf norm gives a NaN coefficient, as PyTorch's does: the step then shows it.)
    clip_coefficient_ =
        coefficient < 1.0 || std::isnan(coefficient) ? static_cast<float>(coefficient) : 1.0f;
    return norm;
  }

  // A skipped step (loss scaling found an overflow): forget clip_grad_norm's coefficient.
  void discard_clip() { clip_coefficient_ = 1.0f; }

  std::int64_t steps() const { return steps_; }
  // Resuming from a checkpoint: the step count drives SGD's first-step rule and Adam's bias
  // correction, so it travels with the state (OptimizerState::steps).
  void set_steps(std::int64_t steps) {
    check(steps >= 0, "ShardedOptimizer::set_steps: steps must be >= 0, got ", steps);
    steps_ = steps;
  }
  Context& context() const { return *ctx_; }
  int rank() const { return rank_; }
  const shard::PieceTable& table() const { return *table_; }
  const OptimizerConfig& config() const { return config_; }
  const std::vector<shard::OwnedPiece>& pieces() const { return table_->pieces(rank_); }
  // The views given at construction: the parameters, or under mixed precision their compute
  // copy.
  const std::vector<Tensor>& piece_params() const { return piece_params_; }
  // The f32 values the optimizer updates (what checkpoints save): piece_params() itself, or
  // under mixed precision the f32 master.
  const std::vector<Tensor>& master_params() const { return master_; }
  bool mixed_precision() const { return compute_dtype() != DType::f32; }
  // Whether the f32 values the optimizer updates are a copy apart from piece_params() (mixed
  // precision, or offload): then values written into the parameters must reach the masters
  // (copy_params_to_masters), and masters written reach the parameters (copy_masters_to_params).
  bool separate_master() const { return master_buffer_.defined(); }
  // CPU offload: the master, state and step live in host memory (host_context()).
  bool offloaded() const { return offload_.enabled(); }
  // Where the master and state live and the step runs: the parameters' context, or the host's.
  Context& host_context() const { return *host_; }
  DType compute_dtype() const {
    return piece_params_.empty() ? DType::f32 : piece_params_[0].dtype();
  }
  // Piece k's master takes exact f32 values (a view of piece k's elements, on any device);
  // the parameter follows (rounded under mixed precision).
  void set_master(std::size_t k, const Tensor& values) {
    check(k < master_.size(), "ShardedOptimizer::set_master: no piece ", k);
    copy(*ctx_, master_[k], values);
    if (separate_master()) push_to_param(k);
  }
  // After the masters were written (a checkpoint load): the parameters take their (rounded)
  // values. Nothing to do when the parameters are the masters.
  void copy_masters_to_params() {
    if (!separate_master()) return;
    for (std::size_t k = 0; k < master_.size(); ++k) push_to_param(k);
  }
  // After the parameters were written (e.g. broadcast): the masters take their values.
  void copy_params_to_masters() {
    if (!separate_master()) return;
    for (std::size_t k = 0; k < master_.size(); ++k) {
      if (low_.empty()) {
        copy(*ctx_, master_[k], piece_params_[k]);  // one device, or f32 between two
      } else {  // 16 bits on the device, f32 on the host: come down as they are, widen here
        copy(*ctx_, low_[k], piece_params_[k]);
        copy(*host_, master_[k], low_[k]);
      }
    }
  }
  // The state buffers over this rank's state range, by PyTorch's names (momentum_buffer;
  // exp_avg and exp_avg_sq); none without state. The handles share the storage:
  // load_optimizer_state() writes through them.
  const std::vector<StateBuffer>& state_buffers() const { return buffers_; }

 private:
  // This rank's views of a buffer laid out like the state (one per piece).
  std::vector<Tensor> state_views(const Tensor& buffer) const {
    std::vector<Tensor> views;
    for (const auto& piece : pieces())
      views.push_back(buffer.slice(0, piece.state_offset, piece.state_offset + piece.numel()));
    return views;
  }

  // Master k to parameter k: rounded on the host and sent up as 16 bits when offloaded under
  // mixed precision, else one copy (rounding on one device, or f32 between two).
  void push_to_param(std::size_t k) {
    if (low_.empty()) return copy(*ctx_, piece_params_[k], master_[k]);
    copy(*host_, low_[k], master_[k]);
    copy(*ctx_, piece_params_[k], low_[k]);
  }

  // Offload: this step's gradients in host memory, laid out like the state (one batch of
  // copies, then one wait).
  const std::vector<Tensor>& staged_grads(const std::vector<Tensor>& grads) {
    if (grads.empty()) return grads;
    if (!grad_buffer_.defined() || grad_buffer_.dtype() != grads[0].dtype()) {
      grad_buffer_ = Tensor();
      grad_buffer_ =
          empty(*host_, {table_->state_numel(rank_)}, grads[0].dtype(), MemoryCategory::gradients);
      host_grads_ = state_views(grad_buffer_);
    }
    for (std::size_t k = 0; k < grads.size(); ++k) copy_async(*ctx_, host_grads_[k], grads[k]);
    ctx_->synchronize();
    return host_grads_;
  }

  // The update on context `c` (the parameters' context, or the host's when offloaded): coefficients
  // for every piece first (LARC's trust ratios need every norm), then the fused pass in chunks of
  // pieces; offloaded, each chunk's new parameters are queued for the device before the next chunk
  // is updated, and the step waits for the last.
  void update(Context& c, const std::vector<Tensor>& g, float lr, float inv_grad_scale) {
    const auto& pieces = this->pieces();
    const std::vector<Tensor>& p = master_;
    if (pieces.empty()) {  // more ranks than parameters: nothing to update here, but the
      if (config_.kind == OptimizerKind::larc_sgd)  // norms' exchange may be collective
        (void)larc_coefficients(c, p, g, lr, inv_grad_scale);
      return;
    }
    const std::vector<Tensor> a =
        buffers_.size() > 0 ? state_views(buffers_[0].values) : std::vector<Tensor>{};
    const std::vector<Tensor> b =
        buffers_.size() > 1 ? state_views(buffers_[1].values) : std::vector<Tensor>{};
    const std::vector<Tensor> none;
    const std::vector<Tensor>& low = !mixed_precision() ? none
                                     : low_.empty()     ? piece_params_
                                                        : low_;
    ops::SgdOptions sgd = config_.sgd;
    sgd.lr = lr;
    sgd.first_step = steps_ == 1;
    ops::AdamOptions adam = config_.adam;
    adam.lr = lr;
    adam.step = steps_;
    adam.inv_grad_scale = inv_grad_scale;
    const bool send_up = offloaded() && !offload_.params_on_host;
    // Every piece whole here (DDP, or one rank) on a device that pipelines it (the CPU):
    // norms, coefficients and update in one pass, with ParamNorms' bits. (Offloaded with the
    // params on the device, the update goes by chunks, each sent up before the next: that stays
    // the composed path.)
    if (config_.kind == OptimizerKind::larc_sgd && !send_up && norms_.pieces_whole() &&
        ops::has_larc_sgd_step_tree(c)) {
      std::vector<double> decays;  // per piece, when no_weight_decay names any
      if (!decay_.empty())
        for (const auto& piece : pieces) decays.push_back(decay_[piece.param]);
      ops::SgdOptions scaled = sgd;
      scaled.inv_grad_scale = inv_grad_scale;
      return ops::larc_sgd_step_tree(c, scaled, config_.larc, ops::SgdTensors{p, g, a, low},
                                     decays);
    }
    Tensor coefficients;  // [n, 2] per-piece (grad, param) factors of the SGD rule, or none
    if (config_.kind == OptimizerKind::larc_sgd) {
      coefficients = larc_coefficients(c, p, g, lr, inv_grad_scale);
    } else if (config_.kind == OptimizerKind::sgd && !decay_.empty()) {
      std::vector<float> factors;  // per-parameter decay: g' = inv_grad_scale·g + decay·w
      for (const auto& piece : pieces) {
        factors.push_back(inv_grad_scale);
        factors.push_back(static_cast<float>(decay_[piece.param]));
      }
      sgd.weight_decay = 0;
      coefficients = from_vector(c, factors, {static_cast<std::int64_t>(pieces.size()), 2});
    } else {
      sgd.inv_grad_scale = inv_grad_scale;
    }
    const std::size_t n = pieces.size();
    for (std::size_t begin = 0, end = 0; begin < n; begin = end) {
      std::int64_t numel = 0;
      end = begin;
      while (end < n && (!send_up || numel < offload_.chunk_numel)) numel += pieces[end++].numel();
      const auto part = [&](const std::vector<Tensor>& v) {
        return v.empty() ? v
                         : std::vector<Tensor>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                                               v.begin() + static_cast<std::ptrdiff_t>(end));
      };
      if (is_adam(config_.kind)) {
        ops::adam_step(c, adam, ops::AdamTensors{part(p), part(g), part(a), part(b), part(low)});
      } else if (coefficients.defined()) {
        ops::sgd_step(c, sgd, ops::SgdTensors{part(p), part(g), part(a), part(low)},
                      coefficients.slice(0, static_cast<std::int64_t>(begin),
                                         static_cast<std::int64_t>(end)));
      } else {
        ops::sgd_step(c, sgd, ops::SgdTensors{part(p), part(g), part(a), part(low)});
      }
      if (send_up)
        for (std::size_t k = begin; k < end; ++k)
          copy_async(*ctx_, piece_params_[k], low_.empty() ? master_[k] : low_[k]);
    }
    if (send_up) ctx_->synchronize();
  }

  // Per-piece [n, 2] coefficients from whole-parameter sums of squares, formed on context `c`
  // (where p and g live).
  Tensor larc_coefficients(Context& c, const std::vector<Tensor>& p, const std::vector<Tensor>& g,
                           float lr, float inv_grad_scale) {
    const auto& pieces = this->pieces();
    const auto n = static_cast<std::int64_t>(pieces.size());
    const auto whole = norms_.sums_on(c, {p, g});  // collective when split
    if (n == 0) return Tensor();
    const std::int64_t rows = decay_.empty() ? 2 : 3;  // row 2: per-parameter decays
    std::vector<double> per_piece(static_cast<std::size_t>(rows * n));
    for (std::size_t s = 0; s < pieces.size(); ++s) {
      per_piece[s] = whole[0][pieces[s].param];
      per_piece[static_cast<std::size_t>(n) + s] = whole[1][pieces[s].param];
      if (rows == 3) per_piece[static_cast<std::size_t>(2 * n) + s] = decay_[pieces[s].param];
    }
    const Tensor sums = from_vector(c, per_piece, {rows, n});
    const Tensor coefficients = empty(c, {n, 2}, DType::f32, MemoryCategory::other);
    ops::larc_coefficients(c, config_.larc, lr, inv_grad_scale, sums, coefficients);
    return coefficients;
  }

  // decay_[p]: table parameter p's weight decay, when config_.no_weight_decay names any.
  void set_decay_groups() {
    if (config_.no_weight_decay.empty()) return;
    check(!is_adam(config_.kind), "ShardedOptimizer: no_weight_decay names ",
          config_.no_weight_decay.size(), " parameters, but per-parameter weight decay is ",
          "implemented for sgd and larc_sgd only, not ", optimizer_kind_name(config_.kind),
          "; leave no_weight_decay empty");
    const double decay = config_.kind == OptimizerKind::larc_sgd ? config_.larc.weight_decay
                                                                 : config_.sgd.weight_decay;
    const auto& params = table_->params();
    decay_.assign(params.size(), decay);
    for (const auto& name : config_.no_weight_decay) {
      auto it = std::find_if(params.begin(), params.end(),
                             [&](const auto& param) { return param.name == name; });
      if (it == params.end()) {
        std::string known;
        for (const auto& param : params) known += (known.empty() ? "" : ", ") + param.name;
        fail<InvalidArgument>("ShardedOptimizer: no_weight_decay names '", name,
                              "', which is not a trainable parameter; trainable ones: ", known);
      }
      decay_[static_cast<std::size_t>(it - params.begin())] = 0.0;
    }
  }

  Context* ctx_;   // the parameters' (and gradients') context
  Context* host_;  // where the master, state and step live: ctx_, or the offload context
  OptimizerOffload offload_;
  const shard::PieceTable* table_;
  int rank_;
  std::vector<Tensor> piece_params_;
  Tensor master_buffer_;        // mixed precision or offload: the f32 master of the pieces
  std::vector<Tensor> master_;  // per piece: views of it, or piece_params_ without
  Tensor low_buffer_;           // offloaded mixed precision: the rounded copy, on its way up
  std::vector<Tensor> low_;     // per piece: views of it (empty otherwise)
  Tensor grad_buffer_;          // offload: the step's gradients in host memory
  std::vector<Tensor> host_grads_;
  OptimizerConfig config_;
  ParamNorms norms_;
  std::vector<double> decay_;         // per table parameter; empty: one decay for all
  std::vector<std::size_t> by_name_;  // table parameters in the order of their names
  float clip_coefficient_ = 1.0f;     // set by clip_grad_norm, used by the next step
  std::vector<StateBuffer> buffers_;
  std::int64_t steps_ = 0;
};

}  // namespace shardkit::optim
