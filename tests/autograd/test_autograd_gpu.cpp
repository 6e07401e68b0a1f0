// CUDA against CPU on the same inputs for every op (f32 <= 1e-4 relative, f16 <= 1e-2), and a
// ResNet-18 training step built from the same seed on both devices. Skipped (77) without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "shardkit/autograd/cuda_libraries.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/shardkit.hpp"
// SwAV's Sinkhorn driver (the sample's, over autograd's sinkhorn_* kernels)
#include "../../samples/swav/sinkhorn.hpp"
#include "max_pool_cases.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
namespace nn = shardkit::nn;
using ag::Variable;

namespace {

using Build = std::function<Variable(sk::Context&, const std::vector<Variable>&)>;

struct Outcome {
  std::vector<float> output;
  std::vector<std::vector<float>> grads;
};

std::vector<float> as_floats(sk::Context& ctx, const sk::Tensor& t) {
  return sk::to_vector<float>(ctx, sk::cast(ctx, sk::contiguous(ctx, t), sk::DType::f32));
}

// Deterministic pseudo-random values in [-1, 1), rounded to `dtype` so both devices see the
// same numbers.
std::vector<float> pattern(std::int64_t n, std::uint32_t salt, sk::DType dtype) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::uint32_t s = 2654435761u * (salt + 1);
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / float(1u << 24) * 2.0f - 1.0f;
    if (dtype == sk::DType::f16) x = sk::Half(x).to_float();
    if (dtype == sk::DType::bf16) x = sk::BFloat16(x).to_float();
  }
  return v;
}

Outcome run(sk::Context& ctx, const std::vector<sk::Shape>& shapes, sk::DType dtype,
            const Build& build) {
  std::vector<Variable> inputs;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto host = pattern(sk::shape_numel(shapes[i]), static_cast<std::uint32_t>(i), dtype);
    sk::Tensor t = sk::cast(ctx, sk::from_vector(ctx, host, shapes[i]), dtype);
    inputs.emplace_back(t, true);
  }
  Variable out = build(ctx, inputs);
  auto g = pattern(out.numel(), 99, out.dtype());
  ag::backward(ctx, out, sk::cast(ctx, sk::from_vector(ctx, g, out.shape()), out.dtype()));
  Outcome o;
  o.output = as_floats(ctx, out.data());
  for (auto& in : inputs)
    o.grads.push_back(in.grad().defined() ? as_floats(ctx, in.grad()) : std::vector<float>{});
  return o;
}

double relative_error(const std::vector<float>& reference, const std::vector<float>& value) {
  REQUIRE(reference.size() == value.size());
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    diff += (double(reference[i]) - value[i]) * (double(reference[i]) - value[i]);
    norm += double(reference[i]) * reference[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

}  // namespace

namespace {

// Full comparison with gradients: both sides in f32 or the GPU in f16 against a CPU f32 run on
// the same rounded inputs.
void compare_with_grads(const char* name, const std::vector<sk::Shape>& shapes, const Build& build,
                        double f32_tolerance = 1e-4) {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f16}) {
    CAPTURE(name);
    CAPTURE(sk::dtype_name(dtype));
    const double tolerance = dtype == sk::DType::f32 ? f32_tolerance : 1e-2;
    // pattern() already rounds to dtype, so the CPU f32 run below sees the GPU's values.
    std::vector<Variable> cpu_inputs;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      cpu_inputs.emplace_back(
          sk::from_vector(cpu,
                          pattern(sk::shape_numel(shapes[i]), static_cast<std::uint32_t>(i), dtype),
                          shapes[i]),
          true);
    Variable cpu_out = build(cpu, cpu_inputs);
    auto g = pattern(cpu_out.numel(), 99, dtype);
    ag::backward(cpu, cpu_out, sk::from_vector(cpu, g, cpu_out.shape()));
    const Outcome device = run(*gpu, shapes, dtype, build);
    CHECK(relative_error(as_floats(cpu, cpu_out.data()), device.output) <= tolerance);
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      CAPTURE(i);
      REQUIRE(cpu_inputs[i].grad().defined() == !device.grads[i].empty());
      if (device.grads[i].empty()) continue;
      CHECK(relative_error(as_floats(cpu, cpu_inputs[i].grad()), device.grads[i]) <= tolerance);
    }
  }
}

// Batch-norm statistics are f32 for half inputs: cast weight and bias inside the op. `relu`:
// with the ReLU fused into it (applied as y is written, on both devices).
Variable bn(sk::Context& c, const std::vector<Variable>& v, bool training, bool relu = false) {
  const sk::DType stat = ag::accumulator_dtype(v[0].dtype());
  const std::int64_t channels = v[0].size(1);
  ag::BatchNormOptions o;
  o.training = training;
  o.relu = relu;
  sk::Tensor mean = sk::full(c, {channels}, stat, 0.1), var = sk::full(c, {channels}, stat, 1.5);
  return ag::batch_norm(c, v[0], ag::cast(c, v[1], stat), ag::cast(c, v[2], stat), mean, var, o);
}

}  // namespace

