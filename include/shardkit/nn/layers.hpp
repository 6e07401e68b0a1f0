// The basic layers: Linear, Conv2d, BatchNorm (1d/2d), ReLU, Sigmoid, SiLU, Dropout, MaxPool2d,
// AdaptiveAvgPool2d, Flatten. Parameters live on the context's device in the given dtype;
// batch-norm keeps its parameters and running statistics in f32 for f16/bf16 models (cuDNN's rule).
#pragma once

#include "shardkit/nn/init.hpp"
#include "shardkit/nn/module.hpp"

namespace shardkit::nn {

class Linear : public Module {
 public:
  Linear(Context& ctx, std::int64_t in_features, std::int64_t out_features, bool bias = true,
         DType dtype = DType::f32) {
    check(in_features > 0 && out_features > 0, "Linear(", in_features, ", ", out_features,
          "): feature counts must be positive");
    weight = register_parameter(
        "weight", empty(ctx, {out_features, in_features}, dtype, MemoryCategory::parameters));
    init::default_weight_(ctx, weight.data());
    if (bias) {
      this->bias =
          register_parameter("bias", empty(ctx, {out_features}, dtype, MemoryCategory::parameters));
      init::default_bias_(ctx, this->bias.data(), weight.data());
    }
  }
  const char* type_name() const override { return "Linear"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return autograd::linear(ctx, x, weight, bias);
  }
  Variable weight, bias;
};

class Conv2d : public Module {
 public:
  // groups > 1: a grouped convolution (ConvGeometry), weight [out, in / groups, k, k].
  Conv2d(Context& ctx, std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel,
         std::int64_t stride = 1, std::int64_t padding = 0, bool bias = true,
         DType dtype = DType::f32, std::int64_t groups = 1)
      : options(autograd::Conv2dOptions::make(stride, padding, 1, groups)) {
    check(in_channels > 0 && out_channels > 0 && kernel > 0, "Conv2d(", in_channels, ", ",
          out_channels, ", kernel ", kernel, "): sizes must be positive");
    check(groups > 0 && in_channels % groups == 0 && out_channels % groups == 0, "Conv2d(",
          in_channels, ", ", out_channels, ", groups ", groups,
          "): groups must divide both channel counts");
    weight = register_parameter(
        "weight", empty(ctx, {out_channels, in_channels / groups, kernel, kernel}, dtype,
                        MemoryCategory::parameters));
    init::default_weight_(ctx, weight.data());
    if (bias) {
      this->bias =
          register_parameter("bias", empty(ctx, {out_channels}, dtype, MemoryCategory::parameters));
      init::default_bias_(ctx, this->bias.data(), weight.data());
    }
  }
  const char* type_name() const override { return "Conv2d"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return autograd::conv2d(ctx, x, weight, bias, options);
  }
  autograd::Conv2dOptions options;
  Variable weight, bias;
};

class BatchNorm : public Module {
 public:
  // dims 1 (BatchNorm1d: [N, C] or [N, C, L]) or 2 (BatchNorm2d: [N, C, H, W]).
  // force_f32: run f16/bf16 activations through an f32 batch-norm (cast in and out).
  BatchNorm(Context& ctx, std::int64_t num_features, int dims = 2, DType dtype = DType::f32,
            double eps = 1e-5, double momentum = 0.1, bool force_f32 = false)
      : dims_(dims), force_f32_(force_f32) {
    check(num_features > 0 && (dims == 1 || dims == 2), "BatchNorm: num_features ", num_features,
          " must be positive and dims ", dims, " 1 or 2");
    options.eps = eps;
    options.momentum = momentum;
    const DType stat = autograd::accumulator_dtype(dtype);
    weight = register_parameter("weight",
                                full(ctx, {num_features}, stat, 1.0, MemoryCategory::parameters));
    bias = register_parameter("bias",
                              full(ctx, {num_features}, stat, 0.0, MemoryCategory::parameters));
    running_mean = register_buffer("running_mean",
                                   zeros(ctx, {num_features}, stat, MemoryCategory::parameters));
    running_var = register_buffer("running_var",
                                  full(ctx, {num_features}, stat, 1.0, MemoryCategory::parameters));
    num_batches_tracked = register_buffer("num_batches_tracked",
                                          zeros(ctx, {}, DType::i64, MemoryCategory::parameters));
    one_ = full(ctx, {}, DType::i64, 1.0);
  }
  const char* type_name() const override { return dims_ == 1 ? "BatchNorm1d" : "BatchNorm2d"; }

