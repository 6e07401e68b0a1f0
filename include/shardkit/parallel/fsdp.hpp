// Fsdp: ZeRO-3 over an nn::Module -- every rank keeps 1/N of each unit's flat parameter (f32
// master), of its gradient and of its optimizer state; full parameters exist only around
// their use. One step (docs/design.md has the picture):
//
//   forward   unit u's forward-pre hook waits for (or starts) u's all-gather and starts the
//             next `prefetch` units' gathers in the recorded forward order; its forward hook
//             frees u again when reshard_after_forward (the root unit stays: its backward
//             comes first).
//   backward  u's backward-pre hook gathers u again (prefetching the next units in reverse
//             forward order); gradients land in u's transient full-gradient buckets (grad
//             providers); when a bucket is complete it is reduce-scattered (averaged) into the
//             rank's gradient shard and freed; when all of u's gradients are final, u's full
//             parameters are freed. Recomputation under activation checkpointing re-gathers
//             through the forward-pre hook, frees after the recomputed forward like any
//             forward, and the backward-pre hook gathers once more.
//   end       the end of the backward waits for the last reductions and frees what is still
//             gathered; step() updates the shards with one sharded optimizer over all units.
//
// Gradient accumulation: no_sync() keeps each unit's full gradients locally (costs the whole
// model's f32 gradients on every rank, Psi x 4 bytes) and reduces their sum once; without it,
// each synchronised backward reduce-scatters and adds to the shard (A + avg(g)).
// Frozen parameters stay outside the flat parameters: whole on every rank, with no gradient,
// no optimizer state and no traffic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/flat_param_group.hpp"
#include "shardkit/parallel/fsdp_units.hpp"
#include "shardkit/shard/grad_bucketer.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::parallel {

struct FsdpOptions {
  FsdpWrapPolicy wrap;
  bool reshard_after_forward = true;
  int prefetch = 1;                // units gathered ahead, forward and backward (0: none)
  shard::BucketerOptions buckets;  // per unit: bucket_bytes, wire (reduce) dtype, in flight
};

template <class Backend>
class Fsdp {
 public:
  Fsdp(Context& ctx, comm::Communicator& comm, nn::Module& root, optim::OptimizerConfig optimizer,
       FsdpOptions options = {})
      : ctx_(&ctx),
        comm_(&comm),
        root_(&root),
        options_(checked(options)),
        table_(comm.size(), false) {
    std::map<std::string, autograd::Variable> by_name;
    for (const auto& [name, p] : root.named_parameters()) {
      check(p.dtype() == DType::f32, "parameter '", name, "' is ", dtype_name(p.dtype()),
            "; FSDP keeps f32 parameters (build the model in f32)");
      by_name.emplace(name, p);
    }
    const auto specs = plan_fsdp_units(root, options_.wrap);
    check_same_units(specs);
    std::vector<Tensor> piece_params;
    for (const auto& spec : specs) {
      auto unit = std::make_unique<Unit>();
      unit->path = spec.path;
      unit->module = spec.module;
      std::vector<shard::ParamSpec> trainable;
      for (const auto& name : spec.params) {
        const auto& p = by_name.at(name);
        if (!p.requires_grad()) continue;  // frozen: stays whole on every rank
        trainable.push_back(shard::ParamSpec{name, p.shape(), true});
        unit->params.push_back(p);
      }
      if (unit->params.empty()) continue;
      unit->group = std::make_unique<FlatParamGroup>(
          ctx, comm, trainable, shard::PartitionKind::flat, Residency::sharded);
      unit->bucketer = std::make_unique<shard::GradBucketer>(
          ctx, comm, unit->group->plan(), shard::GradSync::reduce_scatter, options_.buckets);
      unit->pieces = unit->group->updated_pieces(false);
      table_.append_plan(unit->group->plan(), false);
      for (auto& view : unit->group->piece_params(unit->pieces)) piece_params.push_back(view);
      for (const auto& piece : unit->pieces)
        piece_grads_.push_back(unit->bucketer->piece_grad(piece));
      unit->ready.assign(unit->params.size(), false);
      units_.push_back(std::move(unit));
    }
    check(!units_.empty(), "FSDP: the model has no trainable parameter to shard");
    root_unit_ = units_.back()->path.empty() ? units_.back().get() : nullptr;
    optimizer_ = std::make_unique<optim::ShardedOptimizer<Backend>>(
        ctx, table_, comm.rank(), std::move(piece_params), optimizer,
        table_.any_parameter_spans_ranks() ? &comm : nullptr);
    for (auto& unit : units_) bind(*unit);
    // Frozen parameters are replicated: rank 0's values everywhere, like the sharded ones.
    for (const auto& [name, p] : root.named_parameters())
      if (!p.requires_grad() && p.numel() > 0) comm.broadcast(p.data(), 0).wait();
  }

