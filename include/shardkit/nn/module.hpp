// Module: named parameters, buffers and children with PyTorch's state-dict names
// ("layer1.0.conv1.weight"), train/eval mode, and forward-pre/post and backward-pre/post hooks
// (FSDP gathers before a unit's forward and frees after; the bucketer listens to backward).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/autograd/autograd.hpp"

namespace shardkit::nn {

using autograd::Variable;

class Module;
using ForwardPreHook = std::function<void(Module&, const Variable& input)>;
using ForwardHook = std::function<void(Module&, const Variable& input, const Variable& output)>;
// grad_output: the gradient arriving at the module's output (before its backward runs).
using BackwardPreHook = std::function<void(Module&, const Tensor& grad_output)>;
// grad_input: the gradient leaving through the module's input (its backward is done). For an
// input that needs no gradient (images), none is computed for it: the hook runs when the
// gradient reaches the module's output, with an undefined grad_input (PyTorch's full backward
// hook then gets None), and the module's backward has not run yet.
using BackwardHook = std::function<void(Module&, const Tensor& grad_input)>;
// Names one registered hook of one module, for remove_hook (PyTorch's RemovableHandle).
using HookId = std::uint64_t;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual const char* type_name() const = 0;
  virtual Variable forward(Context& ctx, const Variable& x) = 0;

  // Runs forward with this module's path in errors, and its hooks. Backward hooks hold a
  // pointer to the module: keep it alive until the backward pass is over.
  Variable operator()(Context& ctx, const Variable& input) {
    autograd::ModuleScope scope(ctx, scope_path());
    for (auto& [id, hook] : forward_pre_hooks_) hook(*this, input);
    const bool grad = autograd::tape(ctx).grad_enabled();
    // Backward hooks see the gradient leaving through the input; an input that needs none gets
    // none (a pass-through that needed a gradient would make the first layer compute one for
    // the images), and its hooks run where the output's arrives.
    const bool hooks_at_input = grad && !backward_hooks_.empty() && input.requires_grad();
    const bool hooks_at_output = grad && !backward_hooks_.empty() && !hooks_at_input;
    Variable x = input;
    if (hooks_at_input)
      x = autograd::identity_with_hook(ctx, x, [this](const Tensor& g) {
        for (auto& [id, hook] : backward_hooks_) hook(*this, g);
      });
    Variable y = forward(ctx, x);
    if (grad && (!backward_pre_hooks_.empty() || hooks_at_output) && y.requires_grad())
      y = autograd::identity_with_hook(ctx, y, [this, hooks_at_output](const Tensor& g) {
        for (auto& [id, hook] : backward_pre_hooks_) hook(*this, g);
        if (hooks_at_output)
          for (auto& [id, hook] : backward_hooks_) hook(*this, Tensor());
      });
    for (auto& [id, hook] : forward_hooks_) hook(*this, input, y);
    return y;
  }

  // Dotted path from the root ("layer1.0.conv1"); empty for the root itself.
  std::string path() const {
    if (parent_ == nullptr) return {};
    const std::string above = parent_->path();
    return above.empty() ? name_ : above + "." + name_;
  }

  // The path errors name for this module's ops (its type for the root), shared by every node
  // its forward records. Made once and again only after a module anywhere was registered (which
  // may have given this one a new parent): building it on each call was string concatenations
  // per module per step.
  std::shared_ptr<const std::string> scope_path() const {
    const std::uint64_t version = module_tree_version().load(std::memory_order_acquire);
    std::lock_guard lock(scope_path_mutex_);
    if (scope_path_ == nullptr || scope_path_version_ != version) {
      const std::string own = path();
      scope_path_ = std::make_shared<const std::string>(own.empty() ? type_name() : own);
      scope_path_version_ = version;
    }
    return scope_path_;
  }

