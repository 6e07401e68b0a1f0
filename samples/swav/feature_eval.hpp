// Which trunk features the kNN evaluation reads, as VISSL's
// MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP names them: a list of
// [layer, [pool op, args]]. The layers are VISSL's feature names -- res2 ... res5 (the outputs
// of the trunk's stages: ResNet's layer1 ... layer4, RegNet's res2 ... res5), res5avg (the
// globally average-pooled trunk output, the default; avgpool, VISSL's RegNet name for it), and
// an EfficientNet's feature blocks by their names (conv1, block0 ..., conv_final) -- and
// each output [N, C, H, W] is pooled by the op and flattened per image as torch.flatten(x, 1)
// does:
//   ["Identity", []]                         the output as it is (C·H·W features)
//   ["AvgPool2d", [[kh, kw], stride, pad]]   nn.AvgPool2d (padding counts as zeros in the mean)
//   ["AdaptiveAvgPool2d", [[oh, ow]]]        nn.AdaptiveAvgPool2d (windows floor(i·H/oh) to
//                                            ceil((i+1)·H/oh))
// VISSL's ImageNet benchmarks read res5 through AvgPool2d [[6, 6], 1, 0] (7x7 -> 2x2): spatial
// features that keep where in the image a pattern is. The pooling runs on the host, on the
// features the evaluation copies there anyway.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace swav {

struct FeaturePool {
  enum class Op { identity, avg_pool, adaptive_avg_pool };
  std::string layer = "res5avg";  // res2 .. res5, res5avg (or avgpool), conv1, block<i>, conv_final
  Op op = Op::identity;
  std::array<std::int64_t, 2> kernel{1, 1};  // AvgPool2d
  std::int64_t stride = 1, padding = 0;      // AvgPool2d
  std::array<std::int64_t, 2> output{1, 1};  // AdaptiveAvgPool2d

  // The stage whose output the layer is (res2: 0 ... res5: 3), -1 for the pooled output, -2 for
  // a trunk child named as it is (an EfficientNet's conv1, block<i>, conv_final).
  int stage() const {
    if (layer == "res5avg" || layer == "avgpool") return -1;
    return layer.size() == 4 && layer.rfind("res", 0) == 0 ? layer[3] - '2' : -2;
  }
  // Whether two pools read the same layer (res5avg and avgpool are one).
  bool same_layer(const FeaturePool& other) const {
    return stage() == other.stage() && (stage() != -2 || layer == other.layer);
  }

  // The trunk child whose output the layer is, of a trunk whose stages are `stages`
  // (nn::Trunk::stage_names: res2 -> ResNet's layer1, ... res5 -> layer4).
  std::string module(const std::vector<std::string>& stages) const {
    if (stage() == -1) return "avgpool";
    if (stage() == -2) return layer;
    const auto stage = static_cast<std::size_t>(this->stage());
    shardkit::check(stage < stages.size(), "feature ", layer, ": the trunk has ", stages.size(),
                    " stages (res2 to res", stages.size() + 1,
                    "); choose one of those in "
                    "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP");
    return stages[stage];
  }

  // The pooled [H', W'] of an [H, W] output.
  std::array<std::int64_t, 2> pooled(std::int64_t h, std::int64_t w) const {
    if (op == Op::identity) return {h, w};
    if (op == Op::adaptive_avg_pool) return output;
    std::array<std::int64_t, 2> out{};
    const std::int64_t in[2] = {h, w};
    for (int d = 0; d < 2; ++d) {
      out[d] = (in[d] + 2 * padding - kernel[d]) / stride + 1;
      shardkit::check(in[d] + 2 * padding >= kernel[d] && out[d] >= 1, "feature pooling: ", layer,
                      " is ", h, "x", w, ", smaller than AvgPool2d's ", kernel[0], "x", kernel[1],
                      " window (padding ", padding,
                      "); use a smaller kernel in "
                      "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP");
    }
    return out;
  }

  std::int64_t features(std::int64_t c, std::int64_t h, std::int64_t w) const {
    const auto p = pooled(h, w);
    return c * p[0] * p[1];
  }

  // Pools x (n images, [c, h, w] each) into out (n rows of features(c, h, w)).
  void apply(const float* x, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w,
             float* out) const {
    const auto [ph, pw] = pooled(h, w);
    for (std::int64_t plane = 0; plane < n * c; ++plane) {
      const float* in = x + plane * h * w;
      float* o = out + plane * ph * pw;
      if (op == Op::identity) {
        std::copy(in, in + h * w, o);
        continue;
      }
      for (std::int64_t i = 0; i < ph; ++i)
        for (std::int64_t j = 0; j < pw; ++j) {
          std::int64_t y0, y1, x0, x1, count;
          if (op == Op::adaptive_avg_pool) {
            y0 = i * h / ph, y1 = ((i + 1) * h + ph - 1) / ph;
            x0 = j * w / pw, x1 = ((j + 1) * w + pw - 1) / pw;
            count = (y1 - y0) * (x1 - x0);
          } else {  // the window over the padded input; padding adds zeros to the mean
            y0 = i * stride - padding, x0 = j * stride - padding;
            y1 = y0 + kernel[0], x1 = x0 + kernel[1];
            count = kernel[0] * kernel[1];
            y0 = std::max<std::int64_t>(y0, 0), x0 = std::max<std::int64_t>(x0, 0);
            y1 = std::min(y1, h), x1 = std::min(x1, w);
          }
          double sum = 0;
          for (std::int64_t y = y0; y < y1; ++y)
            for (std::int64_t x = x0; x < x1; ++x) sum += in[y * w + x];
          o[i * pw + j] = static_cast<float>(sum / double(count));
        }
    }
  }

  // "res5 AvgPool2d [6, 6] stride 1 padding 0" (a stream: GCC 12 warns falsely about chains
  // of std::string operator+).
  std::string text() const {
    std::ostringstream out;
    out << layer;
    if (op == Op::avg_pool)
      out << " AvgPool2d [" << kernel[0] << ", " << kernel[1] << "] stride " << stride
          << " padding " << padding;
    if (op == Op::adaptive_avg_pool)
      out << " AdaptiveAvgPool2d [" << output[0] << ", " << output[1] << "]";
    return out.str();
  }
};

}  // namespace swav
