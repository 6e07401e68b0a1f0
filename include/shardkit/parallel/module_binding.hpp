// ModuleBinding: a module's parameters bound to an engine, the same way under every stage. Each
// parameter becomes a view of its group's buffer (so names, state_dict(), hooks, train()/eval()
// and activation checkpointing work unchanged: FairScale's FlattenParamsWrapper idea), its
// gradient goes straight into the engine's bucket storage (a grad provider: no copy), and its
// grad-ready hook marks it ready. Parameters the loss does not reach count as zero gradients,
// marked ready when the backward starts (PyTorch DDP's find_unused_parameters does the same):
// marked at its end instead, a parameter unused on some ranks only made its unit's reduction
// come later there than on the others, and FSDP's units, each a group of its own on one
// communicator, then issued their collectives in different orders on different ranks. When the
// outermost backward ends the engine's reductions are waited for; when an exception cuts it
// short, the backward stays open in the engine until zero_grad() closes it, and the next one
// is refused until then (docs/design.md, "A backward cut short").
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/parallel/engine.hpp"

namespace shardkit::parallel {

class ModuleBinding {
 public:
  // `params[i]` is engine parameter i. `after_ready(i)` runs after each engine.ready(i) and
  // `after_backward()` after the end of the backward's finish() (FSDP frees its units there).
  ModuleBinding(Context& ctx, Engine& engine, std::vector<autograd::Variable> params,
                std::function<void(std::size_t)> after_ready = {},
                std::function<void()> after_backward = {})
      : ctx_(&ctx),
        engine_(&engine),
        params_(std::move(params)),
        after_ready_(std::move(after_ready)),
        after_backward_(std::move(after_backward)) {
    check(params_.size() == engine.param_count(), "ModuleBinding: ", params_.size(),
          " parameters for an engine of ", engine.param_count());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.set_data(engine.param(i));  // (the compute copy under mixed precision)
      p.clear_grad();
      if (!p.requires_grad()) continue;
      p.set_grad_provider([this, i] { return engine_->grad(i); });
      p.register_grad_ready_hook([this, i](autograd::Variable&) { on_grad_ready(i); });
    }
  }
  ~ModuleBinding() {
    for (auto& p : params_) {
      p.set_grad_provider({});
      p.clear_grad_ready_hooks();
    }
  }
  ModuleBinding(const ModuleBinding&) = delete;
  ModuleBinding& operator=(const ModuleBinding&) = delete;

  // The first event of a backward (a grad-ready hook, or FSDP's backward-pre hook) queues the
  // end-of-backward work on the tape, once, and marks ready the parameters the backward does
  // not reach (its graph was found before any node ran).
  void begin_backward() {
    if (in_backward_) return;
    check<StateError>(!engine_->backward_open(),
                      "a backward started while the last one is still open: an exception cut it "
                      "short, and its gradients are partial; call zero_grad() (it waits for the "
                      "reductions that backward launched and drops them), then run the backward "
                      "again");
    in_backward_ = true;
    autograd::tape(*ctx_).queue_callback([this] { end_backward(); },
                                         [this] { in_backward_ = false; });
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].requires_grad() && !engine_->is_ready(i) &&
          !autograd::reached_by_running_backward(*ctx_, params_[i]))
        mark_ready(i);
  }
  // Drops every parameter's gradient held on the Variable side (the engine clears its own).
  void clear_grads() {
    for (auto& p : params_) p.clear_grad();
  }

 private:
  void on_grad_ready(std::size_t i) {
    begin_backward();
    mark_ready(i);
  }
  void mark_ready(std::size_t i) {
    engine_->ready(i);
    if (after_ready_) after_ready_(i);
  }
  void end_backward() {
    in_backward_ = false;  // (first: an exception from the finish leaves the backward open)
    // (what is left: a leaf reached whose hook did not fire -- none in a pass that ran whole)
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].requires_grad() && !engine_->is_ready(i)) engine_->ready(i);
    engine_->finish();
    if (after_backward_) after_backward_();
  }

  Context* ctx_;
  Engine* engine_;
  std::vector<autograd::Variable> params_;  // engine parameter order
  std::function<void(std::size_t)> after_ready_;
  std::function<void()> after_backward_;
  bool in_backward_ = false;
};

}  // namespace shardkit::parallel