  ~Fsdp() {
    for (auto& unit : units_) {
      for (auto id : unit->hooks) unit->module->remove_hook(id);
      for (auto& p : unit->params) {
        p.set_grad_provider({});
        p.clear_grad_ready_hooks();
      }
    }
  }
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  // Updates every unit's shard with the averaged gradients of the synchronised backwards since
  // zero_grad().
  void step(float lr, float inv_grad_scale = 1.0f) {
    for (auto& unit : units_)
      check<StateError>(unit->bucketer->finished(),
                        "FSDP step before a synchronised backward "
                        "finished the gradients of unit '",
                        unit_name(*unit),
                        "'; run the "
                        "backward (outside no_sync) first");
    optimizer_->step(piece_grads_, lr, inv_grad_scale);
  }

  void zero_grad() {
    for (auto& unit : units_) unit->bucketer->zero_grad();
  }

  void set_sync(bool enabled) {
    for (auto& unit : units_) unit->bucketer->set_sync(enabled);
  }

  // Custom-loop use and inspection: gather a unit's full parameters / free them again.
  std::size_t unit_count() const { return units_.size(); }
  const std::string& unit_path(std::size_t u) const { return units_.at(u)->path; }
  const FlatParamGroup& group(std::size_t u) const { return *units_.at(u)->group; }
  void gather(std::size_t u) { ensure_gathered(*units_.at(u)); }
  void release(std::size_t u) { release_unit(*units_.at(u)); }
  // FSDP's summon_full_params: every unit gathered while the scope lives (to read or write
  // the module's parameters between steps); written values go back to the shards at exit.
  class FullParams {
   public:
    explicit FullParams(Fsdp& fsdp) : fsdp_(&fsdp) {
      for (auto& unit : fsdp_->units_) fsdp_->ensure_gathered(*unit);
    }
    ~FullParams() {
      for (auto& unit : fsdp_->units_) {
        unit->group->copy_range_to_shard();
        fsdp_->release_unit(*unit);
      }
    }
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    Fsdp* fsdp_;
  };
  [[nodiscard]] FullParams full_params() { return FullParams(*this); }

  // The most units gathered at once since construction (the root unit not counted).
  int max_gathered_units() const { return max_gathered_; }
  const optim::ShardedOptimizer<Backend>& optimizer() const { return *optimizer_; }

 private:
  struct Unit {
    std::string path;
    nn::Module* module = nullptr;
    std::vector<autograd::Variable> params;  // trainable, in flat-layout order
    std::unique_ptr<FlatParamGroup> group;
    std::unique_ptr<shard::GradBucketer> bucketer;
    std::vector<shard::ParamPiece> pieces;
    std::vector<bool> ready;
    std::size_t ready_count = 0;
    comm::Work pending;  // an all-gather started ahead of use (prefetch)
    bool gathering = false;
    std::vector<nn::HookId> hooks;
  };

  static FsdpOptions checked(FsdpOptions options) {
    check(options.prefetch >= 0, "FSDP prefetch depth ", options.prefetch, " must be >= 0");
    return options;
  }
  static std::string unit_name(const Unit& unit) {
    return unit.path.empty() ? std::string("<root>") : unit.path;
  }
  bool is_root(const Unit& unit) const { return &unit == root_unit_; }

  // Every rank must have the same units with the same parameters, or collectives would pair up
  // wrongly: compare one fingerprint of all unit paths and parameter names before any of them.
  void check_same_units(const std::vector<FsdpUnitSpec>& specs) {
    std::map<std::string, autograd::Variable> by_name;
    for (const auto& [name, p] : root_->named_parameters()) by_name.emplace(name, p);
    std::vector<shard::ParamSpec> all;
    for (const auto& spec : specs) {
      all.push_back(shard::ParamSpec{"unit:" + spec.path, {1}, false});
      for (const auto& name : spec.params) {
        const auto& p = by_name.at(name);
        all.push_back(shard::ParamSpec{name, p.shape(), p.requires_grad()});
      }
    }
    check_same_fingerprint(*ctx_, *comm_, shard::ParamLayout(all).fingerprint(),
                           "the module tree or its FSDP units differ between ranks (paths, "
                           "parameter names, shapes or frozen flags); build the same model and "
                           "wrap policy on every rank");
  }