TEST_CASE("CUDA ops and their gradients match the CPU (f32 1e-4, f16 1e-2)") {
  compare_with_grads("add", {{3, 7}, {3, 7}},
                     [](sk::Context& c, const auto& v) { return ag::add(c, v[0], v[1]); });
  compare_with_grads("mul", {{3, 7}, {3, 7}},
                     [](sk::Context& c, const auto& v) { return ag::mul(c, v[0], v[1]); });
  compare_with_grads("relu", {{5, 300}},
                     [](sk::Context& c, const auto& v) { return ag::relu(c, v[0]); });
  compare_with_grads("add_relu", {{5, 300}, {5, 300}},
                     [](sk::Context& c, const auto& v) { return ag::add_relu(c, v[0], v[1]); });
  compare_with_grads("sigmoid", {{5, 300}},
                     [](sk::Context& c, const auto& v) { return ag::sigmoid(c, v[0]); });
  compare_with_grads("silu", {{5, 300}},
                     [](sk::Context& c, const auto& v) { return ag::silu(c, v[0]); });
  // Squeeze-and-excitation's gate: 7 x 7 planes, and 1 x 1 ones.
  compare_with_grads(
      "channel_scale", {{3, 10, 7, 7}, {3, 10, 1, 1}},
      [](sk::Context& c, const auto& v) { return ag::channel_scale(c, v[0], v[1]); });
  compare_with_grads(
      "channel_scale 1x1", {{4, 6, 1, 1}, {4, 6, 1, 1}},
      [](sk::Context& c, const auto& v) { return ag::channel_scale(c, v[0], v[1]); });
  compare_with_grads("linear", {{8, 32}, {16, 32}, {16}},
                     [](sk::Context& c, const auto& v) { return ag::linear(c, v[0], v[1], v[2]); });
  compare_with_grads("matmul", {{8, 32}, {32, 12}},
                     [](sk::Context& c, const auto& v) { return ag::matmul(c, v[0], v[1]); });
  compare_with_grads("conv3x3", {{2, 8, 9, 9}, {16, 8, 3, 3}}, [](sk::Context& c, const auto& v) {
    return ag::conv2d(c, v[0], v[1], Variable(), ag::Conv2dOptions::make(1, 1));
  });
  compare_with_grads("conv7x7 s2", {{2, 3, 20, 20}, {8, 3, 7, 7}, {8}},
                     [](sk::Context& c, const auto& v) {
                       return ag::conv2d(c, v[0], v[1], v[2], ag::Conv2dOptions::make(2, 3));
                     });
  compare_with_grads("conv1x1 s2", {{2, 16, 8, 8}, {32, 16, 1, 1}},
                     [](sk::Context& c, const auto& v) {
                       return ag::conv2d(c, v[0], v[1], Variable(), ag::Conv2dOptions::make(2, 0));
                     });
  // Grouped (cuDNN's group count): ResNeXt's 3 x 3 of 4 groups, strided, and a depthwise one.
  compare_with_grads(
      "conv3x3 4 groups s2", {{2, 16, 9, 9}, {16, 4, 3, 3}}, [](sk::Context& c, const auto& v) {
        return ag::conv2d(c, v[0], v[1], Variable(), ag::Conv2dOptions::make(2, 1, 1, 4));
      });
  compare_with_grads(
      "conv3x3 depthwise", {{2, 8, 9, 9}, {8, 1, 3, 3}}, [](sk::Context& c, const auto& v) {
        return ag::conv2d(c, v[0], v[1], Variable(), ag::Conv2dOptions::make(1, 1, 1, 8));
      });
  compare_with_grads("batch_norm train 2d", {{4, 6, 5, 5}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true); });
  compare_with_grads("batch_norm train 1d", {{16, 6}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true); });
  // The parts' form beyond one part a channel: two segments of a row of 4608 (runs of 4, a
  // float4 each in f32), two of a row of 4097 (2052 + 2045, runs of 1), 40 parts of whole rows
  // (lanes of the fold taking two parts), an odd channel count with a short last part.
  for (const sk::Shape& shape :
       std::vector<sk::Shape>{{2, 3, 72, 64}, {3, 2, 4097}, {40, 2, 64, 64}, {70, 5, 8, 8}}) {
    const sk::Shape c{shape[1]};
    compare_with_grads("batch_norm train, several parts", {shape, c, c},
                       [](sk::Context& ctx, const auto& v) { return bn(ctx, v, true); });
    compare_with_grads("batch_norm+relu train, several parts", {shape, c, c},
                       [](sk::Context& ctx, const auto& v) { return bn(ctx, v, true, true); });
  }
  compare_with_grads("batch_norm eval", {{4, 6, 5, 5}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, false); });
  compare_with_grads("batch_norm+relu train 2d", {{4, 6, 5, 5}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true, true); });
  compare_with_grads("batch_norm+relu train 1d", {{16, 6}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true, true); });
  compare_with_grads("batch_norm+relu eval", {{4, 6, 5, 5}, {6}, {6}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, false, true); });
  compare_with_grads("max_pool", {{2, 4, 11, 11}}, [](sk::Context& c, const auto& v) {
    return ag::max_pool2d(c, v[0], 3, 2, 1);
  });
  compare_with_grads("adaptive_avg_pool 1x1", {{2, 4, 7, 7}}, [](sk::Context& c, const auto& v) {
    return ag::adaptive_avg_pool2d(c, v[0], 1, 1);
  });
  compare_with_grads("adaptive_avg_pool 3x2", {{2, 4, 7, 5}}, [](sk::Context& c, const auto& v) {
    return ag::adaptive_avg_pool2d(c, v[0], 3, 2);
  });
  compare_with_grads("softmax", {{6, 1000}},
                     [](sk::Context& c, const auto& v) { return ag::softmax(c, v[0]); });
  compare_with_grads("log_softmax", {{6, 1000}},
                     [](sk::Context& c, const auto& v) { return ag::log_softmax(c, v[0]); });
  compare_with_grads("l2_normalize", {{6, 128}},
                     [](sk::Context& c, const auto& v) { return ag::l2_normalize(c, v[0]); });
  compare_with_grads("cross_entropy hard", {{6, 10}}, [](sk::Context& c, const auto& v) {
    return ag::cross_entropy(c, v[0], sk::from_vector<std::int64_t>(c, {0, 9, 3, 3, 5, 1}, {6}));
  });
  compare_with_grads("cross_entropy soft", {{6, 10}, {6, 10}}, [](sk::Context& c, const auto& v) {
    sk::Tensor target = ag::softmax(c, v[1].detach()).data();
    return ag::cross_entropy(c, v[0], target);
  });
}

namespace {

// A 3x3 convolution whose output is channels-last (Conv2dOptions::channels_last), checked to be
// kept so on the GPU (in both dtypes) and on the CPU in f32: what the ops after it then read.
Variable conv_cl(sk::Context& c, const Variable& x, const Variable& w) {
  ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1);
  o.channels_last = true;
  Variable y = ag::conv2d(c, x, w, Variable(), o);
  if (c.device().is_cuda() || y.dtype() == sk::DType::f32) CHECK(sk::keeps_channels_last(y.data()));
  return y;
}

}  // namespace