  // Parameters and buffers in PyTorch's order: own entries first, then each child's.
  std::vector<std::pair<std::string, Variable>> named_parameters() const {
    std::vector<std::pair<std::string, Variable>> out;
    collect_parameters("", out);
    return out;
  }
  std::vector<Variable> parameters() const {
    std::vector<Variable> out;
    for (auto& [name, p] : named_parameters()) out.push_back(p);
    return out;
  }
  std::vector<std::pair<std::string, Tensor>> named_buffers() const {
    std::vector<std::pair<std::string, Tensor>> out;
    collect_buffers("", out);
    return out;
  }
  // Parameters and buffers by state-dict name, each module's parameters before its buffers.
  std::vector<std::pair<std::string, Tensor>> state_dict() const {
    std::vector<std::pair<std::string, Tensor>> out;
    collect_state("", out);
    return out;
  }
  std::int64_t parameter_count() const {
    std::int64_t n = 0;
    for (auto& [name, p] : named_parameters()) n += p.numel();
    return n;
  }

  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  // Every module below (and including) this one with its path, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules() {
    std::vector<std::pair<std::string, Module*>> out;
    collect_modules("", out);
    return out;
  }

  void train(bool on = true) {
    training_ = on;
    for (auto& [name, child] : children_) child->train(on);
  }
  void eval() { train(false); }
  bool is_training() const { return training_; }

  void zero_grad() {  // (every step: walks the modules without naming them)
    for (auto& [name, p] : params_) p.clear_grad();
    for (auto& [name, child] : children_) child->zero_grad();
  }

  // Each returns an id for remove_hook. Hooks run in registration order.
  HookId register_forward_pre_hook(ForwardPreHook hook) {
    return add(forward_pre_hooks_, std::move(hook));
  }
  HookId register_forward_hook(ForwardHook hook) { return add(forward_hooks_, std::move(hook)); }
  HookId register_backward_pre_hook(BackwardPreHook hook) {
    return add(backward_pre_hooks_, std::move(hook));
  }
  HookId register_backward_hook(BackwardHook hook) { return add(backward_hooks_, std::move(hook)); }
  // Removes one hook (of any kind); false when this module has no hook with that id.
  bool remove_hook(HookId id) {
    return erase(forward_pre_hooks_, id) || erase(forward_hooks_, id) ||
           erase(backward_pre_hooks_, id) || erase(backward_hooks_, id);
  }
  bool has_hooks() const {
    return !forward_pre_hooks_.empty() || !forward_hooks_.empty() || !backward_pre_hooks_.empty() ||
           !backward_hooks_.empty();
  }
  void clear_hooks() {
    forward_pre_hooks_.clear();
    forward_hooks_.clear();
    backward_pre_hooks_.clear();
    backward_hooks_.clear();
  }

 protected:
  Variable register_parameter(std::string name, Tensor value) {
    check_new_name(name);
    Variable p(std::move(value), true, name);
    params_.emplace_back(std::move(name), p);
    return p;
  }
  Tensor register_buffer(std::string name, Tensor value) {
    check_new_name(name);
    buffers_.emplace_back(std::move(name), value);
    return value;
  }
  template <class M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> child) {
    check_new_name(name);
    check(child != nullptr && child->parent_ == nullptr, "register_module('", name,
          "'): the module is null or already has a parent");
    child->parent_ = this;
    child->name_ = name;
    module_tree_version().fetch_add(1, std::memory_order_release);  // paths below may change
    children_.emplace_back(std::move(name), child);
    return child;
  }

 private:
  template <class Hook>
  HookId add(std::vector<std::pair<HookId, Hook>>& hooks, Hook hook) {
    hooks.emplace_back(++last_hook_id_, std::move(hook));
    return last_hook_id_;
  }
  template <class Hook>
  static bool erase(std::vector<std::pair<HookId, Hook>>& hooks, HookId id) {
    const auto it =
        std::find_if(hooks.begin(), hooks.end(), [&](auto& h) { return h.first == id; });
    if (it == hooks.end()) return false;
    hooks.erase(it);
    return true;
  }

  void check_new_name(const std::string& name) const {
    check(!name.empty() && name.find('.') == std::string::npos, "module entry name '", name,
          "' must be non-empty and contain no '.'");
    for (auto& [n, p] : params_) check(n != name, "duplicate entry '", name, "' in ", type_name());
    for (auto& [n, b] : buffers_) check(n != name, "duplicate entry '", name, "' in ", type_name());
    for (auto& [n, c] : children_)
      check(n != name, "duplicate entry '", name, "' in ", type_name());
  }
  static std::string join(const std::string& prefix, const std::string& name) {
    return prefix.empty() ? name : prefix + "." + name;
  }
  void collect_parameters(const std::string& prefix,
                          std::vector<std::pair<std::string, Variable>>& out) const {
    for (auto& [name, p] : params_) out.emplace_back(join(prefix, name), p);
    for (auto& [name, child] : children_) child->collect_parameters(join(prefix, name), out);
  }
  void collect_buffers(const std::string& prefix,
                       std::vector<std::pair<std::string, Tensor>>& out) const {
    for (auto& [name, b] : buffers_) out.emplace_back(join(prefix, name), b);
    for (auto& [name, child] : children_) child->collect_buffers(join(prefix, name), out);
  }
  void collect_state(const std::string& prefix,
                     std::vector<std::pair<std::string, Tensor>>& out) const {
    for (auto& [name, p] : params_) out.emplace_back(join(prefix, name), p.data());
    for (auto& [name, b] : buffers_) out.emplace_back(join(prefix, name), b);
    for (auto& [name, child] : children_) child->collect_state(join(prefix, name), out);
  }
  void collect_modules(const std::string& prefix,
                       std::vector<std::pair<std::string, Module*>>& out) {
    out.emplace_back(prefix, this);
    for (auto& [name, child] : children_) child->collect_modules(join(prefix, name), out);
  }

  // Counts registrations in the process: a module's cached scope path is good while it holds.
  static std::atomic<std::uint64_t>& module_tree_version() {
    static std::atomic<std::uint64_t> version{1};
    return version;
  }

  Module* parent_ = nullptr;
  std::string name_;
  mutable std::mutex scope_path_mutex_;  // (ranks as threads may share a module)
  mutable std::shared_ptr<const std::string> scope_path_;
  mutable std::uint64_t scope_path_version_ = 0;
  bool training_ = true;
  std::vector<std::pair<std::string, Variable>> params_;
  std::vector<std::pair<std::string, Tensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  HookId last_hook_id_ = 0;
  std::vector<std::pair<HookId, ForwardPreHook>> forward_pre_hooks_;
  std::vector<std::pair<HookId, ForwardHook>> forward_hooks_;
  std::vector<std::pair<HookId, BackwardPreHook>> backward_pre_hooks_;
  std::vector<std::pair<HookId, BackwardHook>> backward_hooks_;
};

}  // namespace shardkit::nn
