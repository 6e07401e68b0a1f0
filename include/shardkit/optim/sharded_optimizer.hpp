// ShardedOptimizer: SGD, LARC-SGD, Adam or AdamW over the pieces of parameters one rank
// updates (a PieceTable row), with optimizer state for those pieces only (MemoryCategory::
// optimizer_state). Under DDP the pieces are every parameter; under OSS/SDP the rank's range of
// the flat buffer; under FSDP the rank's shard of every unit. Three parts, one concern each:
//
//   UpdateRule       the algorithm (update_rule.hpp): the fused SGD / LARC-SGD / Adam update.
//                    LARC needs each parameter's whole norm: ParamNorms forms it from the
//                    pieces, with the same bits however the parameter is split (one small
//                    all_gather_v when pieces sit on several ranks), so LARC under every stage
//                    is bitwise LARC of whole tensors.
//   MasterCopies     precision (master_copies.hpp): the f32 masters of mixed precision and
//                    offload, and how the parameters follow them.
//   OffloadTransport CPU offload (offload_transport.hpp; DeepSpeed's ZeRO-Offload, PyTorch
//                    FSDP's CPUOffload, FairScale's move_grads_to_cpu): the master, the state
//                    and the step live on a host context and run on its threads with the same
//                    fused functors, so an offloaded step computes the same bits as one on the
//                    CPU without offload; gradients come down before the step, parameters go
//                    up in chunks overlapping the update. Device memory then holds no state.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/master_copies.hpp"
#include "shardkit/optim/offload_transport.hpp"
#include "shardkit/optim/optimizer_config.hpp"
#include "shardkit/optim/param_norms.hpp"
#include "shardkit/optim/update_rule.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

class ShardedOptimizer {
 public:
  // Updates the pieces `table.pieces(rank)`; `piece_params[k]` views piece k's parameter
  // elements. f32 views are the parameters themselves. f16/bf16 views are the compute copy of
  // mixed precision: the optimizer then keeps an f32 master of its pieces, starting from the
  // copy's values (set_master for exact ones), updates the master and writes the rounded copy in
  // the same fused pass. `norm_comm` joins the table's ranks for norms of parameters split over
  // them (nullptr: one rank, or a replicated table). `offload` moves the master (f32 training
  // too), the state and the step to a host context.
  ShardedOptimizer(Context& ctx, const shard::PieceTable& table, int rank,
                   std::vector<Tensor> piece_params, OptimizerConfig config,
                   comm::Communicator* norm_comm, OptimizerOffload offload = {})
      : ctx_(&ctx),
        host_(offload.enabled() ? offload.host : &ctx),
        table_(&table),
        rank_(rank),
        transport_(ctx, table, rank, offload),
        norms_(ctx, table, rank, norm_comm),
        rule_(std::move(config), table, rank, norms_),
        copies_(ctx, *host_, table, rank, checked_views(std::move(piece_params), table, rank),
                !offload.enabled() || offload.params_on_host) {
    for (auto name : state_buffer_names(rule_.config()))
      buffers_.push_back(StateBuffer{name, zeros(*host_, {table.state_numel(rank)}, DType::f32,
                                                 MemoryCategory::optimizer_state)});
  }