// Channels-last activations on the GPU: cuDNN's NHWC convolutions (the weight copied to KRSC,
// its gradient back), batch-norm's rows of channels (tiles of 32 channels, the last one short
// here: 40 channels; parts of 64 rows, the last one short: 324 rows), max-pooling in NHWC, and
// the element-wise maps' runs of 4 channels -- against the CPU.
// Both devices sum the squares in double and keep a NaN norm NaN (std::max(norm, eps), as
// PyTorch's clamp_min): the GPU used to divide a NaN row by eps, and to overflow an f32 sum of
// squares of 1e20s into an inf norm and a row of zeros.
TEST_CASE(
    "l2_normalize on the GPU: a row with a NaN is NaN, a row of 1e20s normalises, as on "
    "the CPU") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  std::vector<float> rows(3 * 64);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = float(i % 7) - 2.5f;
  rows[5] = NAN;                                            // row 0
  for (std::size_t i = 64; i < 128; ++i) rows[i] *= 1e20f;  // row 1: f32 squares overflow
  const sk::Tensor x = sk::from_vector(cpu, rows, {3, 64});
  const auto on_cpu = sk::to_vector<float>(cpu, ag::l2_normalize(cpu, Variable(x)).data());
  const sk::Tensor y =
      ag::l2_normalize(*gpu, Variable(sk::to_device(*gpu, x, gpu->device()))).data();
  const auto on_gpu = sk::to_vector<float>(cpu, sk::to_device(*gpu, y, sk::Device::cpu()));
  for (std::size_t i = 0; i < 64; ++i) {
    CHECK(std::isnan(on_cpu[i]));
    CHECK(std::isnan(on_gpu[i]));
  }
  for (std::size_t i = 64; i < rows.size(); ++i) {
    CAPTURE(i);
    CHECK(on_cpu[i] != 0.0f);
    CHECK(on_gpu[i] == doctest::Approx(on_cpu[i]).epsilon(1e-6));
  }
}

TEST_CASE("channels-last on the GPU: convolution, batch-norm and max-pool match the CPU") {
  const std::vector<sk::Shape> conv_shapes = {{4, 8, 9, 9}, {40, 8, 3, 3}};
  compare_with_grads("conv3x3 channels-last", conv_shapes,
                     [](sk::Context& c, const auto& v) { return conv_cl(c, v[0], v[1]); });
  compare_with_grads("conv3x3 8 groups channels-last", {{4, 32, 9, 9}, {32, 4, 3, 3}},
                     [](sk::Context& c, const auto& v) {
                       ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1, 1, 8);
                       o.channels_last = true;
                       return ag::conv2d(c, v[0], v[1], Variable(), o);
                     });
  compare_with_grads(
      "conv then conv1x1, channels-last", {{4, 8, 9, 9}, {40, 8, 3, 3}, {24, 40, 1, 1}},
      [](sk::Context& c, const auto& v) {
        Variable y =
            ag::conv2d(c, conv_cl(c, v[0], v[1]), v[2], Variable(), ag::Conv2dOptions::make(2, 0));
        if (c.device().is_cuda()) CHECK(sk::keeps_channels_last(y.data()));
        return y;
      });
  for (const bool relu : {false, true}) {
    CAPTURE(relu);
    compare_with_grads("batch_norm train channels-last", {{4, 8, 9, 9}, {40, 8, 3, 3}, {40}, {40}},
                       [relu](sk::Context& c, const auto& v) {
                         Variable y = bn(c, {conv_cl(c, v[0], v[1]), v[2], v[3]}, true, relu);
                         if (c.device().is_cuda()) CHECK(sk::keeps_channels_last(y.data()));
                         return y;
                       });
    compare_with_grads("batch_norm eval channels-last", {{4, 8, 9, 9}, {40, 8, 3, 3}, {40}, {40}},
                       [relu](sk::Context& c, const auto& v) {
                         return bn(c, {conv_cl(c, v[0], v[1]), v[2], v[3]}, false, relu);
                       });
  }
  // [N, C] inputs are rows of channels too: runs of 4 channels (64), and of 1 (70).
  compare_with_grads("batch_norm train 1d, 64 channels", {{300, 64}, {64}, {64}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true, true); });
  compare_with_grads("batch_norm train 1d, 70 channels", {{300, 70}, {70}, {70}},
                     [](sk::Context& c, const auto& v) { return bn(c, v, true); });
  // A channels-last input into a 1 x 1 output, which is both layouts at once (runs_nhwc then
  // follows the input).
  compare_with_grads("conv to 1 x 1 from channels-last",
                     {{2, 4, 9, 9}, {40, 4, 3, 3}, {8, 40, 9, 9}},
                     [](sk::Context& c, const auto& v) {
                       return ag::conv2d(c, conv_cl(c, v[0], v[1]), v[2], Variable(),
                                         ag::Conv2dOptions::make(1, 0));
                     });
  compare_with_grads("max_pool channels-last", {{2, 4, 11, 11}, {16, 4, 3, 3}},
                     [](sk::Context& c, const auto& v) {
                       Variable y = ag::max_pool2d(c, conv_cl(c, v[0], v[1]), 3, 2, 1);
                       if (c.device().is_cuda()) CHECK(sk::keeps_channels_last(y.data()));
                       return y;
                     });
}

// A convolution asked to read channel blocks (Conv2dOptions::channel_blocks, as the CPU's
// ResNets keep them) takes them on the GPU too, through an NCHW copy, the gradient handed back
// in blocks -- against the CPU, where oneDNN reads them as they are.
TEST_CASE("a channel-blocked input into a convolution on the GPU matches the CPU") {
  for (const std::int64_t block : {8, 16}) {
    CAPTURE(block);
    compare_with_grads(
        "conv3x3 from channel blocks", {{4, 16, 9, 9}, {24, 16, 3, 3}},
        [block](sk::Context& c, const auto& v) {
          ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1);
          o.channel_blocks = true;
          const Variable y =
              ag::conv2d(c, ag::to_channel_blocks(c, v[0], block), v[1], Variable(), o);
          if (c.device().is_cuda()) CHECK(y.dim() == 4);
          return sk::has_channel_block_form(y.data()) ? ag::from_channel_blocks(c, y) : y;
        });
  }
}

