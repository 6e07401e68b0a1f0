// Differentiable element-wise and shape ops: add, mul, scale, relu, sigmoid, silu, channel_scale,
// flatten, reshape, cat, cast, identity.
#pragma once

#include <cmath>

#include "shardkit/autograd/backward.hpp"

namespace shardkit::autograd {

namespace detail {

inline void check_same_shape(Context& ctx, const char* op, const Variable& a, const Variable& b) {
  check(a.defined() && b.defined(), op, ": an input is undefined", module_suffix(ctx));
  check(a.shape() == b.shape(), op, ": shapes ", shape_text(a.shape()), " and ",
        shape_text(b.shape()), " differ", module_suffix(ctx),
        "; both operands need the same shape (no broadcasting)");
  check(a.dtype() == b.dtype(), op, ": dtypes ", dtype_name(a.dtype()), " and ",
        dtype_name(b.dtype()), " differ", module_suffix(ctx), "; cast one first");
  check(a.device() == b.device(), op, ": operands on ", a.device(), " and ", b.device(),
        module_suffix(ctx));
}

struct AddNode final : Node {
  const char* name() const override { return "add"; }
  Gradients apply(Context&, const Tensor& g) override { return {g, g}; }
};

struct MulNode final : Node {
  Tensor a, b;
  const char* name() const override { return "mul"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {edges[0].valid() ? fn::mul(ctx, g, b) : Tensor(),
            edges[1].valid() ? fn::mul(ctx, g, a) : Tensor()};
  }
  void release_saved() override { a = b = Tensor(); }
};

struct ScaleNode final : Node {
  double alpha = 1;
  const char* name() const override { return "scale"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::scale(ctx, contiguous(ctx, g), alpha)};
  }
};

struct ReluNode final : Node {
  Tensor y;
  const char* name() const override { return "relu"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::pointwise(ctx, Pointwise::relu_backward, g, y, 1, 0)};  // (y in g's layout)
  }
  void release_saved() override { y = Tensor(); }
};

struct AddReluNode final : Node {
  Tensor y;
  const char* name() const override { return "add_relu"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    Tensor masked = fn::pointwise(ctx, Pointwise::relu_backward, g, y, 1, 0);
    return {masked, masked};
  }
  void release_saved() override { y = Tensor(); }
};

struct SigmoidNode final : Node {
  Tensor y;
  const char* name() const override { return "sigmoid"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::pointwise(ctx, Pointwise::sigmoid_backward, g, y, 1, 0)};
  }
  void release_saved() override { y = Tensor(); }
};

struct SiluNode final : Node {
  Tensor x;
  const char* name() const override { return "silu"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {fn::pointwise(ctx, Pointwise::silu_backward, g, x, 1, 0)};
  }
  void release_saved() override { x = Tensor(); }
};

// x [N, C, H, W] * gate [N, C, 1, 1]: each plane (n, c) scaled by gate[n, c].
struct ChannelScaleNode final : Node {
  Tensor x, gate;  // (contiguous)
  const char* name() const override { return "channel_scale"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    const Tensor gd = contiguous(ctx, g);
    const std::int64_t planes = gate.numel(), inner = x.size(2) * x.size(3);
    Tensor grad_x, grad_gate;
    if (edges[0].valid()) {
      grad_x = fn::new_like(ctx, x);
      kernels_for(ctx, x).channel_scale(ctx, gd, gate, grad_x, 1, planes, inner);
    }
    if (edges[1].valid()) {  // each plane's sum of g * x (summed in f64 on the CPU)
      const Tensor products = fn::mul(ctx, gd, x);
      grad_gate = fn::new_like(ctx, gate);
      kernels_for(ctx, x).channel_sum(ctx, products, grad_gate, 1, planes, inner);
    }
    return {grad_x, grad_gate};
  }
  void release_saved() override { x = gate = Tensor(); }
};

struct ViewNode final : Node {
  Shape input_shape;
  const char* name() const override { return "reshape"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    return {contiguous(ctx, g).view(input_shape)};
  }
};

struct CatNode final : Node {
  std::vector<std::int64_t> rows;  // each input's extent along dim 0
  const char* name() const override { return "cat"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    Gradients out;
    std::int64_t at = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      out.push_back(edges[i].valid() ? contiguous(ctx, g.slice(0, at, at + rows[i])) : Tensor());
      at += rows[i];
    }
    return out;
  }
};

struct CastNode final : Node {
  DType input_dtype = DType::f32;
  const char* name() const override { return "cast"; }
  Gradients apply(Context& ctx, const Tensor& g) override { return {cast(ctx, g, input_dtype)}; }
};