  // One step. `grads` holds one gradient view per piece, in pieces() order. `lr` overrides the
  // configured rate (schedules); `inv_grad_scale` unscales loss-scaled gradients.
  void step(const std::vector<Tensor>& grads, float lr, float inv_grad_scale = 1.0f) {
    check_grad_count(grads);
    inv_grad_scale *= clip_coefficient_;  // from clip_grad_norm, for this step only
    clip_coefficient_ = 1.0f;
    if (gate_.defined()) {  // the count is on the device since a gated step: open the gate
      fill(*ctx_, gate_.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1), 1.0);
      fill(*ctx_, gate_.slice(0, ops::kGateSkip, ops::kGateSkip + 1), 0.0);
      return gated_update(grads, lr, inv_grad_scale);
    }
    ++steps_;
    if (!offloaded()) return update(*ctx_, grads, lr, inv_grad_scale);
    update(*host_, transport_.stage_grads(grads), lr, inv_grad_scale);
  }

  // The loss-scaled step, `scaler` having checked the gradients (DynamicLossScaler::check_grads):
  // the gradients unscaled by its inverse scale, or the step skipped where it found an overflow
  // (the step count then stays). Decided on the device through the step gate (ops/step_gate.hpp)
  // -- the host queues it without waiting -- where the update runs there (SGD, Adam, AdamW in
  // one fused pass; LARC-SGD with its coefficients formed on the device from the gate's factor,
  // then its pass). Offload steps on the host: it reads the scaler's verdict first (one read).
  void step(const std::vector<Tensor>& grads, float lr, DynamicLossScaler& scaler) {
    check_grad_count(grads);
    if (offloaded()) {
      const auto verdict = scaler.read_verdict();
      if (verdict.found_inf) return discard_clip();
      return step(grads, lr, verdict.inv_scale);
    }
    const Tensor& state = scaler.state(*ctx_);
    check_device_count();
    if (!gate_.defined())  // (one upload, at the first loss-scaled step)
      gate_ = from_vector(*ctx_, std::vector<float>{1.0f, 0.0f, static_cast<float>(steps_)},
                          {ops::kGateSlots}, MemoryCategory::other);
    static_assert(ops::kGateSkip == ops::kGateGradFactor + 1 &&
                  ops::kLossFoundInf == ops::kLossInvScale + 1);
    copy(*ctx_, gate_.slice(0, ops::kGateGradFactor, ops::kGateSkip + 1),
         state.slice(0, ops::kLossInvScale, ops::kLossFoundInf + 1));
    const float clip = clip_coefficient_;
    clip_coefficient_ = 1.0f;
    gated_update(grads, lr, clip);
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

  // The steps applied so far (skipped ones do not count). After a loss-scaled step the count
  // is on the device: reading it waits for the device.
  std::int64_t steps() const {
    if (!gate_.defined()) return steps_;
    return static_cast<std::int64_t>(to_vector<float>(*ctx_, gate_)[ops::kGateStepsBefore]);
  }
  // Resuming from a checkpoint: the step count drives SGD's first-step rule and Adam's bias
  // correction, so it travels with the state (OptimizerState::steps).
  void set_steps(std::int64_t steps) {
    check(steps >= 0, "ShardedOptimizer::set_steps: steps must be >= 0, got ", steps);
    steps_ = steps;
    if (!gate_.defined()) return;
    check_device_count();
    fill(*ctx_, gate_.slice(0, ops::kGateStepsBefore, ops::kGateStepsBefore + 1),
         static_cast<double>(steps));
  }
  Context& context() const { return *ctx_; }
  int rank() const { return rank_; }
  const shard::PieceTable& table() const { return *table_; }
  const OptimizerConfig& config() const { return rule_.config(); }
  const std::vector<shard::StatePiece>& pieces() const { return table_->pieces(rank_); }
  // The views given at construction: the parameters, or under mixed precision their compute
  // copy.
  const std::vector<Tensor>& piece_params() const { return copies_.piece_params(); }
  // The f32 values the optimizer updates (what checkpoints save): piece_params() itself, or
  // under mixed precision (or offload) the f32 master.
  const std::vector<Tensor>& master_params() const { return copies_.masters(); }
  bool mixed_precision() const { return copies_.mixed_precision(); }
  DType compute_dtype() const { return copies_.compute_dtype(); }
  // Whether the f32 values the optimizer updates are a copy apart from piece_params() (mixed
  // precision, or offload): then values written into the parameters must reach the masters
  // (copy_params_to_masters), and masters written reach the parameters (copy_masters_to_params).
  bool separate_master() const { return copies_.separate(); }
  // CPU offload: the master, state and step live in host memory (host_context()).
  bool offloaded() const { return transport_.enabled(); }
  // Where the master and state live and the step runs: the parameters' context, or the host's.
  Context& host_context() const { return *host_; }
  // Piece k's master takes exact f32 values (a view of piece k's elements, on any device);
  // the parameter follows (rounded under mixed precision).
  void set_master(std::size_t k, const Tensor& values) { copies_.set(k, values); }
  // After the masters were written (a checkpoint load): the parameters take their values.
  void copy_masters_to_params() { copies_.to_params(); }
  // After the parameters were written (e.g. broadcast): the masters take their values.
  void copy_params_to_masters() { copies_.from_params(); }
  // The state buffers over this rank's state range, by PyTorch's names (momentum_buffer;
  // exp_avg and exp_avg_sq); none without state. The handles share the storage:
  // load_optimizer_state() writes through them.
  const std::vector<StateBuffer>& state_buffers() const { return buffers_; }

 private:
  static std::vector<Tensor> checked_views(std::vector<Tensor> views,
                                           const shard::PieceTable& table, int rank) {
    check(views.size() == table.pieces(rank).size(), "ShardedOptimizer: ", views.size(),
          " parameter views for ", table.pieces(rank).size(),
          " pieces; pass one per piece, in the table's order");
    return views;
  }

  void check_grad_count(const std::vector<Tensor>& grads) const {
    check(grads.size() == pieces().size(), "ShardedOptimizer::step: ", grads.size(),
          " gradients for ", pieces().size(), " pieces; pass one per piece, in pieces() order");
  }

  // The device counts steps in f32 (as PyTorch's fused optimizers): exactly up to 2^24.
  void check_device_count() const {
    check(steps_ <= (std::int64_t{1} << 24), "ShardedOptimizer: a step count of ", steps_,
          " is past 2^24, the most the device's f32 count holds exactly; loss-scaled steps "
          "cannot continue this run");
  }

  // The update through the step gate, on the parameters' context: its factor unscales the
  // gradients (times `inv_grad_scale`), its skip flag may void the pass, its count numbers the
  // step and advances unless skipped.
  void gated_update(const std::vector<Tensor>& grads, float lr, float inv_grad_scale) {
    update(*ctx_, grads, lr, inv_grad_scale, gate_);
    ops::count_applied_step(*ctx_, gate_);
  }

  // The update on context `c` (the parameters' context, or the host's when offloaded): what
  // every chunk shares first (LARC's trust ratios need every norm), then the fused pass chunk by
  // chunk; offloaded, each chunk's new parameters are queued for the device before the next
  // chunk is updated, and the step waits for the last.
  void update(Context& c, const std::vector<Tensor>& g, float lr, float inv_grad_scale,
              const Tensor& gate = Tensor()) {
    const std::vector<Tensor> a = buffers_.size() > 0
                                      ? state_views(*table_, rank_, buffers_[0].values)
                                      : std::vector<Tensor>{};
    const std::vector<Tensor> b = buffers_.size() > 1
                                      ? state_views(*table_, rank_, buffers_[1].values)
                                      : std::vector<Tensor>{};
    const UpdateTensors tensors{copies_.masters(), g, a, b, copies_.low_copies()};
    const auto prepared =
        rule_.prepare(c, tensors, lr, inv_grad_scale, steps_, transport_.sends_up(), gate);
    if (prepared.done) return;
    const std::size_t n = pieces().size();
    for (std::size_t begin = 0, end = 0; begin < n; begin = end) {
      end = transport_.chunk_end(begin);
      rule_.apply(c, prepared, tensors, begin, end);
      if (transport_.sends_up()) transport_.send_up(copies_, begin, end);
    }
    if (transport_.sends_up()) transport_.wait();
  }

  Context* ctx_;   // the parameters' (and gradients') context
  Context* host_;  // where the master, state and step live: ctx_, or the offload context
  const shard::PieceTable* table_;
  int rank_;
  OffloadTransport transport_;
  ParamNorms norms_;
  UpdateRule rule_;
  MasterCopies copies_;
  std::vector<std::size_t> by_name_;  // table parameters in the order of their names
  float clip_coefficient_ = 1.0f;     // set by clip_grad_norm, used by the next step
  std::vector<StateBuffer> buffers_;
  std::int64_t steps_ = 0;  // the count while it is on the host (until a loss-scaled step)
  Tensor gate_;             // the step gate (ops/step_gate.hpp) since a loss-scaled step
};

}  // namespace shardkit::optim