// The convolutions above ran NHWC, not through NCHW copies: runs_nhwc says so for the stem (NCHW
// images, channels-last output), a layer between channels-last tensors and a 1 x 1 output from a
// channels-last input, and every plan made was an NHWC one.
TEST_CASE("channels-last convolutions on the GPU run cuDNN's NHWC form") {
  namespace cu = sk::autograd::cuda;
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto make = [&](const sk::Shape& shape, std::uint32_t salt) {
    return Variable(
        sk::from_vector(*gpu, pattern(sk::shape_numel(shape), salt, sk::DType::f32), shape), true);
  };
  const Variable images = make({2, 3, 8, 8}, 1), w1 = make({16, 3, 3, 3}, 2),
                 w2 = make({16, 16, 3, 3}, 3), w3 = make({8, 16, 8, 8}, 4);
  ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1);
  o.channels_last = true;
  const Variable a = ag::conv2d(*gpu, images, w1, Variable(), o);
  CHECK(cu::runs_nhwc(images.data(), a.data()));
  const Variable b = ag::conv2d(*gpu, a, w2, Variable(), ag::Conv2dOptions::make(1, 1));
  CHECK(sk::keeps_channels_last(b.data()));
  CHECK(cu::runs_nhwc(a.data(), b.data()));
  const Variable c = ag::conv2d(*gpu, b, w3, Variable(), ag::Conv2dOptions::make(1, 0));
  CHECK(c.data().is_contiguous());  // ([2, 8, 1, 1]: both layouts)
  CHECK(cu::runs_nhwc(b.data(), c.data()));
  CHECK_FALSE(cu::runs_nhwc(images.data(), sk::contiguous(*gpu, a.data())));
  ag::backward(*gpu, c, sk::full(*gpu, c.data().shape(), sk::DType::f32, 1.0));
  CHECK(w1.grad().is_contiguous());  // (KCRS, copied back from cuDNN's KRSC gradient)
  const auto keys = cu::conv_plans(*gpu).keys();
  CHECK(keys.size() == 3);
  for (const auto& key : keys) CHECK(key.back() == 1);
}

TEST_CASE("batch-norm on the GPU takes an eps below cuDNN's 1e-5, as PyTorch does") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  for (const bool training : {true, false}) {
    CAPTURE(training);
    std::vector<std::vector<float>> outputs;
    for (sk::Context* c : {&cpu, gpu.get()}) {
      ag::BatchNormOptions o;
      o.training = training;
      o.eps = 1e-8;
      const Variable x(sk::from_vector(*c, pattern(4 * 6 * 25, 3, sk::DType::f32), {4, 6, 5, 5}));
      sk::Tensor mean = sk::full(*c, {6}, sk::DType::f32, 0.1);
      sk::Tensor var = sk::full(*c, {6}, sk::DType::f32, 1e-7);  // (eps matters here)
      const Variable w(sk::full(*c, {6}, sk::DType::f32, 1.0)),
          b(sk::zeros(*c, {6}, sk::DType::f32));
      outputs.push_back(as_floats(*c, ag::batch_norm(*c, x, w, b, mean, var, o).data()));
    }
    CHECK(relative_error(outputs[0], outputs[1]) <= 1e-4);
  }
}

// Dropout's and drop connect's masks come from the tape's counter-based stream: the GPU draws
// the CPU's masks, so the outputs and gradients are the same bits (a product by 0 or 1 / (1 - p)).
TEST_CASE("dropout and drop connect on the GPU: the CPU's masks, outputs and gradients") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto values = pattern(2 * 3 * 5 * 7, 3, sk::DType::f32);
  for (const bool per_sample : {false, true}) {
    CAPTURE(per_sample);
    std::vector<std::vector<float>> results;
    for (sk::Context* ctx : {&cpu, gpu.get()}) {
      const Variable x(sk::from_vector(*ctx, values, {2 * 3, 5, 7}), true);
      ag::tape(*ctx).set_random_stream({77, 3});
      const Variable y = per_sample ? ag::drop_connect(*ctx, x, 0.4) : ag::dropout(*ctx, x, 0.4);
      ag::backward(*ctx, y, sk::full(*ctx, y.shape(), sk::DType::f32, 1.0));
      results.push_back(sk::to_vector<float>(*ctx, y.data()));
      const auto grad = sk::to_vector<float>(*ctx, x.grad());
      results.back().insert(results.back().end(), grad.begin(), grad.end());
    }
    CHECK(results[0] == results[1]);
  }
}

// The pointwise kernel moves whole 16-byte packs when out, a and b start on 16-byte boundaries
// (the elements after the last whole pack one by one), else goes element by element: both forms
// run the same element functor, so they must give the same bits, and the CPU's values within
// rounding (its compiler may contract alpha * a + beta * b differently).
TEST_CASE("pointwise kernels: 128-bit packs equal the element-by-element form bit for bit") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto exact = [&](const sk::Tensor& t) {  // every dtype's values exactly, as f64
    return sk::to_vector<double>(*gpu, sk::cast(*gpu, t, sk::DType::f64));
  };
  for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16, sk::DType::f64})
    for (std::int64_t n : {1, 3, 7, 8, 9, 33, 1000, 100003})
      for (auto op :
           {ag::Pointwise::axpby, ag::Pointwise::mul, ag::Pointwise::relu,
            ag::Pointwise::relu_backward, ag::Pointwise::add_relu, ag::Pointwise::sigmoid,
            ag::Pointwise::sigmoid_backward, ag::Pointwise::silu, ag::Pointwise::silu_backward})
        for (double beta : {0.75, 0.0}) {  // axpby with beta 0 reads no b (scale)
          if (op != ag::Pointwise::axpby && beta == 0) continue;
          CAPTURE(sk::dtype_name(dtype));
          CAPTURE(n);
          CAPTURE(static_cast<int>(op));
          CAPTURE(beta);
          // One element before the values: a view from element 1 is off the 16-byte grid.
          const auto a_host = pattern(n + 1, 1, dtype), b_host = pattern(n + 1, 2, dtype);
          const sk::Tensor a_wide = sk::cast(*gpu, sk::from_vector(*gpu, a_host, {n + 1}), dtype);
          const sk::Tensor b_wide = sk::cast(*gpu, sk::from_vector(*gpu, b_host, {n + 1}), dtype);
          const sk::Tensor a_off = a_wide.slice(0, 1, n + 1), b_off = b_wide.slice(0, 1, n + 1);
          const sk::Tensor a = sk::empty(*gpu, {n}, dtype), b = sk::empty(*gpu, {n}, dtype);
          sk::copy(*gpu, a, a_off);
          sk::copy(*gpu, b, b_off);
          REQUIRE(reinterpret_cast<std::uintptr_t>(a.data_ptr()) % 16 == 0);
          REQUIRE(reinterpret_cast<std::uintptr_t>(a_off.data_ptr()) % 16 != 0);
          const sk::Tensor packed = ag::fn::pointwise(*gpu, op, a, b, 1.25, beta);
          const sk::Tensor single = ag::fn::pointwise(*gpu, op, a_off, b_off, 1.25, beta);
          const auto p = exact(packed), e = exact(single);
          REQUIRE(p.size() == e.size());
          CHECK(std::memcmp(p.data(), e.data(), p.size() * sizeof(double)) == 0);
          // Against the CPU's loop on the same values (f16 and bf16 there in f32, rounded once).
          const sk::DType on_cpu = dtype == sk::DType::f64 ? sk::DType::f64 : sk::DType::f32;
          const sk::Tensor ca = sk::cast(cpu, sk::from_vector(cpu, exact(a), {n}), on_cpu);
          const sk::Tensor cb = sk::cast(cpu, sk::from_vector(cpu, exact(b), {n}), on_cpu);
          const auto reference = sk::to_vector<double>(
              cpu,
              sk::cast(cpu, sk::cast(cpu, ag::fn::pointwise(cpu, op, ca, cb, 1.25, beta), dtype),
                       sk::DType::f64));
          const double tolerance = dtype == sk::DType::f64   ? 1e-15
                                   : dtype == sk::DType::f32 ? 1e-6
                                                             : 1e-2;
          for (std::size_t i = 0; i < p.size(); ++i)
            CHECK(std::fabs(p[i] - reference[i]) <=
                  tolerance * std::max(1.0, std::fabs(reference[i])));
        }
}

