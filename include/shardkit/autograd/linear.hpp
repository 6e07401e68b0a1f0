// Differentiable matrix products: linear (x W^T + b) and matmul, on Eigen or cuBLAS.
#pragma once

#include "shardkit/autograd/basic.hpp"

namespace shardkit::autograd {

namespace detail {

struct LinearNode final : Node {
  Tensor x, weight;
  bool has_bias = false;
  const char* name() const override { return "linear"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = contiguous(ctx, gy);
    Gradients grads(edges.size());
    if (edges[0].valid()) {  // grad_x = g W ([N, in]; x itself is kept only for grad_W)
      grads[0] = fn::new_like(ctx, g, {g.size(0), weight.size(1)}, weight.dtype());
      fn::gemm(ctx, g, false, weight, false, grads[0]);
    }
    if (edges[1].valid()) {  // grad_W = g^T x
      grads[1] = fn::new_like(ctx, g, weight.shape(), weight.dtype(), MemoryCategory::gradients);
      fn::gemm(ctx, g, true, x, false, grads[1]);
    }
    if (has_bias && edges[2].valid()) {  // grad_b = column sums of g
      grads[2] = fn::new_like(ctx, g, {weight.size(0)}, weight.dtype(), MemoryCategory::gradients);
      kernels_for(ctx, g).channel_sum(ctx, g, grads[2], g.size(0), g.size(1), 1);
    }
    return grads;
  }
  void release_saved() override { x = weight = Tensor(); }
};

struct MatmulNode final : Node {
  Tensor a, b;
  const char* name() const override { return "matmul"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = contiguous(ctx, gy);
    Gradients grads(2);
    if (edges[0].valid()) {  // grad_a = g b^T
      grads[0] = fn::new_like(ctx, g, a.shape(), a.dtype());
      fn::gemm(ctx, g, false, b, true, grads[0]);
    }
    if (edges[1].valid()) {  // grad_b = a^T g
      grads[1] = fn::new_like(ctx, g, b.shape(), b.dtype());
      fn::gemm(ctx, a, true, g, false, grads[1]);
    }
    return grads;
  }
  void release_saved() override { a = b = Tensor(); }
};

}  // namespace detail

// y[N, out] = x[N, in] W[out, in]^T + b[out]; `bias` may be undefined.
inline Variable linear(Context& ctx, const Variable& x, const Variable& weight,
                       const Variable& bias = Variable()) {
  check(x.defined() && weight.defined(), "linear: input or weight undefined", module_suffix(ctx));
  check(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear: input ",
        shape_text(x.shape()), " does not match weight ", shape_text(weight.shape()),
        module_suffix(ctx), "; expected input [N, ", weight.dim() == 2 ? weight.size(1) : -1,
        "] (flatten the input, or fix in_features)");
  check(x.dtype() == weight.dtype(), "linear: input dtype ", dtype_name(x.dtype()),
        " differs from weight dtype ", dtype_name(weight.dtype()), module_suffix(ctx));
  const bool has_bias = bias.defined();
  if (has_bias)
    check(bias.shape() == Shape{weight.size(0)} && bias.dtype() == x.dtype(), "linear: bias ",
          shape_text(bias.shape()), " does not match weight ", shape_text(weight.shape()),
          module_suffix(ctx));
  // (the GEMM runs on the input's device and would read another device's pointers as its own)
  check(weight.device() == x.device() && (!has_bias || bias.device() == x.device()),
        "linear: the weight", has_bias ? " and bias" : "", " must be on the input's device",
        module_suffix(ctx), "; move them there");
  Tensor xd = contiguous(ctx, x.data()), wd = contiguous(ctx, weight.data());
  Tensor y = fn::new_like(ctx, xd, {x.size(0), weight.size(0)}, x.dtype());
  double beta = 0;
  if (has_bias) {  // broadcast the bias into y, then let the GEMM add onto it
    const Tensor& b = bias.data();
    copy(ctx, y, Tensor(b.storage(), y.shape(), {0, b.stride(0)}, b.dtype(), b.offset()));
    beta = 1;
  }
  fn::gemm(ctx, xd, false, wd, true, y, 1, beta);
  if (!needs_grad(ctx, {&x, &weight, &bias})) return Variable(std::move(y));
  auto node = make_pooled<detail::LinearNode>();
  if (weight.requires_grad()) node->x = xd;
  node->weight = wd;
  node->has_bias = has_bias;
  if (has_bias) return record(ctx, node, {&x, &weight, &bias}, std::move(y));
  return record(ctx, node, {&x, &weight}, std::move(y));
}

// y[M, N] = a[M, K] b[K, N].
inline Variable matmul(Context& ctx, const Variable& a, const Variable& b) {
  check(a.defined() && b.defined(), "matmul: an input is undefined", module_suffix(ctx));
  check(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "matmul: shapes ",
        shape_text(a.shape()), " and ", shape_text(b.shape()), " cannot be multiplied",
        module_suffix(ctx), "; need [M, K] x [K, N]");
  check(a.dtype() == b.dtype(), "matmul: dtypes ", dtype_name(a.dtype()), " and ",
        dtype_name(b.dtype()), " differ", module_suffix(ctx));
  check(a.device() == b.device(), "matmul: the inputs are on different devices", module_suffix(ctx),
        "; move them to one");
  Tensor ad = contiguous(ctx, a.data()), bd = contiguous(ctx, b.data());
  Tensor y = fn::new_like(ctx, ad, {a.size(0), b.size(1)}, a.dtype());
  fn::gemm(ctx, ad, false, bd, false, y);
  if (!needs_grad(ctx, {&a, &b})) return Variable(std::move(y));
  auto node = make_pooled<detail::MatmulNode>();
  node->a = ad;
  node->b = bd;
  return record(ctx, node, {&a, &b}, std::move(y));
}

}  // namespace shardkit::autograd
