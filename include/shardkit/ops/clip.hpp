// Gradient clipping's arithmetic (torch.nn.utils.clip_grad_norm_, docs/semantics.md), one
// function for the host and the device: from the gradients' total sum of squares (still in the
// loss-scaled units) the global norm, and the factor the next step multiplies the gradients by.
#pragma once

#include <cmath>

#include "shardkit/core/config.hpp"
#include "shardkit/ops/element.hpp"

namespace shardkit::ops {

struct ClipResult {
  double norm;        // the global L2 norm, unscaled
  float coefficient;  // max_norm / (norm + 1e-6) where that is below 1 (or NaN), else 1
};

// In double from the exact sum; a NaN norm gives a NaN coefficient, an infinite one 0, as
// PyTorch's do (the step then shows it).
SK_HOST_DEVICE SK_INLINE ClipResult clip_result(double total, double max_norm,
                                                float inv_grad_scale) {
  // (Not contracted with the addition below into a fused multiply-add: the host's bits.)
  const double norm = mul_rn(sqrt(total), static_cast<double>(inv_grad_scale));
  const double coefficient = max_norm / (norm + 1e-6);
  const bool clips = coefficient < 1.0 || coefficient != coefficient;
  return {norm, clips ? static_cast<float>(coefficient) : 1.0f};
}

}  // namespace shardkit::ops
