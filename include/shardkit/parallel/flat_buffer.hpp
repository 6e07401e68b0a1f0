// FlatBuffer: one contiguous allocation holding every parameter of a ParamLayout, handing each
// out as a Tensor view. A gradient twin uses the same layout, so parameter i and its gradient
// sit at the same offset of their buffers.
#pragma once

#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/shard/param_layout.hpp"

namespace shardkit::parallel {

class FlatBuffer {
 public:
  FlatBuffer() = default;

  // Allocates layout.padded_numel() elements on the context's device, counted under
  // `category`. The padding between parameters is zeroed so whole-buffer reductions (norms,
  // all-reduces) see no garbage.
  FlatBuffer(Context& ctx, const shard::ParamLayout& layout, DType dtype, MemoryCategory category)
      : layout_(&layout), flat_(empty(ctx, {layout.padded_numel()}, dtype, category)) {
    fill(ctx, flat_, 0.0);
    views_.reserve(layout.size());
    for (const auto& slot : layout.slots())
      views_.push_back(flat_.flat_view(slot.offset, slot.shape));
  }

  bool defined() const { return flat_.defined(); }
  const shard::ParamLayout& layout() const { return *layout_; }
  const Tensor& flat() const { return flat_; }  // the whole buffer, 1-D
  const Tensor& operator[](std::size_t i) const { return views_[i]; }
  const Tensor& at(const std::string& name) const { return views_[layout_->index_of(name)]; }
  std::size_t size() const { return views_.size(); }
  DType dtype() const { return flat_.dtype(); }

  // Elements [begin, end) of the flat buffer (a shard, a bucket) as a 1-D view.
  Tensor range(std::int64_t begin, std::int64_t end) const { return flat_.slice(0, begin, end); }

 private:
  const shard::ParamLayout* layout_ = nullptr;  // the layout outlives its buffers
  Tensor flat_;
  std::vector<Tensor> views_;
};

}  // namespace shardkit::parallel
