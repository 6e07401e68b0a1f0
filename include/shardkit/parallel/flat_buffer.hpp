// FlatBuffer: one contiguous allocation holding every parameter of a ParamLayout, handing each
// out as a Tensor view. A gradient twin uses the same layout, so parameter i and its gradient
// sit at the same offset of their buffers.
#pragma once

#include <string>
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
    make_views();
  }

  // The same buffer without memory yet, as if released with `reason` (core/storage.hpp): a
  // buffer whole only between its storage's materialize() and release() (fsdp's units), whose
  // contents are written whole each time it is made whole.
  FlatBuffer(Context& ctx, const shard::ParamLayout& layout, DType dtype, MemoryCategory category,
             std::string reason)
      : layout_(&layout),
        flat_(make_pooled<Storage>(
                  Storage::Released{}, ctx.allocator_ptr(),
                  static_cast<std::size_t>(layout.padded_numel()) * dtype_size(dtype), category,
                  std::move(reason)),
              Shape{layout.padded_numel()}, dtype) {
    make_views();
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
  void make_views() {
    views_.reserve(layout_->size());
    for (const auto& slot : layout_->slots())
      views_.push_back(flat_.flat_view(slot.offset, slot.shape));
  }

  const shard::ParamLayout* layout_ = nullptr;  // the layout outlives its buffers
  Tensor flat_;
  std::vector<Tensor> views_;
};

}  // namespace shardkit::parallel