struct IdentityNode final : Node {
  std::function<void(const Tensor&)> on_grad;  // sees the gradient passing through
  const char* name() const override { return "identity"; }
  Gradients apply(Context&, const Tensor& g) override {
    if (on_grad) on_grad(g);
    return {g};
  }
};

inline Tensor contiguous_data(Context& ctx, const Variable& v) { return contiguous(ctx, v.data()); }

}  // namespace detail

// (add and relu keep a channels-last input so, core/channels_last.hpp: the residual additions
// and activations of a channels-last network run in its layout)
inline Variable add(Context& ctx, const Variable& a, const Variable& b) {
  detail::check_same_shape(ctx, "add", a, b);
  Tensor y = fn::add(ctx, a.data(), b.data());
  if (!needs_grad(ctx, {&a, &b})) return Variable(std::move(y));
  return record(ctx, make_pooled<detail::AddNode>(), {&a, &b}, std::move(y));
}

inline Variable mul(Context& ctx, const Variable& a, const Variable& b) {
  detail::check_same_shape(ctx, "mul", a, b);
  Tensor ad = detail::contiguous_data(ctx, a), bd = detail::contiguous_data(ctx, b);
  Tensor y = fn::mul(ctx, ad, bd);
  if (!needs_grad(ctx, {&a, &b})) return Variable(std::move(y));
  auto node = make_pooled<detail::MulNode>();
  if (b.requires_grad()) node->a = ad;
  if (a.requires_grad()) node->b = bd;
  return record(ctx, node, {&a, &b}, std::move(y));
}

// alpha * x (a temperature, a loss weight).
inline Variable scale(Context& ctx, const Variable& x, double alpha) {
  check(x.defined(), "scale: the input is undefined", module_suffix(ctx));
  check(std::isfinite(alpha), "scale: factor ", alpha, " is not finite", module_suffix(ctx));
  Tensor y = fn::scale(ctx, detail::contiguous_data(ctx, x), alpha);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::ScaleNode>();
  node->alpha = alpha;
  return record(ctx, node, {&x}, std::move(y));
}

inline Variable relu(Context& ctx, const Variable& x) {
  check(x.defined(), "relu: the input is undefined", module_suffix(ctx));
  Tensor y = fn::pointwise(ctx, Pointwise::relu, x.data(), Tensor(), 1, 0);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::ReluNode>();
  node->y = y;
  return record(ctx, node, {&x}, std::move(y));
}

// relu(add(a, b)) in one pass, with the same values and gradients (a residual block's end).
inline Variable add_relu(Context& ctx, const Variable& a, const Variable& b) {
  detail::check_same_shape(ctx, "add_relu", a, b);
  Tensor y = fn::add_relu(ctx, a.data(), b.data());
  if (!needs_grad(ctx, {&a, &b})) return Variable(std::move(y));
  auto node = make_pooled<detail::AddReluNode>();
  node->y = y;
  return record(ctx, node, {&a, &b}, std::move(y));
}

// 1 / (1 + exp(-x)) element by element (torch.sigmoid).
inline Variable sigmoid(Context& ctx, const Variable& x) {
  check(x.defined(), "sigmoid: the input is undefined", module_suffix(ctx));
  Tensor y = fn::pointwise(ctx, Pointwise::sigmoid, x.data(), Tensor(), 1, 0);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::SigmoidNode>();
  node->y = y;
  return record(ctx, node, {&x}, std::move(y));
}

// x / (1 + exp(-x)) element by element (torch.nn.SiLU, swish).
inline Variable silu(Context& ctx, const Variable& x) {
  check(x.defined(), "silu: the input is undefined", module_suffix(ctx));
  Tensor y = fn::pointwise(ctx, Pointwise::silu, x.data(), Tensor(), 1, 0);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::SiluNode>();
  node->x = x.data();
  return record(ctx, node, {&x}, std::move(y));
}

// x [N, C, H, W] times gate [N, C, 1, 1], the gate broadcast over each plane: PyTorch's
// `x * gate` in a squeeze-and-excitation layer. The result is contiguous [N, C, H, W]; a
// channels-last x is read through an NCHW copy.
inline Variable channel_scale(Context& ctx, const Variable& x, const Variable& gate) {
  check(x.defined() && gate.defined(), "channel_scale: an input is undefined", module_suffix(ctx));
  const Shape& xs = x.shape();
  check(xs.size() == 4 && gate.shape() == Shape{xs[0], xs[1], 1, 1}, "channel_scale: x ",
        shape_text(xs), " and gate ", shape_text(gate.shape()), module_suffix(ctx),
        "; give x as [N, C, H, W] and the gate as [N, C, 1, 1]");
  check(x.dtype() == gate.dtype(), "channel_scale: dtypes ", dtype_name(x.dtype()), " and ",
        dtype_name(gate.dtype()), " differ", module_suffix(ctx), "; cast one first");
  check(x.device() == gate.device(), "channel_scale: operands on ", x.device(), " and ",
        gate.device(), module_suffix(ctx));
  Tensor xd = detail::contiguous_data(ctx, x), gd = detail::contiguous_data(ctx, gate);
  Tensor y = fn::new_like(ctx, xd);
  kernels_for(ctx, xd).channel_scale(ctx, xd, gd, y, 1, xs[0] * xs[1], xs[2] * xs[3]);
  if (!needs_grad(ctx, {&x, &gate})) return Variable(std::move(y));
  auto node = make_pooled<detail::ChannelScaleNode>();
  node->x = xd;
  node->gate = gd;
  return record(ctx, node, {&x, &gate}, std::move(y));
}

