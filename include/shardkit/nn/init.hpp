// PyTorch's default initialisations, drawn from the context's Philox stream (sk::uniform_), so
// a model built with the same seed holds the same numbers on the CPU and on a GPU.
#pragma once

#include <cmath>

#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::nn::init {

// fan_in of a [out, in, kh, kw] or [out, in] weight.
inline std::int64_t fan_in(const Tensor& weight) {
  std::int64_t receptive = 1;
  for (std::int64_t d = 2; d < weight.dim(); ++d) receptive *= weight.size(d);
  return weight.size(1) * receptive;
}
inline std::int64_t fan_out(const Tensor& weight) {
  std::int64_t receptive = 1;
  for (std::int64_t d = 2; d < weight.dim(); ++d) receptive *= weight.size(d);
  return weight.size(0) * receptive;
}

// kaiming_uniform_(w, a=sqrt(5)) as nn.Linear / nn.Conv2d reset_parameters do: the bound
// gain * sqrt(3 / fan_in) with gain sqrt(2 / (1 + 5)) is 1 / sqrt(fan_in).
inline void default_weight_(Context& ctx, const Tensor& weight) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in(weight)));
  uniform_(ctx, weight, -bound, bound);
}

// Bias of nn.Linear / nn.Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
inline void default_bias_(Context& ctx, const Tensor& bias, const Tensor& weight) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in(weight)));
  uniform_(ctx, bias, -bound, bound);
}

// torchvision's ResNet re-initialisation of conv weights: kaiming_normal_(mode='fan_out',
// nonlinearity='relu'), std = sqrt(2 / fan_out).
inline void kaiming_normal_fan_out_(Context& ctx, const Tensor& weight) {
  normal_(ctx, weight, 0.0, std::sqrt(2.0 / static_cast<double>(fan_out(weight))));
}

}  // namespace shardkit::nn::init