  Variable forward(Context& ctx, const Variable& input) override {
    const std::int64_t expected = dims_ == 1 ? 2 : 4;
    const bool blocked =  // ([N, C/b, H, W, b]: core/channel_blocks.hpp)
        dims_ == 2 && options.channel_blocks && has_channel_block_form(input.data());
    check(
        input.defined() && (input.dim() == expected || (dims_ == 1 && input.dim() == 3) || blocked),
        type_name(), ": input ",
        input.defined() ? shape_text(input.shape()) : ShapeText::undefined(), " has the wrong rank",
        autograd::module_suffix(ctx), "; expected ",
        dims_ == 1 ? "[N, C] or [N, C, L]" : "[N, C, H, W]");
    autograd::BatchNormOptions o = options;
    o.training = is_training();
    // Checkpoint recomputation must not fold the same batch into the statistics twice.
    o.update_running_stats = !autograd::tape(ctx).recomputing();
    Variable x = input;
    const bool upcast = force_f32_ && x.dtype() != DType::f32;
    if (upcast) x = autograd::cast(ctx, x, DType::f32);
    // An upcast batch-norm applies a fused ReLU after the cast back, as the separate ReLU did:
    // its mask is then the rounded output's, and no f32 copy is kept for it.
    if (upcast) o.relu = false;
    Variable y = autograd::batch_norm(ctx, x, weight, bias, running_mean, running_var, o);
    if (o.training && o.update_running_stats) bump_batches(ctx);
    if (!upcast) return y;
    y = autograd::cast(ctx, y, input.dtype());
    return options.relu ? autograd::relu(ctx, y) : y;
  }

  autograd::BatchNormOptions options;
  Variable weight, bias;
  Tensor running_mean, running_var, num_batches_tracked;

 private:
  // num_batches_tracked += 1 where the counter lies, as PyTorch's add_(1): on a GPU the host
  // neither reads nor uploads it, so a training step does not wait for the device here.
  void bump_batches(Context& ctx) {
    if (one_.device() != num_batches_tracked.device()) one_ = full(ctx, {}, DType::i64, 1.0);
    add_(ctx, num_batches_tracked, one_);
  }
  Tensor one_;  // the increment, on the counter's device
  int dims_;
  bool force_f32_;
};

class ReLU : public Module {
 public:
  const char* type_name() const override { return "ReLU"; }
  Variable forward(Context& ctx, const Variable& x) override { return autograd::relu(ctx, x); }
};

class Sigmoid : public Module {
 public:
  const char* type_name() const override { return "Sigmoid"; }
  Variable forward(Context& ctx, const Variable& x) override { return autograd::sigmoid(ctx, x); }
};

class SiLU : public Module {
 public:
  const char* type_name() const override { return "SiLU"; }
  Variable forward(Context& ctx, const Variable& x) override { return autograd::silu(ctx, x); }
};

// nn.Dropout: while training, each element zeroed with probability p and the rest scaled by
// 1 / (1 - p) (autograd/dropout.hpp); evaluation passes x through.
class Dropout : public Module {
 public:
  explicit Dropout(double p) : p_(p) {
    check(p >= 0 && p < 1, "Dropout(", p, "): the probability must be in [0, 1), e.g. 0.2");
  }
  const char* type_name() const override { return "Dropout"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return is_training() ? autograd::dropout(ctx, x, p_) : x;
  }
  double p() const { return p_; }

 private:
  double p_;
};

class MaxPool2d : public Module {
 public:
  MaxPool2d(std::int64_t kernel, std::int64_t stride, std::int64_t padding = 0)
      : kernel_(kernel), stride_(stride), padding_(padding) {}
  const char* type_name() const override { return "MaxPool2d"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return autograd::max_pool2d(ctx, x, kernel_, stride_, padding_, channel_blocks);
  }
  // Pool an input held in channel blocks as it is (autograd::max_pool2d).
  bool channel_blocks = false;

 private:
  std::int64_t kernel_, stride_, padding_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(std::int64_t out_h, std::int64_t out_w) : out_h_(out_h), out_w_(out_w) {}
  const char* type_name() const override { return "AdaptiveAvgPool2d"; }
  Variable forward(Context& ctx, const Variable& x) override {
    return autograd::adaptive_avg_pool2d(ctx, x, out_h_, out_w_);
  }

 private:
  std::int64_t out_h_, out_w_;
};

class Flatten : public Module {
 public:
  const char* type_name() const override { return "Flatten"; }
  Variable forward(Context& ctx, const Variable& x) override { return autograd::flatten(ctx, x); }
};

}  // namespace shardkit::nn
