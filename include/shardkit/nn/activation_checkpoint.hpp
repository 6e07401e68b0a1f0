// Activation checkpointing: run a function without keeping its activations, keep only its
// input, and recompute it in backward (with the tape's recompute flag set, so batch-norm does
// not fold the batch into its running statistics a second time, and the tape's random stream
// where the forward found it, so dropout draws the same masks: PyTorch's preserve_rng_state).
#pragma once

#include <functional>
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
    autograd::run_backward(ctx, y, grad_output, {}, /*fire_hooks=*/false);
    grads[0] = x.grad();
    return grads;
  }
  void release_saved() override { input = Tensor(); }
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
