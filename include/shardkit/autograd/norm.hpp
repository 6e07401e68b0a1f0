// Differentiable batch-norm over dim 1 of [N, C, ...] (BatchNorm1d and 2d): training mode with
// batch statistics and running-statistics update, evaluation mode with the running statistics.
// CPU loops accumulate in double. The synchronised form (a group of ranks) runs the function
// table's steps on either device, with double sums; on the GPU training mode runs the same steps
// for a group of one (kernels/autograd/autograd_kernels.cuh), and evaluation mode the same affine
// map with the running statistics (statistics f32 for half data).
// Batch-norm always computes in f32 for f16/bf16 inputs (apex O1 and VISSL keep it so): the
// running statistics must be f32, and f16/bf16 weight and bias (a mixed-precision compute
// copy) are widened to f32 for the computation -- their gradients come back in f32 and are
// rounded where they are accumulated.
// A channels-last input (core/channels_last.hpp) is normalised as it is, as rows of channels
// ([N*H*W, C, 1]), and its output and input gradient are channels-last too.
#pragma once

#include <memory>
#include <vector>

#include "shardkit/autograd/basic.hpp"
#include "shardkit/autograd/batch_stats_group.hpp"
#include "shardkit/autograd/channel_blocks.hpp"
#include "shardkit/autograd/cpu_widen.hpp"

namespace shardkit::autograd {

struct BatchNormOptions {
  bool training = true;
  double momentum = 0.1;  // PyTorch's: running = (1 - momentum) running + momentum batch
  double eps = 1e-5;
  // Off while checkpointing recomputes a segment: the statistics were folded in already.
  bool update_running_stats = true;
  // A ReLU fused after the normalisation: y = max(batch_norm(x), 0), the same values and
  // gradients as batch_norm followed by relu. On the CPU it saves a pass over the activation
  // each way (the ReLU is applied as y is written; its mask is applied as the backward reads
  // the gradient); on the GPU the forward applies it as y is written and the backward masks the
  // gradient in a pass of its own first.
  bool relu = false;
  // Training mode with a group of more than one rank: the statistics are those of the group's
  // whole batch (SyncBatchNorm; parallel/sync_batch_norm.hpp). Forward gathers every member's
  // per-channel count, mean and squared deviations and combines them in rank order (Chan et
  // al.'s pairwise update, exact and the same bits on every member); backward sums the two
  // per-channel gradient sums over the group. As in PyTorch and apex, weight and bias get this
  // rank's gradient only: data parallelism averages them as it averages every other gradient.
  std::shared_ptr<BatchStatsGroup> sync;
  // Read a 5-D input [N, C/b, H, W, b] as channel blocks (core/channel_blocks.hpp), as a
  // convolution with Conv2dOptions::channel_blocks writes them; the output and the input
  // gradient are in them too. The CPU's training and evaluation loops run in the blocks, with
  // the sums of [N, C, H, W] in the same order (cpu_norm_pool.hpp); the synchronised form and
  // evaluation mode's backward run on an [N, C, H, W] copy.
  bool channel_blocks = false;
};

namespace detail {

struct BatchNormShape {
  std::int64_t outer, channels, inner;
};

// Runs body(tensors...) in the kernels' compute dtype: on the CPU with f16/bf16 tensors widened
// to f32 (cpu::in_f32); the CUDA kernels take half types as they are.
template <class Body, class... Ts>
void in_compute_dtype(Context& ctx, const Tensor& on, Body&& body, const Ts&... tensors) {
  if (on.device().is_cpu()) return cpu::in_f32(ctx, body, tensors...);
  body(tensors...);
}

struct BatchNormNode final : Node {
  Tensor x, weight, mean, invstd_or_var;  // training: saved mean/invstd; eval: running mean/var
  Tensor relu_out;                        // the output, when a ReLU is fused (its mask)
  BatchNormShape s{};
  bool training = true;
  double eps = 1e-5;
  std::shared_ptr<BatchStatsGroup> sync;  // set when the statistics were the group's
  Tensor group_count;                     // then its values per channel (f64 [1], on the device)
  const char* name() const override { return "batch_norm"; }

