// Sequential: children run in order, named "0", "1", ... or by the caller; optionally split into
// N checkpointed segments (VISSL's NUM_ACTIVATION_CHECKPOINTING_SPLITS, PyTorch's
// checkpoint_sequential: every segment but the last keeps only its input). Segments are cut
// over "units": children, with nested hook-free Sequentials (ResNet's layer1..4) opened up into
// their blocks, so that the segments can balance memory.
#pragma once

#include <string>

#include "shardkit/nn/activation_checkpoint.hpp"
#include "shardkit/nn/layers.hpp"
#include "shardkit/nn/module.hpp"

namespace shardkit::nn {

class Sequential : public Module {
 public:
  const char* type_name() const override { return "Sequential"; }

  // Appends `module` named by its position (as nn.Sequential(*modules) names them).
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    return add(std::to_string(children().size()), std::move(module));
  }
  // Appends `module` under `name` (as nn.Sequential(OrderedDict) or a model's attributes).
  template <class M>
  std::shared_ptr<M> add(std::string name, std::shared_ptr<M> module) {
    return register_module(std::move(name), std::move(module));
  }
  std::size_t size() const { return children().size(); }
  Module& at(std::size_t i) const { return *children().at(i).second; }

  // Splits the children into `segments` contiguous ranges (0 = off) for checkpointing.
  void set_checkpoint_segments(int segments) {
    check(segments >= 0, "set_checkpoint_segments(", segments, "): must be >= 0");
    segments_ = segments;
  }
  int checkpoint_segments() const { return segments_; }

  // Children [first, last) on x, no checkpointing.
  Variable forward_range(Context& ctx, std::size_t first, std::size_t last, const Variable& x) {
    Variable y = x;
    for (std::size_t i = first; i < last; ++i) y = at(i)(ctx, y);
    return y;
  }

  // Children [first, last) on x, keeping only x (recomputed in backward).
  Variable checkpoint_range(Context& ctx, std::size_t first, std::size_t last, const Variable& x) {
    if (first > last || last > size())
      fail<InvalidArgument>("checkpoint_range [", first, ", ", last, ") is outside the ", size(),
                            " children of ", path().empty() ? type_name() : path());
    std::vector<Variable> params;
    for (std::size_t i = first; i < last; ++i)
      for (auto& p : at(i).parameters()) params.push_back(p);
    return checkpoint(
        ctx,
        [this, first, last](Context& c, const Variable& in) {
          return forward_range(c, first, last, in);
        },
        x, params);
  }

  // The modules a checkpointed forward runs in order (see the file comment).
  std::vector<Module*> units() const {
    std::vector<Module*> out;
    for (auto& [name, child] : children()) {
      auto* nested = dynamic_cast<Sequential*>(child.get());
      if (nested != nullptr && !nested->has_hooks() && nested->segments_ == 0) {
        auto inner = nested->units();
        out.insert(out.end(), inner.begin(), inner.end());
      } else {
        out.push_back(child.get());
      }
    }
    return out;
  }

  Variable forward(Context& ctx, const Variable& x) override {
    const std::size_t n = size();
    if (segments_ <= 1 || n == 0 || !autograd::tape(ctx).grad_enabled())
      return forward_range(ctx, 0, n, x);
    const std::vector<Module*> all = units();
    const std::size_t count =
        std::min<std::size_t>(static_cast<std::size_t>(segments_), all.size());
    Variable y = x;
    std::size_t first = 0;
    for (std::size_t s = 0; s < count; ++s) {
      const std::size_t last = all.size() * (s + 1) / count;
      std::vector<Module*> segment(all.begin() + static_cast<std::ptrdiff_t>(first),
                                   all.begin() + static_cast<std::ptrdiff_t>(last));
      auto run = [segment](Context& c, const Variable& in) {
        Variable out = in;
        for (Module* m : segment) out = (*m)(c, out);
        return out;
      };
      if (s + 1 < count) {
        std::vector<Variable> params;
        for (Module* m : segment)
          for (auto& p : m->parameters()) params.push_back(p);
        y = checkpoint(ctx, run, y, params);
      } else {
        y = run(ctx, y);
      }
      first = last;
    }
    return y;
  }

 private:
  int segments_ = 0;
};

// Linear -> BatchNorm1d -> ReLU -> Linear: the SwAV / SimCLR projection head
// (children "0".."3", as in nn.Sequential).
inline std::shared_ptr<Sequential> mlp_head(Context& ctx, std::int64_t in_features,
                                            std::int64_t hidden, std::int64_t out_features,
                                            DType dtype = DType::f32) {
  auto head = std::make_shared<Sequential>();
  head->push_back(std::make_shared<Linear>(ctx, in_features, hidden, true, dtype));
  head->push_back(std::make_shared<BatchNorm>(ctx, hidden, 1, dtype));
  head->push_back(std::make_shared<ReLU>());
  head->push_back(std::make_shared<Linear>(ctx, hidden, out_features, true, dtype));
  return head;
}

}  // namespace shardkit::nn
