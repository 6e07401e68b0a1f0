// Differentiable conversions between [N, C, H, W] activations and channel blocks
// ([N, C/b, H, W, b], core/channel_blocks.hpp): exact copies each way, the gradient converted
// back the other way.
#pragma once

#include "shardkit/autograd/backward.hpp"
#include "shardkit/core/channel_blocks.hpp"

namespace shardkit::autograd {

namespace detail {

struct ToChannelBlocksNode final : Node {
  const char* name() const override { return "to_channel_blocks"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {shardkit::from_channel_blocks(ctx, g)};
  }
};

struct FromChannelBlocksNode final : Node {
  std::int64_t block = 0;
  const char* name() const override { return "from_channel_blocks"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {shardkit::to_channel_blocks(ctx, g, block)};
  }
};

}  // namespace detail

inline Variable to_channel_blocks(Context& ctx, const Variable& x, std::int64_t block) {
  check(x.defined(), "to_channel_blocks: the input is undefined", module_suffix(ctx));
  Tensor y = shardkit::to_channel_blocks(ctx, x.data(), block);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  return record(ctx, make_pooled<detail::ToChannelBlocksNode>(), {&x}, std::move(y));
}

inline Variable from_channel_blocks(Context& ctx, const Variable& x) {
  check(x.defined(), "from_channel_blocks: the input is undefined", module_suffix(ctx));
  Tensor y = shardkit::from_channel_blocks(ctx, x.data());
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::FromChannelBlocksNode>();
  node->block = x.size(4);
  return record(ctx, node, {&x}, std::move(y));
}

// `x` in the layout of `like`, both activations of a network that keeps channel blocks: `x`
// itself when they agree, else converted (blocked as `like` is, or back to [N, C, H, W]).
inline Variable channel_blocks_like(Context& ctx, const Variable& x, const Variable& like) {
  const bool x_blocked = has_channel_block_form(x.data());
  const bool like_blocked = has_channel_block_form(like.data());
  if (like_blocked)
    return x_blocked && x.size(4) == like.size(4)
               ? x
               : to_channel_blocks(ctx, x_blocked ? from_channel_blocks(ctx, x) : x, like.size(4));
  return x_blocked ? from_channel_blocks(ctx, x) : x;
}

}  // namespace shardkit::autograd
