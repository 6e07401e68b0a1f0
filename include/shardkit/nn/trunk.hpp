// A convolutional trunk: a Sequential of a stem, stages of residual blocks and the pooling,
// described enough for what is planned before a run (a layer's feature size, the blocks that
// become FSDP units, the stage a feature name means) without a forward. ResNet, RegNet and
// EfficientNet are trunks.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/nn/layers.hpp"
#include "shardkit/nn/sequential.hpp"

namespace shardkit::nn {

class Trunk : public Sequential {
 public:
  // The [C, H, W] that child `name` returns for images of h x w pixels.
  virtual std::array<std::int64_t, 3> child_output_shape(std::string_view name, std::int64_t h,
                                                         std::int64_t w) const = 0;
  // The children that are stages of residual blocks, in order (ResNet's layer1 ... layer4,
  // RegNet's res2 ...): VISSL's feature name res<k> is the output of stage k - 2.
  virtual std::vector<std::string> stage_names() const = 0;

  // The residual blocks' paths below the trunk ("layer1.0", "res2.block1-0", ...): each
  // stage child's own children (a trunk whose blocks are its own children says so itself).
  virtual std::vector<std::string> block_paths() const {
    std::vector<std::string> paths;
    for (const std::string& stage : stage_names())
      for (const auto& [name, module] : children())
        if (name == stage)
          for (const auto& [block, unused] : module->children())
            paths.push_back(stage + "." + block);
    return paths;
  }

  // The convolutions inside the residual blocks holding at least `min_params` parameters
  // (weight and bias), their paths below the trunk, block by block: what VISSL's
  // AUTO_WRAP_THRESHOLD makes FSDP units of their own inside each block's.
  std::vector<std::string> large_block_convolutions(std::int64_t min_params) {
    std::vector<std::string> paths;
    if (min_params <= 0) return paths;
    const auto modules = named_modules();
    for (const std::string& block : block_paths())
      for (const auto& [path, module] : modules) {
        if (path.rfind(block + ".", 0) != 0 || dynamic_cast<Conv2d*>(module) == nullptr) continue;
        std::int64_t count = 0;
        for (const auto& [name, p] : module->named_parameters()) count += p.numel();
        if (count >= min_params) paths.push_back(path);
      }
    return paths;
  }

  std::int64_t feature_dim = 0;  // channels entering the global pooling

 protected:
  // A [C, H, W] after a window that maps n pixels to floor((n - 1) / stride) + 1: a k x k
  // convolution or pooling with padding (k - 1) / 2 (odd k), or an unpadded 1 x 1, at that
  // stride -- every window that shrinks the images in these trunks.
  static std::array<std::int64_t, 3> shrink_by_stride(const std::array<std::int64_t, 3>& shape,
                                                      std::int64_t stride) {
    return {shape[0], (shape[1] - 1) / stride + 1, (shape[2] - 1) / stride + 1};
  }
};

}  // namespace shardkit::nn
