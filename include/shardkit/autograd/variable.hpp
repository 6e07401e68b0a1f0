// Variable: a tensor plus what reverse mode needs (its gradient, whether it wants one, the node
// that produced it, and hooks fired when its gradient is final for a backward pass).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/small_object_pool.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::autograd {

class Node;
class Variable;

// Called once per backward pass, when no further gradient can reach the leaf in that pass: the
// gradient bucketer (DDP/SDP) and FSDP's reduce-scatter start from here.
using GradReadyHook = std::function<void(Variable&)>;

// Where a leaf's gradient goes, decided by its owner at each accumulation instead of a tensor
// the leaf keeps: the sharded wrappers hand out a view of the bucket (or unit) buffer that is
// current for this backward, so gradients land there with no extra copy and the leaf holds
// nothing between backwards.
using GradProvider = std::function<Tensor()>;

struct VariableImpl {
  Tensor data;
  Tensor grad;  // leaves: accumulated over backward passes until zero_grad()/clear_grad()
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // the producer; null for leaves
  std::string name;
  std::vector<GradReadyHook> grad_ready_hooks;
  GradProvider grad_provider;
  // The backward engine's row for this leaf in the pass that last reached it (see Node).
  std::uint64_t backward_pass = 0;
  std::uint32_t backward_row = 0;
};

class Variable {
 public:
  Variable() = default;
  explicit Variable(Tensor data, bool requires_grad = false, std::string name = {})
      : impl_(make_pooled<VariableImpl>()) {
    impl_->data = std::move(data);
    impl_->requires_grad = requires_grad;
    impl_->name = std::move(name);
  }

  static Variable from_impl(std::shared_ptr<VariableImpl> impl) {
    Variable v;
    v.impl_ = std::move(impl);
    return v;
  }

  bool defined() const { return impl_ && impl_->data.defined(); }
  const Tensor& data() const { return checked().data; }
  // Replaces the values (e.g. a parameter re-pointed into a flat buffer); shape must not change.
  void set_data(Tensor data) {
    check(data.shape() == checked().data.shape(), "set_data of '", impl_->name, "': new shape ",
          shape_text(data.shape()), " differs from ", shape_text(impl_->data.shape()));
    impl_->data = std::move(data);
  }

  const Tensor& grad() const { return checked().grad; }
  // Lets the caller choose where the gradient lives (e.g. a view into a flat gradient buffer);
  // backward accumulates into it in place.
  void set_grad(Tensor grad) {
    check(!grad.defined() || grad.shape() == checked().data.shape(), "set_grad of '", impl_->name,
          "': gradient shape ", shape_text(grad.shape()), " differs from the value's ",
          shape_text(impl_->data.shape()));
    checked().grad = std::move(grad);
  }
  void clear_grad() { checked().grad = Tensor(); }

  bool requires_grad() const { return impl_ && impl_->requires_grad; }
  void set_requires_grad(bool value) {
    check(is_leaf(), "set_requires_grad on '", checked().name,
          "', which an operation produced; only leaves (parameters, inputs) can change it; use "
          "detach() for a leaf copy");
    impl_->requires_grad = value;
  }
  bool is_leaf() const { return !checked().grad_fn; }
  const std::shared_ptr<Node>& grad_fn() const { return checked().grad_fn; }

  const Shape& shape() const { return data().shape(); }
  std::int64_t dim() const { return data().dim(); }
  std::int64_t size(std::int64_t d) const { return data().size(d); }
  std::int64_t numel() const { return data().numel(); }
  DType dtype() const { return data().dtype(); }
  Device device() const { return data().device(); }

  const std::string& name() const { return checked().name; }
  void set_name(std::string name) { checked().name = std::move(name); }

  void register_grad_ready_hook(GradReadyHook hook) {
    check(is_leaf(), "grad-ready hooks belong on leaves (parameters); '", impl_->name,
          "' was produced by an operation");
    impl_->grad_ready_hooks.push_back(std::move(hook));
  }
  void clear_grad_ready_hooks() { checked().grad_ready_hooks.clear(); }

  // Backward adds this leaf's gradient into provider() (asked at every accumulation) rather than
  // into grad(); an empty provider restores the default.
  void set_grad_provider(GradProvider provider) {
    check(is_leaf(), "a grad provider belongs on a leaf (parameter); '", impl_->name,
          "' was produced by an operation");
    impl_->grad_provider = std::move(provider);
  }

  // Same values, cut from the graph: a leaf that does not require grad.
  Variable detach() const { return Variable(data(), false, checked().name); }

  VariableImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<VariableImpl>& impl_ptr() const { return impl_; }

 private:
  VariableImpl& checked() const {
    check(impl_ != nullptr, "use of an undefined autograd::Variable");
    return *impl_;
  }

  std::shared_ptr<VariableImpl> impl_;
};

}  // namespace shardkit::autograd