namespace {

// One max-pool on both devices, from the same values, its y and input gradient compared bit for
// bit, and a second backward on the GPU compared with the first. `channels_last`: the GPU's x
// channels-last (kept so where the dtype and shape allow), and y and the gradient that leaves
// the pool then too.
void compare_max_pool(const sk::Shape& shape, std::int64_t kernel, std::int64_t stride,
                      std::int64_t padding, sk::DType dtype, bool channels_last, bool nans) {
  const std::string shape_text = sk::shape_str(shape);
  CAPTURE(shape_text);
  CAPTURE(kernel);
  CAPTURE(stride);
  CAPTURE(padding);
  CAPTURE(sk::dtype_name(dtype));
  CAPTURE(channels_last);
  CAPTURE(nans);
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto exact = [](sk::Context& c, const sk::Tensor& t) {
    return sk::to_vector<double>(c, sk::cast(c, sk::contiguous(c, t), sk::DType::f64));
  };
  const auto values = max_pool_cases::tied_values(sk::shape_numel(shape), 7, nans);
  // (not f64, nor a shape whose two layouts are the same memory: one channel, 1 x 1 planes)
  const bool kept = channels_last && sk::channels_last_applies(gpu->device(), dtype, shape);
  const auto on = [&](sk::Context& c) {
    sk::Tensor x = sk::cast(c, sk::from_vector(c, values, shape), dtype);
    if (channels_last && c.device().is_cuda()) {
      x = sk::to_channels_last(c, x);
      REQUIRE(sk::keeps_channels_last(x) == kept);
    }
    return Variable(x, true);
  };
  // (the gradient leaving the pool, seen by a hook: a leaf's own grad is always contiguous)
  const auto pool = [&](sk::Context& c, const Variable& x, bool* grad_channels_last) {
    const Variable seen = ag::identity_with_hook(c, x, [grad_channels_last](const sk::Tensor& g) {
      *grad_channels_last = sk::keeps_channels_last(g);
    });
    return ag::max_pool2d(c, seen, kernel, stride, padding);
  };
  bool cpu_cl = false, gpu_cl = false, again_cl = false;
  const Variable x_cpu = on(cpu), x_gpu = on(*gpu);
  const Variable y_cpu = pool(cpu, x_cpu, &cpu_cl), y_gpu = pool(*gpu, x_gpu, &gpu_cl);
  const bool planes = y_cpu.size(2) * y_cpu.size(3) > 1;  // (1 x 1 outputs are both layouts)
  CHECK(sk::keeps_channels_last(y_gpu.data()) == (kept && planes));
  CHECK(max_pool_cases::values_differing(exact(cpu, y_cpu.data()), exact(*gpu, y_gpu.data())) == 0);
  const auto grad = pattern(y_cpu.numel(), 5, dtype);
  const auto upstream = [&](sk::Context& c) {
    return sk::cast(c, sk::from_vector(c, grad, y_cpu.shape()), dtype);
  };
  ag::backward(cpu, y_cpu, upstream(cpu));
  ag::backward(*gpu, y_gpu, upstream(*gpu));
  const auto gx_gpu = exact(*gpu, x_gpu.grad());
  CHECK(max_pool_cases::values_differing(exact(cpu, x_cpu.grad()), gx_gpu) == 0);
  CHECK(gpu_cl == kept);
  // Once more on the GPU: the same bits.
  const Variable again = on(*gpu);
  ag::backward(*gpu, pool(*gpu, again, &again_cl), upstream(*gpu));
  CHECK(max_pool_cases::values_differing(gx_gpu, exact(*gpu, again.grad())) == 0);
}

}  // namespace

// The GPU's max-pool takes the maximum the CPU takes (the first of equal values, the last NaN;
// never the padding) and adds each input's gradients in the CPU's order: y and the input
// gradient equal the CPU's bit for bit -- f32 and f64 themselves, f16 and bf16 as the CPU's f32
// rounded once -- in NCHW and channels-last, for overlapping windows (3 x 3 / 1 takes up to nine
// gradients an input), windows cut by the padding, inputs in no window, one channel, a 1 x 1
// output and a window of over 256 values (i32 offsets). And the backward gives the same bits
// again: no atomics.
TEST_CASE("max-pooling on the GPU equals the CPU bit for bit, ties and NaNs included") {
  auto geometries = max_pool_cases::geometries();
  geometries.push_back({{2, 1, 9, 9}, 3, 2, 1});  // one channel (both layouts at once)
  geometries.push_back({{2, 6, 3, 3}, 3, 1, 0});  // a 1 x 1 output
  for (const auto& g : geometries)
    for (auto dtype : {sk::DType::f32, sk::DType::f64, sk::DType::f16, sk::DType::bf16})
      for (const bool channels_last : {false, true})
        for (const bool nans : {false, true})
          compare_max_pool(g.shape, g.kernel, g.stride, g.padding, dtype, channels_last, nans);
  // The launch grid's strides: more NCHW planes than its 65 535 rows (a second pass over planes),
  // and a channels-last image of more inputs than its 65 535 blocks of 256 threads cover (a
  // second pass within the image, in the backward).
  compare_max_pool({1, 70000, 2, 2}, 2, 2, 0, sk::DType::f32, false, true);
  compare_max_pool({1, 64, 512, 520}, 2, 2, 0, sk::DType::f32, true, false);
}