  Gradients apply(Context& ctx, const Tensor& gy) override {
    Tensor g = dense_as(ctx, gy, x);
    // The CPU's training-mode loops apply a fused ReLU's mask as they read g; elsewhere it is a
    // pass of its own first.
    const bool mask_in_loops = training && g.device().is_cpu();
    if (relu_out.defined() && !mask_in_loops)
      g = fn::pointwise(ctx, Pointwise::relu_backward, g, relu_out, 1, 0);
    const DType stat = weight.dtype();
    Tensor gx = edges[0].valid() ? empty_dense_like(ctx, g, g.shape(), g.dtype()) : Tensor();
    // Parameter gradients count as gradients, not activations, while they wait to be accumulated.
    Tensor gw = fn::new_like(ctx, g, {s.channels}, stat, MemoryCategory::gradients);
    Tensor gb = fn::new_like(ctx, g, {s.channels}, stat, MemoryCategory::gradients);
    if (training && sync) {
      // (on the GPU, g was masked above)
      in_compute_dtype(
          ctx, g,
          [&](const Tensor& a, const Tensor& b, const Tensor& d, const Tensor& r) {
            synced_backward(ctx, a, b, d, gw, gb, r);
          },
          x, g, gx, mask_in_loops ? relu_out : Tensor());
    } else if (training) {
      kernels_for(ctx, g).batch_norm_train_backward(ctx, x, g, weight, mean, invstd_or_var, eps, gx,
                                                    gw, gb, s.outer, s.channels, s.inner,
                                                    mask_in_loops ? relu_out : Tensor());
    } else {
      const auto& k = kernels_for(ctx, g);
      Tensor g_xhat = empty_dense_like(ctx, g, g.shape(), g.dtype());
      k.batch_norm_eval_backward(ctx, x, g, weight, mean, invstd_or_var, eps, gx, g_xhat, s.outer,
                                 s.channels, s.inner);
      k.channel_sum(ctx, g_xhat, gw, s.outer, s.channels, s.inner);
      k.channel_sum(ctx, g, gb, s.outer, s.channels, s.inner);
    }
    return {edges[0].valid() ? gx : Tensor(), gw, gb};
  }
  void release_saved() override {
    x = weight = mean = invstd_or_var = relu_out = group_count = Tensor();
  }

