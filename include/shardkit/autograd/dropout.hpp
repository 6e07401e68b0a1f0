// Dropout (nn.Dropout: each element zeroed with probability p) and drop connect (ClassyVision's
// drop_connect, stochastic depth's per-sample form: each sample's whole tensor zeroed with
// probability p), the kept values scaled by 1 / (1 - p) so the expectation is unchanged. For a
// training forward only: a module calls them when it is training.
//
// The masks come from the tape's random stream (Tape::random_stream): counter-based Philox
// words, the same on any device, element i kept where its word's unit value is >= p
// (RandomKind::keep_mask). The mask holds 0 and 1, exact in any dtype, and 1 / (1 - p) is applied
// in the product's arithmetic (f32 for f16 and bf16), rounded once as PyTorch's division is: a
// scale rounded to bf16 first would bias every kept value (1 / 0.975 is 1.0234 there). Keyed by
// the trainer per step and put back by activation checkpointing, so a resumed run and a
// recomputed segment draw the masks they drew before. A captured step would replay one mask
// forever: a draw inside a capture is refused by name.
#pragma once

#include <cmath>

#include "shardkit/autograd/backward.hpp"

namespace shardkit::autograd {

namespace detail {

// A tensor of `shape` in like's dtype on its device: 1 where kept, 0 where dropped.
inline Tensor keep_mask(Context& ctx, const Tensor& like, Shape shape, double p, const char* op) {
  ctx.refuse_in_capture(op,
                        "a replay would apply the captured mask again; run the network in "
                        "evaluation mode or with p = 0 in a captured step, or do not capture");
  Tensor mask = fn::new_like(ctx, like, std::move(shape), like.dtype());
  RandomSpec spec{RandomKind::keep_mask, p, 1.0, tape(ctx).random_stream().key, 0};
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

// x [N, ...] times mask [N] (each sample's elements by its 0 or 1), times `scale`: the kept
// values rounded once.
inline Tensor scale_samples(Context& ctx, const Tensor& x, const Tensor& mask, double scale) {
  Tensor masked = fn::new_like(ctx, x);
  if (x.numel() > 0)
    kernels_for(ctx, x).channel_scale(ctx, x, mask, masked, 1, mask.numel(),
                                      x.numel() / mask.numel());
  return fn::scale(ctx, masked, scale);  // (a product by 0 or 1 is exact: one rounding here)
}

struct DropoutNode final : Node {
  Tensor mask;
  double scale = 1;
  const char* name() const override { return "dropout"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::pointwise(ctx, Pointwise::mul, contiguous(ctx, g), mask, scale, 0)};
  }
  void release_saved() override { mask = Tensor(); }
};

struct DropSamplesNode final : Node {
  Tensor mask;
  double scale = 1;
  const char* name() const override { return "drop_connect"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {scale_samples(ctx, contiguous(ctx, g), mask, scale)};
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
  const double scale = 1.0 / (1.0 - p);
  Tensor y = fn::pointwise(ctx, Pointwise::mul, xd, mask, scale, 0);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::DropoutNode>();
  node->mask = std::move(mask);
  node->scale = scale;
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
  Tensor mask = detail::keep_mask(ctx, xd, {xd.size(0)}, p, "drop_connect's mask");
  const double scale = 1.0 / (1.0 - p);
  Tensor y = detail::scale_samples(ctx, xd, mask, scale);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::DropSamplesNode>();
  node->mask = std::move(mask);
  node->scale = scale;
  return record(ctx, node, {&x}, std::move(y));
}

}  // namespace shardkit::autograd
