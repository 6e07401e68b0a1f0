// Activation checkpointing: run a function without keeping its activations, keep only its
// input, and recompute it in backward (with the tape's recompute flag set, so batch-norm does
// not fold the batch into its running statistics a second time, and the tape's random stream
// where the forward found it, so dropout draws the same masks: PyTorch's preserve_rng_state).
#pragma once

#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "shardkit/autograd/autograd.hpp"

namespace shardkit::nn {

using autograd::Variable;
using SegmentFunction = std::function<Variable(Context&, const Variable&)>;

namespace detail {

struct CheckpointNode final : autograd::Node {
  SegmentFunction function;
  Tensor input;
  bool input_requires_grad = false;
  autograd::Tape::RandomStream random;  // where the forward began drawing
  // Edges 1..: the segment's parameters. The recomputed backward accumulates straight into
  // their gradients (no second copy of the segment's parameter gradients is held); the edges
  // let the outer pass count them and fire their grad-ready hooks when they are complete.
  std::vector<Variable> parameters;
  const char* name() const override { return "checkpoint"; }

  autograd::Gradients apply(Context& ctx, const Tensor& grad_output) override {
    check<StateError>(input.defined(),
                      "checkpoint: the saved input was freed by an earlier "
                      "backward; pass retain_graph = true to run backward twice");
    Variable x(input, input_requires_grad);
    Variable y;
    {
      autograd::RecomputeGuard recompute(ctx);
      struct PutBack {  // the stream where the backward had it, however the recompute ends
        autograd::Tape& tape;
        autograd::Tape::RandomStream stream;
        ~PutBack() { tape.set_random_stream(stream); }
      } put_back{autograd::tape(ctx), autograd::tape(ctx).random_stream()};
      put_back.tape.set_random_stream(random);
      y = function(ctx, x);
    }
    autograd::Gradients grads(edges.size());
    if (!y.requires_grad()) return grads;
    check_leaves(ctx, x, y);
    autograd::run_backward(ctx, y, grad_output, {}, /*fire_hooks=*/false);
    grads[0] = x.grad();
    return grads;
  }
  void release_saved() override { input = Tensor(); }

  // Every leaf the recomputation reaches that needs a gradient is the segment's input or one of
  // its parameters: the outer pass counts only those, and fires their grad-ready hooks once it
  // is done with them. A leaf used inside but not listed -- a weight tied from another module,
  // not registered on the segment's -- got its gradient here after its hook had fired (or with
  // none firing), and under a sharded wrapper after its bucket had gone out. (Nodes an outer
  // pass numbered are that pass's: a value the function captured, nodes/leaves not walked.)
  void check_leaves(Context& ctx, const Variable& x, const Variable& y) const {
    if (!y.grad_fn()) return;
    std::unordered_set<const autograd::VariableImpl*> known{x.impl()};
    for (const auto& p : parameters) known.insert(p.impl());
    const autograd::Tape& tape = autograd::tape(ctx);
    std::vector<const autograd::Node*> stack{y.grad_fn().get()};
    std::unordered_set<const autograd::Node*> seen{y.grad_fn().get()};
    while (!stack.empty()) {
      const autograd::Node* node = stack.back();
      stack.pop_back();
      for (const autograd::Edge& edge : node->edges) {
        if (edge.node) {
          const autograd::Node* next = edge.node.get();
          if (next->backward_pass != 0 && tape.backward_pass_running(next->backward_pass)) continue;
          if (seen.insert(next).second) stack.push_back(next);
        } else if (edge.leaf && edge.leaf->requires_grad && known.count(edge.leaf.get()) == 0) {
          fail<StateError>("checkpoint: the recomputed segment uses '", edge.leaf->name, "' (",
                           shape_text(edge.leaf->data.shape()),
                           "), which is neither its input nor among its parameters; pass it in "
                           "the segment's parameters (a weight shared with another module too)");
        }
      }
    }
  }
};

}  // namespace detail

// y = function(x), keeping only x; `parameters` are those the function uses (their gradients
// are accumulated during the recomputation; the outer backward fires their grad-ready hooks as
// usual). Without grad mode this is a plain call.
inline Variable checkpoint(Context& ctx, const SegmentFunction& function, const Variable& x,
                           const std::vector<Variable>& parameters) {
  bool wants_grad = x.requires_grad();
  for (const auto& p : parameters) wants_grad = wants_grad || p.requires_grad();
  if (!autograd::tape(ctx).grad_enabled() || !wants_grad) return function(ctx, x);
  const autograd::Tape::RandomStream random = autograd::tape(ctx).random_stream();
  Variable y;
  {
    autograd::CheckpointForwardGuard no_grad(ctx);  // (the recomputation in backward follows)
    y = function(ctx, x);
  }
  auto node = make_pooled<detail::CheckpointNode>();
  node->random = random;
  node->function = function;
  node->input = x.data();
  node->input_requires_grad = x.requires_grad();
  node->parameters = parameters;
  std::vector<const Variable*> inputs{&x};
  for (const auto& p : node->parameters) inputs.push_back(&p);
  return autograd::record_inputs(ctx, node, inputs, y.data());
}

}  // namespace shardkit::nn