// The labels are checked on the device and the error raised at the host's next wait (a read of
// the loss here): the forward itself makes no host wait.
TEST_CASE("cross_entropy on the GPU rejects class labels outside [0, classes), as on the CPU") {
  auto gpu = sk::make_cuda_context(0, 0, 3);
  Variable logits(sk::from_vector(*gpu, pattern(4 * 10, 1, sk::DType::f32), {4, 10}), true);
  const std::int64_t huge = std::int64_t{1} << 40;
  for (std::int64_t bad : {std::int64_t{10}, std::int64_t{-1}, huge}) {
    CAPTURE(bad);
    // Rows 1 and 3 are bad: the first one is reported, whatever order the blocks ran in.
    auto labels = sk::from_vector<std::int64_t>(*gpu, {0, bad, 9, bad}, {4});
    auto later = sk::from_vector<std::int64_t>(*gpu, {0, 1, 2, 11}, {4});  // (uploads wait)
    const std::string expected =
        "cross_entropy: target class " + std::to_string(bad) + " at row 1 is outside [0, 10)";
    const sk::HostWaits before = gpu->host_waits();
    auto loss = ag::cross_entropy(*gpu, logits, labels);
    CHECK((gpu->host_waits() - before).total() == 0);
    // A second bad call before the wait: the first one's row and label are reported.
    (void)ag::cross_entropy(*gpu, logits, later);
    CHECK_THROWS_WITH_AS((void)sk::to_vector<float>(*gpu, loss.data()),
                         doctest::Contains(expected.c_str()), sk::InvalidArgument);
    // Reported once: the next read goes through.
    CHECK(std::isnan(sk::to_vector<float>(*gpu, loss.data())[0]));
  }
  // The context stays usable: valid labels still give a finite loss.
  auto loss =
      ag::cross_entropy(*gpu, logits, sk::from_vector<std::int64_t>(*gpu, {0, 9, 9, 3}, {4}));
  CHECK(std::isfinite(sk::to_vector<float>(*gpu, loss.data())[0]));
}

namespace {

// One training step of the network `build` makes, built from the same seed on both devices:
// the same parameters, the loss to 1e-4 and every gradient to 1e-2.
void compare_training_step(const std::function<std::shared_ptr<nn::Module>(sk::Context&)>& build,
                           std::int64_t batch) {
  sk::Context cpu({.seed = 5});
  auto gpu = sk::make_cuda_context(0, 0, 5);
  auto on_cpu = build(cpu);
  auto on_gpu = build(*gpu);
  auto images = pattern(batch * 3 * 16 * 16, 7, sk::DType::f32);
  std::vector<std::int64_t> labels;
  for (std::int64_t i = 0; i < batch; ++i) labels.push_back(1 + i % 9);
  auto step = [&](sk::Context& c, nn::Module& net) {
    auto logits = net(c, Variable(sk::from_vector(c, images, {batch, 3, 16, 16})));
    auto loss = ag::cross_entropy(c, logits, sk::from_vector<std::int64_t>(c, labels, {batch}));
    ag::backward(c, loss);
    return sk::to_vector<float>(c, loss.data())[0];
  };
  const float cpu_loss = step(cpu, *on_cpu), gpu_loss = step(*gpu, *on_gpu);
  CHECK(std::abs(cpu_loss - gpu_loss) <= 1e-4 * std::abs(cpu_loss));
  auto cpu_params = on_cpu->named_parameters();
  auto gpu_params = on_gpu->named_parameters();
  REQUIRE(cpu_params.size() == gpu_params.size());
  for (std::size_t i = 0; i < cpu_params.size(); ++i) {
    CAPTURE(cpu_params[i].first);
    CHECK(sk::to_vector<float>(cpu, cpu_params[i].second.data()) ==
          sk::to_vector<float>(*gpu, gpu_params[i].second.data()));
    // f32 throughout (no TF32), but cuDNN's heuristic algorithms (transform-based for 3x3) and
    // oneDNN's direct convolutions round differently, through 20 layers whose batch-norm sees as
    // few as 16 values per channel: 2.3e-3 to 5.0e-3 on an H100 for ResNet-18 (2026-11-25). A
    // wrong gradient is off by O(1).
    CHECK(relative_error(sk::to_vector<float>(cpu, cpu_params[i].second.grad()),
                         sk::to_vector<float>(*gpu, gpu_params[i].second.grad())) <= 1e-2);
  }
}

// The ResNet-18 step (`o` on both devices: NCHW, or channels-last -- the GPU's cuDNN NHWC
// kernels and batch-norm's tiles against the CPU's oneDNN NHWC primitives).
void compare_resnet_step(const nn::ResNetOptions& o, std::int64_t batch) {
  compare_training_step([&](sk::Context& c) { return nn::resnet18(c, o); }, batch);
}

}  // namespace

TEST_CASE("ResNet-18 training step: same seed, same parameters, matching loss and gradients") {
  nn::ResNetOptions o;
  o.num_classes = 10;
  o.small_image_stem = true;
  compare_resnet_step(o, 4);
}

TEST_CASE("ResNet-18 training step, channels-last: matching loss and gradients") {
  nn::ResNetOptions o;
  o.num_classes = 10;
  o.small_image_stem = true;
  o.channels_last = true;
  compare_resnet_step(o, 8);
}

// A RegNetY (an AnyNet: projections, grouped 3 x 3 convolutions, squeeze-and-excitation's
// sigmoid and channel_scale), as the ResNet-18 step above.
TEST_CASE("RegNetY training step: same seed, same parameters, matching loss and gradients") {
  nn::RegNetOptions o;
  o.stem_width = 8;
  o.num_classes = 10;
  compare_training_step(
      [&](sk::Context& c) {
        return nn::anynet(c, {{8, 2, 1, 4, 1.0}, {16, 2, 2, 8, 1.0}}, o);
      },
      4);
}