 private:
  // The input gradient needs the group's sums of g and g * xhat; weight and bias keep this
  // rank's.
  void synced_backward(Context& ctx, const Tensor& x_c, const Tensor& g, const Tensor& gx,
                       const Tensor& gw, const Tensor& gb, const Tensor& relu_y) {
    const auto& k = kernels_for(ctx, g);
    const std::int64_t C = s.channels;
    Tensor sums = empty_on(ctx, g.device(), {2 * C}, DType::f64);
    k.batch_norm_grad_sums(ctx, x_c, g, mean, invstd_or_var, relu_y, sums, s.outer, C, s.inner);
    copy(ctx, gb, sums.slice(0, 0, C));
    copy(ctx, gw, sums.slice(0, C, 2 * C));
    sync->all_reduce_sum(ctx, sums);  // every member calls this, gx wanted or not
    if (!gx.defined()) return;
    k.batch_norm_input_grad(ctx, x_c, g, weight, mean, invstd_or_var, relu_y, sums, group_count, gx,
                            s.outer, C, s.inner);
  }
};

}  // namespace detail

// running_mean / running_var: buffers updated in place in training mode (may be undefined in
// training mode: then nothing is tracked). Statistics tensors (weight, bias, running) must have
// the accumulator dtype: x's own for f32/f64, f32 for f16/bf16.
inline Variable batch_norm(Context& ctx, const Variable& x, const Variable& weight,
                           const Variable& bias, const Tensor& running_mean,
                           const Tensor& running_var, BatchNormOptions o = {}) {
  check(x.defined() && weight.defined() && bias.defined(),
        "batch_norm: input, weight or bias undefined", module_suffix(ctx));
  check(x.dim() >= 2, "batch_norm: input ", shape_text(x.shape()), " needs at least [N, C]",
        module_suffix(ctx));
  const bool blocked = o.channel_blocks && has_channel_block_form(x.data());
  if (blocked && (!x.device().is_cpu() || (o.training && o.sync && o.sync->size() > 1) ||
                  (!o.training && needs_grad(ctx, {&x, &weight, &bias})))) {
    BatchNormOptions nchw = o;
    nchw.channel_blocks = false;
    return to_channel_blocks(
        ctx,
        batch_norm(ctx, from_channel_blocks(ctx, x), weight, bias, running_mean, running_var, nchw),
        x.size(4));
  }
  const std::int64_t channels = blocked ? x.size(1) * x.size(4) : x.size(1);
  check(weight.shape() == Shape{channels} && bias.shape() == Shape{channels}, "batch_norm: input ",
        shape_text(x.shape()), " has ", channels, " channels but weight is ",
        shape_text(weight.shape()), " and bias ", shape_text(bias.shape()), module_suffix(ctx),
        "; check num_features");
  const DType stat = accumulator_dtype(x.dtype());
  check((weight.dtype() == stat || weight.dtype() == x.dtype()) && bias.dtype() == weight.dtype(),
        "batch_norm: weight/bias are ", dtype_name(weight.dtype()), "/", dtype_name(bias.dtype()),
        " but a ", dtype_name(x.dtype()), " input needs ", dtype_name(stat), " (or ",
        dtype_name(x.dtype()), ") ones", module_suffix(ctx), "; cast them");
  const bool track = running_mean.defined();
  if (track || !o.training)
    check(running_mean.defined() && running_var.defined() &&
              running_mean.shape() == Shape{channels} && running_var.shape() == Shape{channels} &&
              running_mean.dtype() == stat && running_var.dtype() == stat,
          "batch_norm: running statistics must be two ", dtype_name(stat), " tensors of shape [",
          channels, "]", module_suffix(ctx));
  // (the kernels index the parameters and statistics as dense [C] rows on x's device: a strided
  // view's update landed on its neighbours, another device's pointers were read as this one's)
  check(weight.device() == x.device() && bias.device() == x.device() &&
            (!running_mean.defined() ||
             (running_mean.device() == x.device() && running_var.device() == x.device() &&
              running_mean.is_contiguous() && running_var.is_contiguous())),
        "batch_norm: weight, bias and running statistics must be dense tensors on the input's "
        "device",
        module_suffix(ctx), "; move them there (or pass contiguous statistics)");
  Tensor xd = dense(ctx, x.data());
  // (channel blocks: [N, C, H * W], the kernels read the blocks' order from x's shape)
  detail::BatchNormShape s{x.size(0), channels,
                           x.numel() / std::max<std::int64_t>(1, x.size(0) * channels)};
  if (keeps_channels_last(xd)) s = {s.outer * s.inner, channels, 1};  // rows of channels
  const bool synced = o.training && o.sync && o.sync->size() > 1;
  // (A group's member may hold one value per channel, or none: the group's batch is what the
  // statistics come from. A refusal here, on one member, would leave the others in the exchange;
  // a group of at most one value keeps its running statistics: batch_norm_stats.hpp.)
  if (o.training && !synced)
    check(s.outer * s.inner > 1,
          "batch_norm: training needs more than one value per channel, got input ",
          shape_text(x.shape()), module_suffix(ctx), "; use a batch larger than 1 or eval()");
  check(o.eps >= 0, "batch_norm: eps ", o.eps, " must be >= 0", module_suffix(ctx),
        " (it is added to the variance; PyTorch's default is 1e-5)");

  // (f16/bf16 weight and bias are widened: the statistics and the affine map are f32.)
  Tensor wd =
      weight.dtype() == stat ? contiguous(ctx, weight.data()) : cast(ctx, weight.data(), stat);
  Tensor bd = bias.dtype() == stat ? contiguous(ctx, bias.data()) : cast(ctx, bias.data(), stat);
  Tensor y = empty_dense_like(ctx, xd, xd.shape(), xd.dtype());
  Tensor saved_a, saved_b;
  Tensor group_count;
  if (synced) {
    // The group's statistics: each member's moments gathered, folded in rank order on every
    // member (the same bits everywhere), then this rank's batch normalised with them.
    saved_a = fn::new_like(ctx, xd, {channels}, stat);
    saved_b = fn::new_like(ctx, xd, {channels}, stat);
    const Tensor rm = o.update_running_stats && track ? running_mean : Tensor();
    const Tensor rv = o.update_running_stats && track ? running_var : Tensor();
    const auto& k = kernels_for(ctx, xd);
    detail::in_compute_dtype(
        ctx, xd,
        [&](const Tensor& a, const Tensor& b) {
          Tensor local = fn::new_like(ctx, xd, {1 + 2 * channels}, DType::f64);
          k.batch_norm_moments(ctx, a, local, s.outer, channels, s.inner);
          const Tensor all = o.sync->all_gather(ctx, local);
          Tensor stats = fn::new_like(ctx, xd, {2 * channels}, DType::f64);
          group_count = fn::new_like(ctx, xd, {1}, DType::f64);
          k.batch_norm_group_stats(ctx, all, o.sync->size(), channels, o.momentum, o.eps, rm, rv,
                                   stats, saved_a, saved_b, group_count);
          k.batch_norm_apply(ctx, a, wd, bd, stats, b, s.outer, channels, s.inner, o.relu);
        },
        xd, y);
  } else if (o.training) {
    saved_a = fn::new_like(ctx, xd, {channels}, stat);
    saved_b = fn::new_like(ctx, xd, {channels}, stat);
    const Tensor rm = o.update_running_stats && track ? running_mean : Tensor();
    const Tensor rv = o.update_running_stats && track ? running_var : Tensor();
    kernels_for(ctx, xd).batch_norm_train_forward(ctx, xd, wd, bd, rm, rv, o.momentum, o.eps, y,
                                                  saved_a, saved_b, s.outer, s.channels, s.inner,
                                                  o.relu);
  } else {
    kernels_for(ctx, xd).batch_norm_eval_forward(ctx, xd, wd, bd, running_mean, running_var, o.eps,
                                                 y, s.outer, s.channels, s.inner, o.relu);
  }
  if (!needs_grad(ctx, {&x, &weight, &bias})) return Variable(std::move(y));
  auto node = make_pooled<detail::BatchNormNode>();
  node->x = xd;
  if (o.relu) node->relu_out = y;
  node->weight = wd;
  node->s = s;
  node->training = o.training;
  node->eps = o.eps;
  if (synced) {
    node->sync = o.sync;
    node->group_count = group_count;
  }
  if (o.training) {
    node->mean = saved_a;
    node->invstd_or_var = saved_b;
  } else {  // the buffers may change before backward runs: keep today's values
    node->mean = clone(ctx, running_mean);
    node->invstd_or_var = clone(ctx, running_var);
  }
  return record(ctx, node, {&x, &weight, &bias}, std::move(y));
}

}  // namespace shardkit::autograd
