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
//                    CPU without offload; gradients come down before the step (or were kept
//                    on the host by the engine's backward), parameters go up in chunks
//                    overlapping the update. Device memory then holds no state.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/master_copies.hpp"
#include "shardkit/optim/offload_transport.hpp"
#include "shardkit/optim/optimizer_config.hpp"
#include "shardkit/optim/param_norms.hpp"
#include "shardkit/optim/state_spill.hpp"
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
                !offload.enabled() || offload.params_on_host, offload.disk) {
    rate_ = is_adam(rule_.config().kind) ? rule_.config().adam.lr : rule_.config().sgd.lr;
    Context& state_home = offload.enabled() ? offload.state_home() : ctx;
    for (auto name : state_buffer_names(rule_.config()))
      buffers_.push_back(StateBuffer{name, zeros(state_home, {table.state_numel(rank)}, DType::f32,
                                                 MemoryCategory::optimizer_state)});
    if (offload.disk != nullptr) make_spill(*offload.disk, offload.disk_shards);
  }

  // The learning rate of the steps from now on (schedules live in the training loop; before
  // the first call, the configured one). Kept on the host, and once there is a step gate in its
  // rate slot, which the gated passes read on the device (a fill queued at every call). A step
  // captured by a StepGraph reads it there: set it before each run, outside the step, and call
  // step() without a rate inside it -- or pass the rate inside the step, each rate its own key:
  // the captured fill then sets the slot at every replay.
  void set_lr(float lr) {
    check(lr >= 0 && std::isfinite(lr), "ShardedOptimizer: lr must be finite and >= 0, got ", lr);
    ctx_->capture_scalar("the optimizer's lr (set_lr, step(lr, ...))", lr);
    rate_ = lr;
    write_gate_rate();
  }
  float lr() const { return rate_; }

  // One step at the rate set_lr() set. `grads` holds one gradient view per piece, in pieces()
  // order.
  void step(const std::vector<Tensor>& grads) { step_unscaling_by(grads, 1.0f); }
  // A step at the rate set_lr() set, whose gradients `inv_grad_scale` unscales (loss scaling
  // by hand).
  void step_unscaling_by(const std::vector<Tensor>& grads, float inv_grad_scale) {
    const float lr = rate_;
    check_grad_count(grads);
    refuse_offload_in_capture();
    ctx_->capture_scalar("the optimizer step's inv_grad_scale", inv_grad_scale);
    const bool clipping = clip_pending_;
    clip_pending_ = false;
    if (offloaded()) {  // (offload steps on the host: the clip coefficient is read)
      if (clipping) inv_grad_scale *= read_clip_coefficient();
      const auto staged = transport_.stage_grads(grads);
      return counted_update(*host_, staged, lr, inv_grad_scale);
    }
    // The gate carries clip_grad_norm's coefficient to the pass on the device, and once a step
    // was gated the count lives there: open the gate (factor 1, no skip), fold the coefficient in.
    // A step run by a StepGraph is gated from its first warm-up step: a replay cannot advance
    // the host's count.
    if (clipping || gate_.defined() || ctx_->in_step_graph()) {
      open_gate();
      if (clipping) fold_clip_coefficient();
      return gated_update(grads, lr, inv_grad_scale);
    }
    counted_update(*ctx_, grads, lr, inv_grad_scale);
  }
  // set_lr(lr), then step_unscaling_by(grads, inv_grad_scale).
  void step(const std::vector<Tensor>& grads, float lr, float inv_grad_scale = 1.0f) {
    set_lr(lr);
    step_unscaling_by(grads, inv_grad_scale);
  }

  // The loss-scaled step, `scaler` having checked the gradients (DynamicLossScaler::check_grads):
  // the gradients unscaled by its inverse scale, or the step skipped where it found an overflow
  // (the step count then stays). Decided on the device through the step gate (ops/step_gate.hpp)
  // -- the host queues it without waiting -- where the update runs there (SGD, Adam, AdamW in
  // one fused pass; LARC-SGD with its coefficients formed on the device from the gate's factor,
  // then its pass). Offload steps on the host: it reads the scaler's verdict first (one read).
  // At the rate set_lr() set; or set_lr(lr) first.
  void step(const std::vector<Tensor>& grads, DynamicLossScaler& scaler) {
    check_grad_count(grads);
    refuse_offload_in_capture();
    if (offloaded()) {
      const auto verdict = scaler.read_verdict();
      if (verdict.found_inf) return discard_clip();
      return step_unscaling_by(grads, verdict.inv_scale);
    }
    const Tensor& state = scaler.state(*ctx_);
    make_gate();
    static_assert(ops::kGateSkip == ops::kGateGradFactor + 1 &&
                  ops::kLossFoundInf == ops::kLossInvScale + 1);
    copy(*ctx_, gate_.slice(0, ops::kGateGradFactor, ops::kGateSkip + 1),
         state.slice(0, ops::kLossInvScale, ops::kLossFoundInf + 1));
    if (clip_pending_) fold_clip_coefficient();
    clip_pending_ = false;
    gated_update(grads, rate_, 1.0f);
  }
  void step(const std::vector<Tensor>& grads, float lr, DynamicLossScaler& scaler) {
    set_lr(lr);
    step(grads, scaler);
  }

  // torch.nn.utils.clip_grad_norm_ over the whole model (docs/semantics.md): the L2 norm of
  // every parameter's gradient (`grads` as for step(), times inv_grad_scale), exact under every
  // stage -- per-parameter norms from ParamNorms, added in the order of the parameters' names
  // -- returned as f64 [1] on the device (read it to log it); when it exceeds max_norm, the
  // next step() scales the gradients by max_norm / (norm + 1e-6) in its fused pass. Nothing is
  // read back: the coefficient reaches the pass through the step gate. Collective when the
  // table is sharded. A second call before the step keeps the smaller max_norm: PyTorch's
  // second clip of gradients already clipped (to within its 1e-6), though the norm returned is
  // still that of the gradients as they are, the clip not yet applied to them. zero_grad
  // forgets a pending clip.
  Tensor clip_grad_norm(const std::vector<Tensor>& grads, double max_norm,
                        float inv_grad_scale = 1.0f) {  // (1 / the loss scale, if any)
    check(max_norm > 0, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
    if (clip_pending_) max_norm = std::min(max_norm, clip_max_norm_);
    // (kernel arguments here and again at the step's fold: a captured step replays them)
    ctx_->capture_scalar("clip_grad_norm's max_norm", max_norm);
    ctx_->capture_scalar("clip_grad_norm's inv_grad_scale", inv_grad_scale);
    if (!clip_total_.defined()) {  // (set up once: the sum's program uploaded)
      const auto params = static_cast<std::int64_t>(table_->params().size());
      std::vector<std::int64_t> by_name(static_cast<std::size_t>(params));
      for (std::int64_t p = 0; p < params; ++p) by_name[static_cast<std::size_t>(p)] = p;
      std::sort(by_name.begin(), by_name.end(), [&](std::int64_t a, std::int64_t b) {
        return table_->params()[static_cast<std::size_t>(a)].name <
               table_->params()[static_cast<std::size_t>(b)].name;
      });
      clip_plan_.add_sum(by_name);
      clip_plan_.upload(*ctx_);
      clip_sums_ = empty(*ctx_, {1, params}, DType::f64, MemoryCategory::other);
      clip_total_ = empty(*ctx_, {1}, DType::f64, MemoryCategory::other);
    }
    // (gradients kept on the host under offload: the leaf sums are formed there)
    norms_.roots(transport_.offload().grads_on_host ? *host_ : *ctx_, {grads},
                 ParamNorms::Layout::params, clip_sums_);
    ops::norm_roots(*ctx_, clip_sums_, clip_plan_, clip_total_);
    Tensor norm = empty(*ctx_, {1}, DType::f64, MemoryCategory::other);
    ops::clip_norm_and_factor(*ctx_, clip_total_, max_norm, inv_grad_scale, norm, Tensor());
    clip_pending_ = true;
    clip_max_norm_ = max_norm;
    clip_inv_grad_scale_ = inv_grad_scale;
    return norm;
  }

  // A skipped step (loss scaling found an overflow): forget clip_grad_norm's coefficient.
  // A clip_grad_norm waits for the next step (its coefficient applied there).
  bool clip_pending() const { return clip_pending_; }
  void discard_clip() { clip_pending_ = false; }

  // The steps applied so far (skipped ones do not count). After a loss-scaled step the count
  // is on the device: reading it waits for the device.
  std::int64_t steps() const {
    if (!gate_.defined()) return steps_;
    return static_cast<std::int64_t>(to_vector<float>(*ctx_, gate_)[ops::kGateStepsBefore]);
  }
  // Resuming from a checkpoint: the step count drives SGD's first-step rule and Adam's bias
  // correction, so it travels with the state (OptimizerState::steps).
  void set_steps(std::int64_t steps) {
    check_steps(steps);
    steps_ = steps;
    gated_bound_ = steps;
    if (!gate_.defined()) return;
    fill(*ctx_, gate_.slice(0, ops::kGateStepsBefore, ops::kGateStepsBefore + 1),
         static_cast<double>(steps));
  }
  // Refuses a count set_steps() would refuse -- negative, or past 2^24 once the count lives on
  // the device -- so a load can ask before it writes anything.
  void check_steps(std::int64_t steps) const {
    check(steps >= 0, "ShardedOptimizer::set_steps: steps must be >= 0, got ", steps);
    if (gate_.defined()) check_device_count(steps);
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
  // The step gate (ops/step_gate.hpp) once a gated step made it, else undefined: passes that
  // follow the update (post-step hooks) read its skip slot to leave a skipped step alone.
  const Tensor& step_gate() const { return gate_; }
  bool mixed_precision() const { return copies_.mixed_precision(); }
  DType compute_dtype() const { return copies_.compute_dtype(); }
  // Whether the f32 values the optimizer updates are a copy apart from piece_params() (mixed
  // precision, or offload): then values written into the parameters must reach the masters
  // (copy_params_to_masters), and masters written reach the parameters (copy_masters_to_params).
  bool separate_master() const { return copies_.separate(); }
  // CPU offload: the master, state and step live in host memory (host_context()).
  bool offloaded() const { return transport_.enabled(); }
  // Offload to NVMe: the context whose memory (files on disk) holds the master and state, and
  // how they are streamed through RAM (nullptr otherwise).
  const Context* disk_context() const { return transport_.offload().disk; }
  const StateSpill* state_spill() const { return spill_.get(); }
  // Where the master and state live and the step runs: the parameters' context, or the host's.
  Context& host_context() const { return *host_; }
  // Piece k's master takes exact f32 values (a view of piece k's elements, on any device);
  // the parameter follows (rounded under mixed precision).
  void set_master(std::size_t k, const Tensor& values) { copies_.set(k, values); }
  // After the masters were written (a checkpoint load): the parameters take their values.
  void copy_masters_to_params() { copies_.to_params(); }
  // After the parameters were written (e.g. broadcast): the masters take their values.
  void copy_params_to_masters() { copies_.from_params(); }
  // Offload to NVMe: the state written back to its files and dropped from RAM now, but the
  // chunk the next step starts with (kept since the last step, or read ahead), unless
  // `including_next_chunk`. For what writes or reads it between steps -- the wrap's first
  // values, a post-step hook, a saved or loaded checkpoint -- which would otherwise stay in RAM
  // until the next step's end. Nothing without offload to disk.
  void spill_state(bool including_next_chunk = false) {
    if (!spill_) return;
    if (including_next_chunk)
      spill_->drop_all();
    else
      spill_->drop_all_but_next();
  }
  // Offload to NVMe: starts reading the next step's first chunk of the master and state now, on
  // the spill's thread, so that the step finds it in RAM instead of waiting for it (the
  // engine's zero_grad() calls this: the read runs beside the forward and backward). That
  // chunk is the one the step before ended with, kept in RAM since: only what the kernel
  // reclaimed of it is read. RAM holds that chunk until the step (or a skipped step's
  // successor); a drop (spill_state(true)) waits for the read and drops it. Nothing without offload
  // to disk. Best effort, never throws: a read that fails here is made again by the step,
  // which reports its error.
  void prefetch_state() noexcept {
    if (!spill_) return;
    try {
      const auto chunks = chunk_order();
      if (!chunks.empty()) spill_->read_ahead(chunks[0].first, chunks[0].second);
    } catch (...) {
      spill_->abandon();
    }
  }
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
  static void check_device_count(std::int64_t steps) {
    check(steps <= (std::int64_t{1} << 24), "ShardedOptimizer: a step count of ", steps,
          " is past 2^24, the most the device's f32 count holds exactly; steps through the step "
          "gate (loss scaling, clipping) cannot continue this run");
  }

  // The step gate, made at its first use (one upload), open (factor 1, no skip), the count
  // taken from the host's. Whether it was made now. Not in a captured step: a replay would
  // make it afresh at every step (a StepGraph's warm-up steps make it).
  bool make_gate() {
    check_device_count(steps_);
    if (gate_.defined()) return false;
    ctx_->refuse_in_capture("making the optimizer's step gate",
                            "its first value would come back at every replay; warm the step up "
                            "uncaptured first (StepGraphOptions::warmup_steps >= 1)");
    static_assert(ops::kGateSlots == 4 && ops::kGateRate == 3);
    gate_ = from_vector(*ctx_, std::vector<float>{1.0f, 0.0f, static_cast<float>(steps_), rate_},
                        {ops::kGateSlots}, MemoryCategory::other);
    gated_bound_ = steps_;
    return true;
  }

  // The gate's rate slot takes the host's rate (the gated passes read it). At every call, not
  // only when the host's rate changed: a replayed graph that captured its own rate's fill sets
  // the slot with no host code running, so the host cannot know what the slot holds (a key
  // captured at 0.1, another at 0.05, the first replayed: it read 0.05).
  void write_gate_rate() {
    if (!gate_.defined()) return;
    fill(*ctx_, gate_.slice(0, ops::kGateRate, ops::kGateRate + 1), static_cast<double>(rate_));
  }

  void refuse_offload_in_capture() const {
    if (offloaded())
      ctx_->refuse_in_capture("an offloaded optimizer step (it runs on the host's copy)",
                              "capture steps without CPU offload, or run them eagerly");
  }

  // The gate opened for an ungated step: factor 1, no skip.
  void open_gate() {
    if (make_gate()) return;
    fill(*ctx_, gate_.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1), 1.0);
    fill(*ctx_, gate_.slice(0, ops::kGateSkip, ops::kGateSkip + 1), 0.0);
  }

  // The gate's gradient factor times the pending clip coefficient, on the device.
  void fold_clip_coefficient() {
    ops::clip_norm_and_factor(*ctx_, clip_total_, clip_max_norm_, clip_inv_grad_scale_, Tensor(),
                              gate_.slice(0, ops::kGateGradFactor, ops::kGateGradFactor + 1));
  }

  // The pending clip coefficient on the host (offload's step runs there: one read).
  float read_clip_coefficient() {
    const Tensor factor = full(*ctx_, {1}, DType::f32, 1.0);
    ops::clip_norm_and_factor(*ctx_, clip_total_, clip_max_norm_, clip_inv_grad_scale_, Tensor(),
                              factor);
    return to_vector<float>(*ctx_, factor)[0];
  }

  // The update through the step gate, on the parameters' context: its factor unscales the
  // gradients (times `inv_grad_scale`), its skip flag may void the pass, its count numbers the
  // step and advances unless skipped.
  void gated_update(const std::vector<Tensor>& grads, float lr, float inv_grad_scale) {
    // The device's count would stall at 2^24 in f32 with nothing said: refused on a bound the
    // host keeps, as it cannot read the count without waiting. A CUDA graph's runs execute no
    // host code, so under a GPU capture the bound moves around each of the graph's launches
    // (the first, just after the capture, included); elsewhere -- eager steps, a CPU capture and
    // its replays, which run this code again -- here.
    const bool by_launches = ctx_->capturing() && ctx_->device().is_cuda();
    if (by_launches) {
      count_in_launches();
    } else {
      check_device_count(gated_bound_ + 1);
    }
    update(*ctx_, grads, lr, inv_grad_scale, gate_);
    if (!by_launches) ++gated_bound_;
    ops::count_applied_step(*ctx_, gate_);
  }

  // Under a GPU capture: one action per capture (its key this optimizer's, so that two
  // optimizers in one step each keep theirs) adds the gated updates the captured step makes
  // (`per_run`: a step may make several) before each launch; `before` tells its two calls
  // around a launch apart, and is reset when a launch fails between them.
  struct LaunchCount {
    std::int64_t per_run = 0;
    bool before = true;
  };
  void count_in_launches() {
    if (launch_count_ == nullptr || launch_count_capture_ != ctx_->capture_serial()) {
      auto counted = std::make_shared<LaunchCount>();
      launch_count_ = counted;
      launch_count_capture_ = ctx_->capture_serial();
      char key[64];
      std::snprintf(key, sizeof key, "the step-count bound of optimizer %p",
                    static_cast<const void*>(this));
      ctx_->around_each_run(
          key,
          [this, counted] {
            if (counted->before) {
              check_device_count(gated_bound_ + counted->per_run);
              gated_bound_ += counted->per_run;
            }
            counted->before = !counted->before;
          },
          [counted](const std::string&) { counted->before = true; });
    }
    ++launch_count_->per_run;
  }

  // The update with the host's step count moved to this step's; a step that throws before it
  // updates anything (a gradient that does not fit, a failing read of the state) leaves the
  // count where it was -- Adam's bias correction and SGD's first-step momentum follow it.
  void counted_update(Context& c, const std::vector<Tensor>& g, float lr, float inv_grad_scale) {
    ++steps_;
    applied_ = false;
    try {
      update(c, g, lr, inv_grad_scale);
    } catch (...) {
      if (!applied_) --steps_;
      throw;
    }
  }

  // The update on context `c` (the parameters' context, or the host's when offloaded): what
  // every chunk shares first (LARC's trust ratios need every norm, unless each chunk's pass
  // forms its own), then the fused pass chunk by chunk; offloaded, each chunk's new parameters
  // are queued for the device before the next chunk is updated, and the step waits for the
  // last. A step that throws part-way leaves the state partly updated.
  void update(Context& c, const std::vector<Tensor>& g, float lr, float inv_grad_scale,
              const Tensor& gate = Tensor()) {
    const std::vector<Tensor> a = buffers_.size() > 0
                                      ? state_views(*table_, rank_, buffers_[0].values)
                                      : std::vector<Tensor>{};
    const std::vector<Tensor> b = buffers_.size() > 1
                                      ? state_views(*table_, rank_, buffers_[1].values)
                                      : std::vector<Tensor>{};
    const UpdateTensors tensors{copies_.masters(), g, a, b, copies_.low_copies()};
    // (LARC's trust ratios, unless each chunk forms its own, read the whole master first: on
    // disk, read at the disk's pace.)
    if (spill_ && rule_.config().kind == OptimizerKind::larc_sgd && !rule_.larc_in_pass(c, gate))
      for (auto file : master_files_) spill_->read_whole(file);
    const auto prepared = rule_.prepare(c, tensors, lr, inv_grad_scale, steps_, gate);
    if (prepared.done) {
      applied_ = true;
      return;
    }
    const auto chunks = chunk_order();
    try {
      if (spill_ && !chunks.empty()) spill_->prefetch(chunks[0].first, chunks[0].second);
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        const auto [begin, end] = chunks[i];
        if (spill_) {  // ([begin, end) in RAM; the next chunk comes)
          const auto next =
              i + 1 < chunks.size() ? chunks[i + 1] : std::pair<std::size_t, std::size_t>{};
          spill_->prefetch(next.first, next.second);
        }
        rule_.apply(c, prepared, tensors, begin, end);
        applied_ = true;
        if (transport_.sends_up()) transport_.send_up(copies_, begin, end);
        if (spill_) spill_->done(begin, end, i + 1 == chunks.size());
      }
      if (spill_) {  // (the last chunk stays in RAM: the next step starts with it)
        spill_->finish();
        reversed_ = !reversed_;
      }
    } catch (...) {  // (no read or copy left running into the next step)
      if (spill_) {  // (nor the chunks it held in RAM; a failing disk is reported already)
        spill_->abandon();
        try {
          spill_->drop_all();
        } catch (...) {
        }
      }
      if (transport_.sends_up()) transport_.wait();
      throw;
    }
    if (transport_.sends_up()) transport_.wait();
  }

  // The step's chunks [begin, end) of pieces, in the order it updates them: from the first
  // piece on, but from the last back on disk every other step (each piece's update reads only
  // its own piece and values formed before the chunks, so the order changes no bit), so that
  // the chunk a step ends with, kept in RAM, is the one the next step starts with.
  std::vector<std::pair<std::size_t, std::size_t>> chunk_order() const {
    std::vector<std::pair<std::size_t, std::size_t>> chunks;
    const std::size_t n = pieces().size();
    for (std::size_t begin = 0, end = 0; begin < n; begin = end) {
      end = transport_.chunk_end(begin);
      chunks.emplace_back(begin, end);
    }
    if (spill_ && reversed_) std::reverse(chunks.begin(), chunks.end());
    return chunks;
  }

  // Offload to disk: the buffers there, streamed through RAM at each step; written out and
  // dropped from RAM now (their zeros, the master's first values). `shards`: FSDP's shards on
  // disk, which the piece views are views of -- streamed with the buffers, one file a unit (the
  // spill's ranges are spans of one allocation each); in f32 they are the master. What of a
  // shard no piece spans (padding; a rank's range that is all padding) only goes with drops.
  void make_spill(Context& disk, const std::vector<Tensor>& shards) {
    const auto* files = dynamic_cast<const MappedFileAllocator*>(&disk.allocator());
    check(files != nullptr,
          "ShardedOptimizer: OptimizerOffload::disk must be a context whose allocator is a "
          "MappedFileAllocator (parallel/offload.hpp makes one from nvme_path)");
    std::vector<std::vector<Tensor>> per_piece;
    std::vector<std::pair<const void*, std::size_t>> rest;
    if (copies_.separate()) {
      master_files_.push_back(per_piece.size());
      per_piece.push_back(copies_.masters());
    }
    const auto& params = copies_.piece_params();
    const auto page = static_cast<std::uintptr_t>(files->page_bytes());
    for (const auto& shard : shards) {
      if (shard.numel() == 0) continue;
      std::vector<Tensor> views;  // (the pieces of other shards: empty)
      for (const auto& p : params)
        views.push_back(p.storage() == shard.storage() ? p : p.slice(0, 0, 0));
      const auto lo = reinterpret_cast<std::uintptr_t>(shard.data_ptr());
      const auto hi = lo + shard.nbytes();
      const auto span = StateSpill::ranges_of(views, 0, views.size());
      if (span.empty()) {
        rest.emplace_back(shard.data_ptr(), shard.nbytes());
        continue;
      }
      // (the pages before and after the pieces' span that it does not touch)
      const auto at = reinterpret_cast<std::uintptr_t>(span[0].first);
      const auto first = at / page * page, last = (at + span[0].second + page - 1) / page * page;
      if (lo < first) rest.emplace_back(shard.data_ptr(), first - lo);
      if (last < hi) rest.emplace_back(reinterpret_cast<const void*>(last), hi - last);
      if (!copies_.separate()) master_files_.push_back(per_piece.size());
      per_piece.push_back(std::move(views));
    }
    for (const auto& buffer : buffers_)
      per_piece.push_back(state_views(*table_, rank_, buffer.values));
    spill_ = std::make_unique<StateSpill>(*files, std::move(per_piece), std::move(rest));
    spill_->drop_all();
  }

  Context* ctx_;   // the parameters' (and gradients') context
  Context* host_;  // where the master, state and step live: ctx_, or the offload context
  const shard::PieceTable* table_;
  int rank_;
  OffloadTransport transport_;
  ParamNorms norms_;
  UpdateRule rule_;
  MasterCopies copies_;
  // clip_grad_norm's: the per-parameter sums, their total in the order of the parameters'
  // names (clip_plan_), and what the next step's coefficient is formed from.
  Tensor clip_sums_, clip_total_;
  ops::NormRootPlan clip_plan_;
  bool clip_pending_ = false;
  double clip_max_norm_ = 0;
  float clip_inv_grad_scale_ = 1.0f;
  std::vector<StateBuffer> buffers_;
  std::unique_ptr<StateSpill> spill_;      // the master and state on disk (offload to NVMe)
  std::vector<std::size_t> master_files_;  // the spill's buffers that hold the master
  bool reversed_ = false;   // on disk: the next step updates its chunks from the last one back
  std::int64_t steps_ = 0;  // the count while it is on the host (until a loss-scaled step)
  // Once the count is on the device: its most, the count when the gate was made (or set) plus
  // the gated steps queued since (skipped ones included), a CUDA graph's launches counted by
  // an action around each (count_in_launches: the current capture's, and the capture's serial).
  std::int64_t gated_bound_ = 0;
  std::shared_ptr<LaunchCount> launch_count_;
  std::uint64_t launch_count_capture_ = 0;
  bool applied_ = false;  // the update under way changed some state (counted_update)
  Tensor gate_;           // the step gate (ops/step_gate.hpp) since a loss-scaled step
  float rate_ = 0;        // the learning rate (set_lr)
};

}  // namespace shardkit::optim
