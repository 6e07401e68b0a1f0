// UnitHooks: FSDP's module hooks -- when each unit of a module tree is gathered and freed
// around its use, and which units are gathered ahead. One step of unit u, with
// reshard_after_forward and prefetch depth 1 (docs/design.md has the picture):
//
//   forward   u's forward-pre hook waits for (or starts) u's all-gather and starts the next
//             `prefetch` units' gathers in the recorded forward order -- under offload to NVMe
//             with the shards on disk, it also starts reading the shard of the unit after
//             them, so its gather finds it in RAM (read_shard_ahead; the last unit's reads the
//             backward's second unit); its forward hook frees
//             u again when reshard_after_forward (the root unit stays: its backward comes
//             first) -- with hpZ keeping this rank's slice over the node, from which the
//             backward's gather is an all-gather inside the node.
//   backward  u's backward-pre hook gathers u again (prefetching the next units in reverse
//             forward order); gradients land in u's transient full-gradient buckets; when all
//             of u's gradients are final (or the gradient leaves through u's input), u is
//             freed. Recomputation under activation checkpointing re-gathers through the
//             forward-pre hook, frees after the recomputed forward like any forward, and the
//             backward-pre hook gathers once more.
//   end       the end of the backward (ModuleBinding) waits for the last reductions; then every
//             unit still gathered is freed.
#pragma once

#include <algorithm>
#include <vector>

#include "shardkit/nn/module.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/module_binding.hpp"

namespace shardkit::parallel {

class UnitHooks {
 public:
  // `modules[u]` is the module whose hooks gather unit u (none under ddp, oss and sdp, whose
  // one group never leaves); `root_unit` stays gathered from its forward to its backward.
  UnitHooks(Context& ctx, Engine& engine, ModuleBinding& binding, std::vector<nn::Module*> modules,
            std::size_t root_unit)
      : ctx_(&ctx),
        engine_(&engine),
        binding_(&binding),
        modules_(std::move(modules)),
        root_unit_(root_unit),
        hooks_(modules_.size()) {
    for (std::size_t u = 0; u < modules_.size(); ++u) bind(u);
  }
  ~UnitHooks() {
    for (std::size_t u = 0; u < modules_.size(); ++u)
      for (auto id : hooks_[u]) modules_[u]->remove_hook(id);
  }
  UnitHooks(const UnitHooks&) = delete;
  UnitHooks& operator=(const UnitHooks&) = delete;

  // The most units gathered at once since construction (the root unit not counted).
  int max_gathered_units() const { return max_gathered_; }

  // After engine.ready(i): the post-backward of i's unit once all its gradients are final.
  void after_ready(std::size_t i) {
    const std::size_t u = engine_->unit_of(i);
    if (engine_->unit_ready(u)) engine_->release(u);
  }
  // After the backward's finish(): free what is still gathered (the root, units without a
  // backward-pre hook).
  void after_backward() {
    for (std::size_t u = 0; u < engine_->unit_count(); ++u) engine_->release(u);
    order_recorded_ = order_recorded_ || !forward_order_.empty();
  }

 private:
  bool is_root(std::size_t u) const { return u == root_unit_; }

  void bind(std::size_t u) {
    nn::Module& m = *modules_[u];
    auto& ids = hooks_[u];
    ids.push_back(m.register_forward_pre_hook(
        [this, u](nn::Module&, const autograd::Variable&) { pre_forward(u); }));
    ids.push_back(
        m.register_forward_hook([this, u](nn::Module&, const autograd::Variable&,
                                          const autograd::Variable&) { post_forward(u); }));
    ids.push_back(
        m.register_backward_pre_hook([this, u](nn::Module&, const Tensor&) { pre_backward(u); }));
    // Post-backward: the gradient leaving through the unit's input means its backward is done
    // (also inside a checkpoint's recomputed backward, where grad-ready hooks wait for the
    // outer pass). Units whose input needs no gradient free at their last grad-ready instead:
    // their hook runs before their backward, with no gradient, and does nothing.
    ids.push_back(m.register_backward_hook([this, u](nn::Module&, const Tensor& grad_input) {
      if (grad_input.defined()) engine_->release(u);
    }));
  }