  void bind(Unit& unit) {
    // Values: this rank's module values into the gathered buffer, rank 0's broadcast, the
    // shard keeps this rank's range; then the parameters view the buffer and it is freed.
    // (Layout index i is unit.params[i]: a plan's layout keeps the specs' order.)
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      copy(*ctx_, unit.group->param(i), unit.params[i].data());
      unit.params[i].set_data(unit.group->param(i));
      unit.params[i].clear_grad();
    }
    unit.group->broadcast(0);
    release_unit(unit);

    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      unit.params[i].set_grad_provider([this, &unit, i] { return unit.bucketer->grad(i); });
      unit.params[i].register_grad_ready_hook(
          [this, &unit, i](autograd::Variable&) { on_grad_ready(unit, i); });
    }
    nn::Module& m = *unit.module;
    unit.hooks.push_back(m.register_forward_pre_hook(
        [this, &unit](nn::Module&, const autograd::Variable&) { pre_forward(unit); }));
    unit.hooks.push_back(
        m.register_forward_hook([this, &unit](nn::Module&, const autograd::Variable&,
                                              const autograd::Variable&) { post_forward(unit); }));
    unit.hooks.push_back(m.register_backward_pre_hook(
        [this, &unit](nn::Module&, const Tensor&) { pre_backward(unit); }));
    // Post-backward: the gradient leaving through the unit's input means its backward is done
    // (also inside a checkpoint's recomputed backward, where grad-ready hooks wait for the
    // outer pass). Units whose input needs no gradient free at their last grad-ready instead.
    unit.hooks.push_back(m.register_backward_hook(
        [this, &unit](nn::Module&, const Tensor&) { release_unit(unit); }));
  }

  // --- gather / release -------------------------------------------------------------------
  void start_gather(Unit& unit) {
    if (unit.group->gathered() || unit.gathering) return;
    shard::detail::assign_work(unit.pending, unit.group->gather());
    unit.gathering = true;
    count_gathered();
  }
  void ensure_gathered(Unit& unit) {
    start_gather(unit);
    if (unit.gathering) {
      unit.pending.wait();
      unit.gathering = false;
    }
  }
  void release_unit(Unit& unit) {
    if (unit.gathering) {  // a prefetch nobody used: complete it before freeing its buffer
      unit.pending.wait();
      unit.gathering = false;
    }
    unit.group->release("the parameters of FSDP unit '" + unit_name(unit) +
                        "' are not gathered: they exist only during the unit's forward and "
                        "backward; run the module (its hooks gather them), or call gather() in "
                        "a custom loop");
  }
  void count_gathered() {
    int gathered = 0;
    for (auto& unit : units_)
      if (!is_root(*unit) && (unit->group->gathered() || unit->gathering)) ++gathered;
    max_gathered_ = std::max(max_gathered_, gathered);
  }
  void prefetch_after(const Unit& unit, const std::vector<Unit*>& order) {
    if (options_.prefetch == 0) return;
    auto it = std::find(order.begin(), order.end(), &unit);
    if (it == order.end()) return;
    for (int k = 0; k < options_.prefetch && ++it != order.end(); ++k) start_gather(**it);
  }

  // --- hooks ------------------------------------------------------------------------------
  void pre_forward(Unit& unit) {
    auto& tape = autograd::tape(*ctx_);
    if (!tape.recomputing() && !order_recorded_ &&
        std::find(forward_order_.begin(), forward_order_.end(), &unit) == forward_order_.end())
      forward_order_.push_back(&unit);
    ensure_gathered(unit);
    if (order_recorded_ && !tape.recomputing()) prefetch_after(unit, forward_order_);
  }
  void post_forward(Unit& unit) {
    // (During checkpoint recomputation too: the recomputed graph's backward-pre hook gathers the
    // unit again when its backward comes, so a segment of many units never holds them all.)
    auto& tape = autograd::tape(*ctx_);
    if (is_root(unit)) {
      if (tape.recomputing()) return;
      if (!forward_order_.empty()) order_recorded_ = true;
      if (!tape.grad_enabled())  // no backward follows: free everything
        for (auto& u : units_) release_unit(*u);
      return;
    }
    if (options_.reshard_after_forward || !tape.grad_enabled()) release_unit(unit);
  }
  void pre_backward(Unit& unit) {
    begin_backward();
    ensure_gathered(unit);
    if (order_recorded_) {
      std::vector<Unit*> reverse(forward_order_.rbegin(), forward_order_.rend());
      prefetch_after(unit, reverse);
    }
  }
  void on_grad_ready(Unit& unit, std::size_t i) {
    begin_backward();
    unit.ready[i] = true;
    unit.bucketer->ready(i);
    if (++unit.ready_count == unit.params.size()) release_unit(unit);  // post-backward
  }
  void begin_backward() {
    if (in_backward_) return;
    in_backward_ = true;
    autograd::tape(*ctx_).queue_callback([this] { end_backward(); });
  }
  // Parameters the loss did not reach contribute zero gradients; wait for every reduction;
  // free what is still gathered (the root, units without a backward-pre hook).
  void end_backward() {
    for (auto& unit : units_) {
      for (std::size_t i = 0; i < unit->params.size(); ++i)
        if (!unit->ready[i]) unit->bucketer->ready(i);
      unit->bucketer->finish();
      std::fill(unit->ready.begin(), unit->ready.end(), false);
      unit->ready_count = 0;
    }
    for (auto& unit : units_) release_unit(*unit);
    order_recorded_ = order_recorded_ || !forward_order_.empty();
    in_backward_ = false;
  }

  Context* ctx_;
  comm::Communicator* comm_;
  nn::Module* root_;
  FsdpOptions options_;
  shard::PieceTable table_;
  std::vector<std::unique_ptr<Unit>> units_;
  Unit* root_unit_ = nullptr;
  std::vector<Tensor> piece_grads_;
  std::unique_ptr<optim::ShardedOptimizer<Backend>> optimizer_;
  std::vector<Unit*> forward_order_;  // units by first forward-pre hook, recorded once
  bool order_recorded_ = false;
  bool in_backward_ = false;
  int max_gathered_ = 0;
};

}  // namespace shardkit::parallel
