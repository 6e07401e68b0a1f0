// Differentiable row-wise ops over the last dimension: softmax, log-softmax, L2-normalise, and
// cross-entropy with hard (class index) or soft (probability) targets. Sums run in the
// accumulator dtype (f32 for half data).
#pragma once

#include "shardkit/autograd/basic.hpp"

namespace shardkit::autograd {

namespace detail {

struct Rows {
  std::int64_t rows, cols;
};

inline Rows rows_of(Context& ctx, const char* op, const Variable& x) {
  check(x.defined() && x.dim() >= 1 && x.numel() > 0, op, ": needs a non-empty tensor",
        module_suffix(ctx));
  const std::int64_t cols = x.size(-1);
  return {x.numel() / cols, cols};
}

struct SoftmaxNode final : Node {
  Tensor y;
  Rows r{};
  bool log = false;
  const char* name() const override { return log ? "log_softmax" : "softmax"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = contiguous(ctx, gy);
    Tensor gx = fn::new_like(ctx, g);
    kernels_for(ctx, g).softmax_backward(ctx, y, g, gx, r.rows, r.cols, log);
    return {gx};
  }
  void release_saved() override { y = Tensor(); }
};

struct L2NormalizeNode final : Node {
  Tensor y, norms;
  Rows r{};
  double eps = 1e-12;
  const char* name() const override { return "l2_normalize"; }
  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = contiguous(ctx, gy);
    Tensor gx = fn::new_like(ctx, g);
    kernels_for(ctx, g).l2_normalize_backward(ctx, y, norms, g, gx, r.rows, r.cols, eps);
    return {gx};
  }
  void release_saved() override { y = norms = Tensor(); }
};

struct CrossEntropyNode final : Node {
  Tensor log_probs, target;
  Rows r{};
  const char* name() const override { return "cross_entropy"; }
  Gradients apply(Context& ctx, const Tensor& g) override {
    Tensor gx = fn::new_like(ctx, log_probs);
    kernels_for(ctx, log_probs)
        .cross_entropy_backward(ctx, log_probs, target, g, gx, r.rows, r.cols);
    return {gx};
  }
  void release_saved() override { log_probs = target = Tensor(); }
};

inline Variable softmax_impl(Context& ctx, const Variable& x, bool log) {
  const Rows r = rows_of(ctx, log ? "log_softmax" : "softmax", x);
  Tensor xd = contiguous(ctx, x.data());
  Tensor y = fn::new_like(ctx, xd);
  kernels_for(ctx, xd).softmax_forward(ctx, xd, y, r.rows, r.cols, log);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<SoftmaxNode>();
  node->y = y;
  node->r = r;
  node->log = log;
  return record(ctx, node, {&x}, std::move(y));
}

}  // namespace detail

inline Variable softmax(Context& ctx, const Variable& x) {
  return detail::softmax_impl(ctx, x, false);
}
inline Variable log_softmax(Context& ctx, const Variable& x) {
  return detail::softmax_impl(ctx, x, true);
}

// x / max(|x|_2, eps) over the last dimension (torch.nn.functional.normalize(x, dim=-1)).
inline Variable l2_normalize(Context& ctx, const Variable& x, double eps = 1e-12) {
  const detail::Rows r = detail::rows_of(ctx, "l2_normalize", x);
  Tensor xd = contiguous(ctx, x.data());
  Tensor y = fn::new_like(ctx, xd);
  Tensor norms = fn::new_like(ctx, xd, {r.rows}, accumulator_dtype(x.dtype()));
  kernels_for(ctx, xd).l2_normalize_forward(ctx, xd, y, norms, r.rows, r.cols, eps);
  if (!needs_grad(ctx, {&x})) return Variable(std::move(y));
  auto node = make_pooled<detail::L2NormalizeNode>();
  node->y = y;
  node->norms = norms;
  node->r = r;
  node->eps = eps;
  return record(ctx, node, {&x}, std::move(y));
}

// Mean over rows of -sum_c target[c] * log_softmax(logits)[c]. `target` is either class indices
// (i64, shape [N]) or probabilities (logits' dtype and shape [N, C], e.g. SwAV's codes); it gets
// no gradient. The loss is a one-element tensor in the accumulator dtype.
inline Variable cross_entropy(Context& ctx, const Variable& logits, const Tensor& target) {
  check(logits.defined() && logits.dim() == 2, "cross_entropy: logits ",
        logits.defined() ? shape_text(logits.shape()) : ShapeText::undefined(), " are not [N, C]",
        module_suffix(ctx));
  check(target.defined(), "cross_entropy: target undefined", module_suffix(ctx));
  const std::int64_t rows = logits.size(0), cols = logits.size(1);
  // PyTorch answers an empty batch with a NaN mean; a NaN loss poisons a run silently, so we
  // refuse it on every device (and the GPU kernels never see an empty grid).
  check(rows > 0 && cols > 0, "cross_entropy: logits ", shape_text(logits.shape()),
        " hold no rows or no classes, so there is no mean loss", module_suffix(ctx),
        "; skip empty batches (e.g. the last, partial one) before the loss");
  if (target.dtype() == DType::i64) {
    check(target.shape() == Shape{rows}, "cross_entropy: class-index target ",
          shape_text(target.shape()), " does not match logits ", shape_text(logits.shape()),
          module_suffix(ctx), "; expected [", rows, "]");
    if (target.device().is_cpu()) {
      const Tensor t = contiguous(ctx, target);
      const auto* labels = static_cast<const std::int64_t*>(t.data_ptr());
      for (std::int64_t i = 0; i < rows; ++i)
        check(labels[i] >= 0 && labels[i] < cols, "cross_entropy: target class ", labels[i],
              " at row ", i, " is outside [0, ", cols, ")", module_suffix(ctx));
    }
  } else {
    check(target.shape() == logits.shape() && target.dtype() == logits.dtype(),
          "cross_entropy: soft target ", shape_text(target.shape()), " (",
          dtype_name(target.dtype()), ") does not match logits ", shape_text(logits.shape()), " (",
          dtype_name(logits.dtype()), ")", module_suffix(ctx),
          "; pass i64 class indices [N] or probabilities like the logits");
  }
  Tensor xd = contiguous(ctx, logits.data());
  Tensor td = contiguous(ctx, target);
  check(td.device() == xd.device(), "cross_entropy: target on ", td.device(), " but logits on ",
        xd.device(), module_suffix(ctx));
  Tensor log_probs = fn::new_like(ctx, xd);
  Tensor loss = fn::new_like(ctx, xd, {}, accumulator_dtype(xd.dtype()));
  kernels_for(ctx, xd).cross_entropy_forward(ctx, xd, td, log_probs, loss, rows, cols);
  if (!needs_grad(ctx, {&logits})) return Variable(std::move(loss));
  auto node = make_pooled<detail::CrossEntropyNode>();
  node->log_probs = log_probs;
  node->target = td;
  node->r = {rows, cols};
  return record(ctx, node, {&logits}, std::move(loss));
}

}  // namespace shardkit::autograd