TEST_CASE("checkpointing on the GPU gives the same gradients") {
  auto gradients = [](int segments) {
    auto gpu = sk::make_cuda_context(0, 0, 9);
    nn::ResNetOptions o;
    o.num_classes = 10;
    o.small_image_stem = true;
    auto net = nn::resnet18(*gpu, o);
    net->set_checkpoint_segments(segments);
    auto images = pattern(4 * 3 * 16 * 16, 3, sk::DType::f32);
    auto logits = (*net)(*gpu, Variable(sk::from_vector(*gpu, images, {4, 3, 16, 16})));
    ag::backward(*gpu, ag::cross_entropy(*gpu, logits,
                                         sk::from_vector<std::int64_t>(*gpu, {1, 2, 3, 4}, {4})));
    std::vector<std::vector<float>> grads;
    for (auto& p : net->parameters()) grads.push_back(sk::to_vector<float>(*gpu, p.grad()));
    return grads;
  };
  // cuDNN's backward-filter algorithms may sum in a different order from run to run.
  const auto plain = gradients(0), checkpointed = gradients(4);
  REQUIRE(plain.size() == checkpointed.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    CHECK(relative_error(plain[i], checkpointed[i]) <= 1e-5);
}

// cuDNN's descriptors and algorithms are made once per shape (autograd/cuda_libraries.hpp's plan
// caches): a second call of a shape finds its plan; a new shape adds one. With
// Libraries::benchmark the algorithms are found by running them: the convolution agrees with the
// heuristic's to f32 rounding, and such a search for a new shape inside a captured step is
// refused by name.
TEST_CASE("cuDNN plans are made once per shape; benchmark mode's algorithms agree") {
  namespace cu = sk::autograd::cuda;
  const auto convolve = [](sk::Context& ctx, std::int64_t hw) {
    Variable x(sk::from_vector(ctx, pattern(2 * 3 * hw * hw, 4, sk::DType::f32), {2, 3, hw, hw}),
               true);
    Variable w(sk::from_vector(ctx, pattern(5 * 3 * 3 * 3, 5, sk::DType::f32), {5, 3, 3, 3}), true);
    auto y = ag::conv2d(ctx, x, w, Variable(), ag::Conv2dOptions::make(1, 1));
    ag::backward(ctx, y, sk::full(ctx, y.data().shape(), sk::DType::f32, 1.0));
    std::vector<float> out = as_floats(ctx, y.data());
    const auto gx = as_floats(ctx, x.grad()), gw = as_floats(ctx, w.grad());
    out.insert(out.end(), gx.begin(), gx.end());
    out.insert(out.end(), gw.begin(), gw.end());
    return out;
  };
  auto heuristic = sk::make_cuda_context(0, 0, 3);
  const auto first = convolve(*heuristic, 12);
  auto& plans = cu::conv_plans(*heuristic);
  CHECK(plans.size() == 1);
  CHECK(convolve(*heuristic, 12) == first);  // the same plan, the same bits
  CHECK(plans.size() == 1);
  (void)convolve(*heuristic, 10);
  CHECK(plans.size() == 2);
  // Limits on the algorithms are part of the key: a plan chosen under a larger workspace bound,
  // or among non-deterministic algorithms, is not reused once the limits tighten.
  cu::libraries(*heuristic).workspace_limit = std::size_t{1} << 20;
  (void)convolve(*heuristic, 12);
  CHECK(plans.size() == 3);
  cu::libraries(*heuristic).deterministic = false;
  (void)convolve(*heuristic, 12);
  CHECK(plans.size() == 4);

  auto searched = sk::make_cuda_context(0, 0, 3);
  cu::libraries(*searched).benchmark = true;
  const auto found = convolve(*searched, 12);
  REQUIRE(found.size() == first.size());
  for (std::size_t i = 0; i < found.size(); ++i)
    REQUIRE(std::fabs(found[i] - first[i]) <= 1e-4f * (1.0f + std::fabs(first[i])));
  const Variable x(
      sk::from_vector(*searched, pattern(2 * 3 * 9 * 9, 6, sk::DType::f32), {2, 3, 9, 9}));
  const Variable w(
      sk::from_vector(*searched, pattern(5 * 3 * 3 * 3, 5, sk::DType::f32), {5, 3, 3, 3}));
  sk::StepGraph graph(*searched, "conv", {.warmup_steps = 0});
  CHECK_THROWS_WITH_AS(
      graph.run(
          "new shape",
          [&] { (void)ag::conv2d(*searched, x, w, Variable(), ag::Conv2dOptions::make(1, 1)); }),
      doctest::Contains("a cuDNN algorithm search"), sk::CaptureRefused);
}

// The convolutions' workspace (Libraries::workspace): a captured step replays with its address,
// so one that a capture used is kept when a larger one replaces it (an eager evaluation of
// larger images, another key's warm-up), and one no capture used is freed as before.
TEST_CASE("a cuDNN workspace that a captured step uses is kept when a larger one replaces it") {
  namespace cu = sk::autograd::cuda;
  auto ctx = sk::make_cuda_context(0, 0, 3);
  auto& libs = cu::libraries(*ctx);
  const sk::Tensor marks = sk::zeros(*ctx, {64}, sk::DType::f32);
  void* captured = nullptr;
  sk::StepGraph graph(*ctx, "workspace", {.warmup_steps = 0});
  const auto step = [&] {
    captured = libs.workspace(*ctx, std::size_t{1} << 20);
    sk::add_(*ctx, marks, sk::full(*ctx, {64}, sk::DType::f32, 1.0));
  };
  graph.run("1 MiB", step);
  REQUIRE(captured != nullptr);
  CHECK(libs.kept_workspaces() == 0);
  void* larger = libs.workspace(*ctx, std::size_t{3} << 20);  // eager: the captured one is kept
  CHECK(larger != captured);
  CHECK(libs.kept_workspaces() == 1);
  (void)libs.workspace(*ctx, std::size_t{4} << 20);  // no capture used the 3 MiB one: freed
  CHECK(libs.kept_workspaces() == 1);
  graph.run("1 MiB", step);  // replayed: still writes where it was captured
  CHECK(as_floats(*ctx, marks) == std::vector<float>(64, 2.0f));
}

// SwAV's Sinkhorn-Knopp (samples/swav) on the GPU against the CPU's loops, one rank: the same
// iteration up to the order of its sums (f32 1e-4 relative, f64 1e-10), the same one-hot codes,
// VISSL's empty-prototype guard on both sides; sizes past one block of columns and one chunk
// of rows; nothing read back on the way.

TEST_CASE("Sinkhorn-Knopp on the GPU matches the CPU: f32, f64, hard, empty prototype") {
  auto gpu = sk::make_cuda_context(0, 0, 13);
  sk::Context cpu;
  auto none = [](const sk::Tensor&, sk::comm::ReduceOp) {};
  struct Case {
    std::int64_t rows, k, code_rows;
    bool empty_prototype;
  };
  for (const Case c : {Case{37, 11, 30, false}, Case{300, 700, 256, false},
                       Case{2100, 3000, 2048, false}, Case{90, 300, 90, true}}) {
    auto scores = pattern(c.rows * c.k, static_cast<std::uint32_t>(c.k), sk::DType::f32);
    if (c.empty_prototype)
      for (std::int64_t r = 0; r < c.rows; ++r) scores[r * c.k + 5] = -1e38f;
    for (bool f64 : {false, true})
      for (bool hard : {false, true}) {
        CAPTURE(c.rows);
        CAPTURE(c.k);
        CAPTURE(f64);
        CAPTURE(hard);
        swav::SinkhornOptions soft;
        soft.use_double_precision = f64;
        swav::SinkhornOptions options = soft;
        options.hard_assignment = hard;
        const auto want = sk::to_vector<float>(
            cpu, swav::distributed_sinkhorn(cpu, sk::from_vector(cpu, scores, {c.rows, c.k}),
                                            c.code_rows, 1, soft, none));
        const sk::Tensor on_gpu = sk::from_vector(*gpu, scores, {c.rows, c.k});
        const sk::HostWaits before = gpu->host_waits();
        const sk::Tensor codes =
            swav::distributed_sinkhorn(*gpu, on_gpu, c.code_rows, 1, options, none);
        CHECK((gpu->host_waits() - before).total() == 0);
        const auto got = sk::to_vector<float>(*gpu, codes);
        REQUIRE(got.size() == want.size());
        if (!hard) {
          double worst = 0;
          for (std::size_t i = 0; i < got.size(); ++i)
            worst = std::max(worst, std::abs(double(got[i]) - want[i]) /
                                        std::max(1e-6, std::abs(double(want[i]))));
          CHECK(worst <= (f64 ? 1e-10 : 1e-4));
          continue;
        }
        // One 1 per row, where the CPU's soft code is the row's largest (up to the sums'
        // rounding: a near tie may fall either way).
        for (std::int64_t r = 0; r < c.code_rows; ++r) {
          const float* row = got.data() + r * c.k;
          const float* ref = want.data() + r * c.k;
          CHECK(std::count(row, row + c.k, 1.0f) == 1);
          CHECK(std::count(row, row + c.k, 0.0f) == c.k - 1);
          const auto at = std::find(row, row + c.k, 1.0f) - row;
          CHECK(ref[at] >= *std::max_element(ref, ref + c.k) * (1 - 1e-5));
        }
      }
  }
  // A NaN score makes every code NaN; hard codes then pick each row's first column on both
  // devices (torch.argmax's rule: a NaN goes before any number), never no column.
  std::vector<float> nan_scores = pattern(40 * 9, 9, sk::DType::f32);
  nan_scores[77] = std::numeric_limits<float>::quiet_NaN();
  swav::SinkhornOptions hard;
  hard.hard_assignment = true;
  const auto want = sk::to_vector<float>(
      cpu, swav::distributed_sinkhorn(cpu, sk::from_vector(cpu, nan_scores, {40, 9}), 40, 1, hard,
                                      none));
  const auto got = sk::to_vector<float>(
      *gpu, swav::distributed_sinkhorn(*gpu, sk::from_vector(*gpu, nan_scores, {40, 9}), 40, 1,
                                       hard, none));
  CHECK(got == want);
  for (std::int64_t r = 0; r < 40; ++r) CHECK(want[static_cast<std::size_t>(r * 9)] == 1.0f);
}

// linear and matmul on operands of two devices: refused by name, as conv2d and batch_norm
// refuse them (the GEMM ran on the input's device and read the other's pointers as its own).
TEST_CASE("linear and matmul refuse a weight or operand on another device") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto f32 = sk::DType::f32;
  const Variable x(sk::from_vector(*gpu, pattern(8, 1, f32), {2, 4}));
  const Variable weight(sk::from_vector(*gpu, pattern(12, 2, f32), {3, 4}));
  const Variable weight_on_host(sk::from_vector(cpu, pattern(12, 2, f32), {3, 4}));
  const Variable bias_on_host(sk::from_vector(cpu, pattern(3, 3, f32), {3}));
  CHECK_THROWS_WITH_AS(ag::linear(*gpu, x, weight_on_host),
                       doctest::Contains("linear: the weight must be on the input's device"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(ag::linear(*gpu, x, weight, bias_on_host),
                       doctest::Contains("linear: the weight and bias must be on the input's"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      ag::matmul(*gpu, x, Variable(sk::from_vector(cpu, pattern(12, 4, f32), {4, 3}))),
      doctest::Contains("matmul: the inputs are on different devices"), sk::InvalidArgument);
}

// Two gradients of one value in different dtypes (batch-norm's f32 weight gradient beside a
// 16-bit one) are summed in the first's: the kernel once read the f16 operand's bytes as f32.
TEST_CASE("a pointwise sum of an f32 and an f16 operand converts the second on the GPU") {
  sk::Context cpu({.seed = 1});
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const auto a = pattern(1000, 5, sk::DType::f32), b = pattern(1000, 6, sk::DType::f16);
  const sk::Tensor b16 = sk::cast(*gpu, sk::from_vector(*gpu, b, {1000}), sk::DType::f16);
  const sk::Tensor sum = ag::fn::add(*gpu, sk::from_vector(*gpu, a, {1000}), b16);
  CHECK(sum.dtype() == sk::DType::f32);
  const auto got = sk::to_vector<float>(*gpu, sum);
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(got[i] == a[i] + b[i]);
}

// A NaN stays NaN through the GPU's ReLU, plain and fused into batch-norm, as on the CPU.
TEST_CASE("a NaN stays NaN through the ReLU on the GPU") {
  auto gpu = sk::make_cuda_context(0, 0, 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v(2 * 3 * 4, 0.5f);
  v[1] = -1.0f;
  v[5] = nan;
  const Variable x(sk::from_vector(*gpu, v, {2, 3, 2, 2}));
  const auto plain = sk::to_vector<float>(*gpu, ag::relu(*gpu, x).data());
  CHECK(std::isnan(plain[5]));
  CHECK(plain[1] == 0.0f);
  const Variable w(sk::from_vector(*gpu, std::vector<float>(3, 1.0f), {3}));
  const Variable b(sk::from_vector(*gpu, std::vector<float>(3, 0.0f), {3}));
  sk::Tensor mean = sk::from_vector(*gpu, std::vector<float>(3, 0.0f), {3});
  sk::Tensor var = sk::from_vector(*gpu, std::vector<float>(3, 1.0f), {3});
  ag::BatchNormOptions o;
  o.training = false;
  o.relu = true;
  const auto fused = sk::to_vector<float>(*gpu, ag::batch_norm(*gpu, x, w, b, mean, var, o).data());
  CHECK(std::isnan(fused[5]));
  CHECK(fused[1] == 0.0f);
  CHECK(fused[0] > 0.0f);
}
