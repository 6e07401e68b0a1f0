// What the CPU and GPU MLPs (mlp_cpu.hpp, mlp_gpu.cuh) share: the parameter list, its
// initialisation, and the batch as it leaves the data loader. Free of Eigen on purpose: nvcc
// compiles Eigen without SIMD (Eigen turns vectorisation off under nvcc), so the GPU
// translation unit must not share Eigen code with the CPU one.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include <shardkit/core/core.hpp>
#include <shardkit/shard/shard.hpp>

namespace custom_loop {

namespace sk = shardkit;

// A batch on the host: rows × features normalised pixels (row-major) and one label per row.
struct Batch {
  std::int64_t rows = 0;
  std::int64_t features = 0;
  std::vector<float> pixels;
  std::vector<std::uint8_t> labels;
};

// Parameters of an MLP with the given widths (e.g. {784, 1024, 1024, 10}), in PyTorch's
// naming and registration order: fc1.weight, fc1.bias, fc2.weight, ...
inline std::vector<sk::shard::ParamSpec> mlp_param_specs(const std::vector<std::int64_t>& widths) {
  std::vector<sk::shard::ParamSpec> specs;
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const std::string prefix = "fc" + std::to_string(l + 1);
    specs.push_back({prefix + ".weight", {widths[l + 1], widths[l]}});
    specs.push_back({prefix + ".bias", {widths[l + 1]}});
  }
  return specs;
}

// torch.nn.Linear's default initialisation of parameter i (fcL.weight or fcL.bias):
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)). Called for i = 0, 1, 2, ... in order, Philox fills give the
// same numbers on either device and under every ZeRO stage.
inline void init_mlp_param(sk::Context& ctx, const std::vector<std::int64_t>& widths, std::size_t i,
                           const sk::Tensor& param) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(widths[i / 2]));
  sk::uniform_(ctx, param, -bound, bound);
}

// How the MLPs reach their parameters. param(i) is parameter i's full values; enter(layer,
// pass) and leave(layer, pass) bracket each use of a layer's parameters, so that FSDP can
// gather them just before and free them just after (train.hpp); under DDP/OSS/SDP every
// parameter stays whole and they do nothing. Layer l holds parameters 2l and 2l + 1.
enum class Pass { forward, backward };

template <class P>
concept MlpParams = requires(P& p, std::size_t i, Pass pass) {
  { p.param(i) } -> std::convertible_to<sk::Tensor>;
  p.enter(i, pass);
  p.leave(i, pass);
};

// Checks a batch before either device touches its memory. A label outside [0, classes) would
// index past the logits, so it is named together with the valid range.
inline void check_batch(const std::vector<std::int64_t>& widths, const Batch& batch) {
  sk::check(batch.features == widths.front(), "a batch of ", batch.features,
            " features per image; this MLP takes ", widths.front());
  sk::check(batch.rows > 0 && static_cast<std::size_t>(batch.rows) == batch.labels.size() &&
                batch.pixels.size() == static_cast<std::size_t>(batch.rows * batch.features),
            "a batch of ", batch.rows, " rows with ", batch.labels.size(), " labels and ",
            batch.pixels.size(), " pixels; give rows × features pixels and one label per row");
  const std::int64_t classes = widths.back();
  for (std::size_t r = 0; r < batch.labels.size(); ++r)
    sk::check(batch.labels[r] < classes, "label ", int(batch.labels[r]), " of batch row ", r,
              " is outside the valid range [0, ", classes - 1, "] of this MLP's ", classes,
              " classes");
}

}  // namespace custom_loop
