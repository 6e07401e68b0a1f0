// Dropout (nn.Dropout: each element zeroed with probability p) and drop connect (ClassyVision's
// drop_connect, stochastic depth's per-sample form: each sample's whole tensor zeroed with
// probability p), the kept values scaled by 1 / (1 - p) so the expectation is unchanged. For a
// training forward only: a module calls them when it is training.
//
// The masks come from the tape's random stream (Tape::random_stream): counter-based Philox
// words, the same on any device, element i kept where its word's unit value is >= p
// (RandomKind::keep_mask). Keyed by the trainer per step and put back by activation
// checkpointing, so a resumed run and a recomputed segment draw the masks they drew before. A
// captured step would replay one mask forever: a draw inside a capture is refused by name.
#pragma once

#include <cmath>

#include "shardkit/autograd/backward.hpp"

namespace shardkit::autograd {

namespace detail {

// A tensor of `shape` in `dtype` on x's device: 1 / (1 - p) where kept, 0 where dropped.
inline Tensor keep_mask(Context& ctx, const Tensor& like, Shape shape, double p, const char* op) {
  ctx.refuse_in_capture(op,
                        "a replay would apply the captured mask again; run the network in "
                        "evaluation mode or with p = 0 in a captured step, or do not capture");
  Tensor mask = fn::new_like(ctx, like, std::move(shape), like.dtype());
  RandomSpec spec{RandomKind::keep_mask, p, 1.0 / (1.0 - p), tape(ctx).random_stream().seed, 0};
  spec.counter_base = tape(ctx).take_random_blocks(spec.blocks_for(mask.numel()));
  shardkit::detail::tensor_kernels_for(ctx, mask).random(ctx, mask, spec);
  return mask;
}

inline void check_drop_probability(Context& ctx, const char* op, const Variable& x, double p) {
  check(x.defined(), op, ": the input is undefined", module_suffix(ctx));
  check(p >= 0 && p < 1, op, ": probability ", p, " is outside [0, 1)", module_suffix(ctx),
        "; give the share of elements to drop, e.g. 0.2");
  check(is_floating(x.dtype()), op, " needs a floating-point tensor, got ", dtype_name(x.dtype()),
        module_suffix(ctx));
}

struct DropoutNode final : Node {
  Tensor mask;
  const char* name() const override { return "dropout"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::mul(ctx, contiguous(ctx, g), mask)};
  }
  void release_saved() override { mask = Tensor(); }
};

// x [N, ...] times mask [N]: each sample's elements scaled by its mask value.
struct DropSamplesNode final : Node {
  Tensor mask;
  const char* name() const override { return "drop_connect"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    const Tensor gd = contiguous(ctx, g);
    Tensor grad = fn::new_like(ctx, gd);
    kernels_for(ctx, gd).channel_scale(ctx, gd, mask, grad, 1, mask.numel(),
                                       gd.numel() / mask.numel());
    return {grad};
  }
  void release_saved() override { mask = Tensor(); }
};

}  // namespace detail

// Each element of x zeroed with probability p, the others divided by 1 - p (nn.Dropout in
// training; p = 0 returns x).
inline Variable dropout(Context& ctx, const Variable& x, double p) {
  detail::check_drop_probability(ctx, "dropout", x, p);
  if (p == 0) return x;
  const Tensor xd = contiguous(ctx, x.data());
  Tensor mask = detail::keep_mask(ctx, xd, xd.shape(), p, "dropout's mask");
  Tensor y = fn::mul(ctx, xd, mask);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::DropoutNode>();
  node->mask = std::move(mask);
  return record(ctx, node, {&x}, std::move(y));
}

// Each sample x[n] (dimension 0) zeroed whole with probability p, the others divided by 1 - p
// (ClassyVision's drop_connect on a residual branch; p = 0 returns x).
inline Variable drop_connect(Context& ctx, const Variable& x, double p) {
  detail::check_drop_probability(ctx, "drop_connect", x, p);
  check(x.shape().size() >= 1 && x.shape()[0] >= 1, "drop_connect: x ", shape_text(x.shape()),
        " has no samples", module_suffix(ctx), "; give x as [N, ...]");
  if (p == 0) return x;
  const Tensor xd = contiguous(ctx, x.data());
  const std::int64_t samples = xd.size(0), inner = xd.numel() / samples;
  Tensor mask = detail::keep_mask(ctx, xd, {samples}, p, "drop_connect's mask");
  Tensor y = fn::new_like(ctx, xd);
  if (inner > 0) kernels_for(ctx, xd).channel_scale(ctx, xd, mask, y, 1, samples, inner);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::DropSamplesNode>();
  node->mask = std::move(mask);
  return record(ctx, node, {&x}, std::move(y));
}

}  // namespace shardkit::autograd