  void start_gather(std::size_t u) {
    engine_->start_gather(u);
    int gathered = 0;
    for (std::size_t k = 0; k < engine_->unit_count(); ++k)
      if (!is_root(k) && engine_->holds_full(k)) ++gathered;
    max_gathered_ = std::max(max_gathered_, gathered);
  }
  void ensure_gathered(std::size_t u) {
    start_gather(u);
    engine_->gather(u);
  }
  // The `prefetch` units after u in `order` start their gathers; the one after them, its read
  // from disk (offload to NVMe with the shards there; a no-op otherwise): that read then runs
  // beside u's compute and the gathers in flight, where the gather would otherwise make the
  // host wait for the disk. Returns false where `order` ended before the unit to read ahead
  // (true where u is not in it: nothing to do).
  bool prefetch_after(std::size_t u, const std::vector<std::size_t>& order) {
    const auto at = std::find(order.begin(), order.end(), u);
    if (at == order.end()) return true;
    const auto next = static_cast<std::size_t>(at - order.begin()) + 1;
    const auto ahead = next + static_cast<std::size_t>(engine_->policy().prefetch);
    for (std::size_t k = next; k < ahead && k < order.size(); ++k) start_gather(order[k]);
    if (ahead >= order.size()) return false;
    engine_->read_shard_ahead(order[ahead]);
    return true;
  }
  // The forward's last unit: the backward's gathers come next. Its first unit, this one, is
  // gathered again right after the forward, with no compute to read beside; the next one not
  // gathered now -- the largest shards of a network often end it -- is read ahead beside this
  // unit's forward and the loss. (Only here: earlier, it would take the place of the forward's
  // own next read -- one read ahead at a time, ParamGroups::read_shard_ahead.)
  void read_backward_ahead(std::size_t u) {
    if (forward_order_.empty() || u != forward_order_.back()) return;
    for (auto it = forward_order_.rbegin() + 1; it != forward_order_.rend(); ++it)
      if (!engine_->holds_full(*it)) return engine_->read_shard_ahead(*it);
  }

  void pre_forward(std::size_t u) {
    auto& tape = autograd::tape(*ctx_);
    if (!tape.recomputing() && !order_recorded_ &&
        std::find(forward_order_.begin(), forward_order_.end(), u) == forward_order_.end())
      forward_order_.push_back(u);
    ensure_gathered(u);
    if (order_recorded_ && !tape.recomputing() && !prefetch_after(u, forward_order_) &&
        tape.grad_enabled())
      read_backward_ahead(u);
  }
  void post_forward(std::size_t u) {
    // (During checkpoint recomputation too: the recomputed graph's backward-pre hook gathers the
    // unit again when its backward comes, so a segment of many units never holds them all.)
    auto& tape = autograd::tape(*ctx_);
    if (is_root(u)) {
      if (tape.recomputing()) return;
      if (!forward_order_.empty()) order_recorded_ = true;
      if (!tape.grad_enabled())  // no backward follows: free everything
        for (std::size_t k = 0; k < engine_->unit_count(); ++k) engine_->release(k);
      return;
    }
    if (!tape.backward_follows())
      engine_->release(u);  // no backward follows: nothing to keep for it
    else if (engine_->policy().reshard_after_forward)
      // With hpZ, keeps this rank's slice over the node -- also after a checkpoint segment's
      // forward without grad, for the recomputation's gather and the backward's.
      engine_->release_after_forward(u);
    else if (!tape.grad_enabled())
      engine_->release(u);  // (a checkpointed segment's units are gathered again to recompute)
  }
  void pre_backward(std::size_t u) {
    binding_->begin_backward();
    engine_->poll_reductions();
    ensure_gathered(u);
    if (order_recorded_) {
      // Ahead in the backward: the units whose backward has not finished. One that has -- the
      // root unit once its gradients (often the head's, the first) are all in -- was released
      // and is not needed again; a prefetch gathered it anew for nothing.
      std::vector<std::size_t> reverse;
      for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
        if (*it == u || !engine_->unit_ready(*it)) reverse.push_back(*it);
      prefetch_after(u, reverse);
    }
  }

  Context* ctx_;
  Engine* engine_;
  ModuleBinding* binding_;
  std::vector<nn::Module*> modules_;  // per unit: whose hooks gather it
  std::size_t root_unit_;
  std::vector<std::vector<nn::HookId>> hooks_;  // per unit
  std::vector<std::size_t> forward_order_;      // units by first forward-pre hook, recorded once
  bool order_recorded_ = false;
  int max_gathered_ = 0;
};

}  // namespace shardkit::parallel
