// torchvision ResNet-50's parameter tensors in registration order (named_parameters()): 161
// tensors, 25 557 032 parameters. Conv weights [out, in, kh, kw]; BatchNorm weight and bias
// [c]; fc weight [1000, 2048] and bias [1000]. Shared by benchmarks of every layer.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace shardkit::workloads {

struct ParamShape {
  std::int64_t dims[4] = {0, 0, 0, 0};
  int rank = 0;
  constexpr std::int64_t numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= dims[d];
    return n;
  }
  std::vector<std::int64_t> shape() const { return {dims, dims + rank}; }
};

inline constexpr int kResNet50Tensors = 161;
inline constexpr std::int64_t kResNet50Params = 25'557'032;

constexpr std::array<ParamShape, kResNet50Tensors> resnet50_param_shapes() {
  std::array<ParamShape, kResNet50Tensors> out{};
  int n = 0;
  auto conv = [&](std::int64_t o, std::int64_t i, std::int64_t k) {
    out[n++] = ParamShape{{o, i, k, k}, 4};
  };
  auto bn = [&](std::int64_t c) {
    out[n++] = ParamShape{{c, 0, 0, 0}, 1};  // weight
    out[n++] = ParamShape{{c, 0, 0, 0}, 1};  // bias
  };
  conv(64, 3, 7);
  bn(64);
  std::int64_t inplanes = 64;
  const std::int64_t planes_of[4] = {64, 128, 256, 512};
  const int blocks_of[4] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer) {
    const std::int64_t planes = planes_of[layer];
    for (int block = 0; block < blocks_of[layer]; ++block) {
      conv(planes, inplanes, 1);  // Bottleneck: conv1, bn1, conv2, bn2, conv3, bn3
      bn(planes);
      conv(planes, planes, 3);
      bn(planes);
      conv(planes * 4, planes, 1);
      bn(planes * 4);
      if (block == 0) {  // downsample.0 (1x1 conv) and downsample.1 (BatchNorm)
        conv(planes * 4, inplanes, 1);
        bn(planes * 4);
      }
      inplanes = planes * 4;
    }
  }
  out[n++] = ParamShape{{1000, 2048, 0, 0}, 2};
  out[n++] = ParamShape{{1000, 0, 0, 0}, 1};
  return out;
}

inline constexpr auto kResNet50Shapes = resnet50_param_shapes();

constexpr std::int64_t total_params(const std::array<ParamShape, kResNet50Tensors>& shapes) {
  std::int64_t total = 0;
  for (const auto& s : shapes) total += s.numel();
  return total;
}

static_assert(kResNet50Shapes.back().rank == 1 && kResNet50Shapes.back().dims[0] == 1000,
              "the list must end with fc.bias: 161 tensors exactly");
static_assert(total_params(kResNet50Shapes) == kResNet50Params,
              "torchvision ResNet-50 has 25 557 032 parameters");

}  // namespace shardkit::workloads
