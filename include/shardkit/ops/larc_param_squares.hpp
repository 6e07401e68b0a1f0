// LarcParamSquares: each parameter's sum of squares as one larc_sgd_step left it, kept for the
// next step, whose norms pass then reads only the gradients.
//
// Why: LARC's trust ratio needs ||w|| and ||g|| of every tensor before that tensor's update, so
// a fused step reads w and g twice wherever a tensor is too large to stay cached between its
// norms and its update: 28 bytes per f32 parameter against plain SGD's 20. The update writes
// every w anyway; squaring the values it has just written, from L1, gives the next step's
// ||w||^2 without touching memory again, and that step moves 24 bytes per parameter.
//
// The sums describe the params only while nothing else writes them. The step checks that it is
// given the same param tensors (addresses and sizes) and recomputes the sums when not; what it
// cannot see is a write of your own, so call forget() after loading a checkpoint, broadcasting
// or averaging the params, or any other change to them between steps. With the sums or without
// them a step computes the same bits: the CPU update squares each chunk in the norms pass's
// lanes and order (cpu_apply.hpp); the GPU's sums depend on how its launcher lays a span's
// elements over threads (by the operands' common alignment), so it also keeps that layout and
// recomputes the sums when a step's params and grads would be walked otherwise.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "shardkit/core/tensor.hpp"
#include "shardkit/ops/spans.hpp"

namespace shardkit::ops {

class LarcParamSquares {
 public:
  // Drops the sums: the next step reads the params for its norms again.
  void forget() {
    sums_ = Tensor();
    params_.clear();
    walk_.clear();
  }

  // Whether sums are held (for whichever tensors the last step updated).
  bool holds() const { return sums_.defined(); }

  // -- For the backends --

  // Whether the sums describe these spans' params (operand 0): the same tensors, in order, and
  // summed in the way `walk` names (a backend's own key; empty where the sums do not depend on
  // anything but the values).
  template <int Depth>
  bool describes(const SpanList<Depth>& spans, const std::vector<std::int8_t>& walk = {}) const {
    if (!sums_.defined() || params_.size() != spans.size() || walk_ != walk) return false;
    for (std::size_t s = 0; s < spans.size(); ++s)
      if (params_[s] != std::pair<const void*, std::int64_t>{spans[s].data[0], spans[s].size})
        return false;
    return true;
  }

  // f64 [n] on the step's device: span s's sum of squares at s (the backend's own order).
  const Tensor& sums() const { return sums_; }

  // Keeps `sums` as those of the spans' params after the step that is ending.
  template <int Depth>
  void record(const SpanList<Depth>& spans, Tensor sums, std::vector<std::int8_t> walk = {}) {
    params_.resize(spans.size());
    for (std::size_t s = 0; s < spans.size(); ++s) params_[s] = {spans[s].data[0], spans[s].size};
    sums_ = std::move(sums);
    walk_ = std::move(walk);
  }

 private:
  Tensor sums_;
  std::vector<std::pair<const void*, std::int64_t>> params_;
  std::vector<std::int8_t> walk_;
};

}  // namespace shardkit::ops