// Same elements, new shape (one entry may be -1).
inline Variable reshape(Context& ctx, const Variable& x, Shape shape) {
  check(x.defined(), "reshape: the input is undefined", module_suffix(ctx));
  Tensor y = detail::contiguous_data(ctx, x).view(std::move(shape));
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::ViewNode>();
  node->input_shape = x.shape();
  return record(ctx, node, {&x}, std::move(y));
}

// [N, d1, d2, ...] -> [N, d1*d2*...] (torch.flatten(x, 1)).
inline Variable flatten(Context& ctx, const Variable& x) {
  check(x.defined() && x.dim() >= 1, "flatten: needs a tensor with a batch dimension",
        module_suffix(ctx));
  return reshape(ctx, x, {x.size(0), -1});
}

// The inputs stacked along dimension 0 (torch.cat(xs, 0)); the other dimensions must agree.
inline Variable cat(Context& ctx, const std::vector<Variable>& xs) {
  check(!xs.empty(), "cat: no inputs", module_suffix(ctx));
  std::int64_t total = 0;
  for (const auto& x : xs) {
    check(x.defined() && x.dim() >= 1, "cat: an input is undefined or 0-d", module_suffix(ctx));
    Shape rest_x(x.shape().begin() + 1, x.shape().end());
    Shape rest_0(xs[0].shape().begin() + 1, xs[0].shape().end());
    check(rest_x == rest_0 && x.dtype() == xs[0].dtype() && x.device() == xs[0].device(),
          "cat: input ", shape_text(x.shape()), " (", dtype_name(x.dtype()), ") does not stack on ",
          shape_text(xs[0].shape()), " (", dtype_name(xs[0].dtype()), ")", module_suffix(ctx),
          "; all but the first dimension, the dtype and the device must agree");
    total += x.size(0);
  }
  Shape shape = xs[0].shape();
  shape[0] = total;
  Tensor y = fn::new_like(ctx, xs[0].data(), shape, xs[0].dtype());
  auto node = make_pooled<detail::CatNode>();
  std::int64_t at = 0;
  std::vector<const Variable*> inputs;
  for (const auto& x : xs) {
    copy(ctx, y.slice(0, at, at + x.size(0)), x.data());
    at += x.size(0);
    node->rows.push_back(x.size(0));
    inputs.push_back(&x);
  }
  bool any = false;
  for (const auto* x : inputs) any = any || needs_grad(ctx, {x});
  if (!any) return Variable(std::move(y));
  return record_inputs(ctx, node, inputs, std::move(y));
}

// Converts to `dtype` (e.g. f16 activations into an f32 batch-norm); gradients convert back.
// A channels-last input that stays so in `dtype` keeps its layout (core/channels_last.hpp).
inline Variable cast(Context& ctx, const Variable& x, DType dtype) {
  check(x.defined(), "cast: the input is undefined", module_suffix(ctx));
  if (x.dtype() == dtype) return x;
  Tensor y = keeps_channels_last(x.data()) && channels_last_applies(x.device(), dtype, x.shape())
                 ? empty_channels_last(ctx, x.device(), x.shape(), dtype)
                 : fn::new_like(ctx, x.data(), x.shape(), dtype);
  copy(ctx, y, x.data());
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::CastNode>();
  node->input_dtype = x.dtype();
  return record(ctx, node, {&x}, std::move(y));
}

// Passes x through; `on_grad` sees the gradient flowing back through this point (module
// backward hooks are built on it). Where no gradient will flow (x needs none, or grad mode is
// off), x itself, and `on_grad` never runs.
inline Variable identity_with_hook(Context& ctx, const Variable& x,
                                   std::function<void(const Tensor&)> on_grad) {
  if (!needs_grad(ctx, {&x})) return x;
  auto node = make_pooled<detail::IdentityNode>();
  node->on_grad = std::move(on_grad);
  return record(ctx, node, {&x}, x.data());
}

}  // namespace shardkit::autograd
