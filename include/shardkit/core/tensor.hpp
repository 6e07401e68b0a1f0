// Tensor: a strided view (shape, strides, element offset, dtype) of a Storage. Views share the
// storage; flat parameter buffers hand out each parameter as a view of one allocation.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/small_vector.hpp"
#include "shardkit/core/storage.hpp"

namespace shardkit {

// A tensor's sizes or strides. Up to six dimensions live inside the tensor (SmallVector): making
// and copying tensors is what every op does, and no shape of this kind touches the heap.
using Shape = SmallVector<std::int64_t, 6>;

inline std::int64_t shape_numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

// A shape as messages print it, "[2, 3]" ("undefined" for none), formatted only when streamed.
// Checks take it among their message parts (shape_text) so that a check that passes costs a
// comparison, not a string: every op runs several, and building their messages eagerly was
// 70% of a small op's host time. It refers to the shape: use it within the expression that
// makes it, as a message part.
class ShapeText {
 public:
  explicit ShapeText(const Shape* shape) : shape_(shape) {}
  static ShapeText undefined() { return ShapeText(nullptr); }
  friend std::ostream& operator<<(std::ostream& out, const ShapeText& text) {
    if (text.shape_ == nullptr) return out << "undefined";
    out << '[';
    for (std::size_t i = 0; i < text.shape_->size(); ++i)
      out << (i ? ", " : "") << (*text.shape_)[i];
    return out << ']';
  }

 private:
  const Shape* shape_;
};

inline ShapeText shape_text(const Shape& shape) { return ShapeText(&shape); }

inline std::string shape_str(const Shape& shape) {
  std::ostringstream out;
  out << shape_text(shape);
  return out.str();
}

// Refuses a shape with a negative size, naming the shape and the dimension: every tensor's
// constructor checks it, and so does the allocation that precedes one (tensor_ops.hpp), so that
// a wrong size is refused before memory is taken.
inline void check_sizes(const Shape& shape) {
  for (std::size_t i = 0; i < shape.size(); ++i)
    check(shape[i] >= 0, "Tensor shape ", shape_text(shape), " has a negative size at dim ", i);
}

// Row-major (C order) strides of a shape, in elements.
inline Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  std::int64_t stride = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

class Tensor {
 public:
  Tensor() = default;  // undefined: no storage

  // A contiguous tensor over `storage` starting at element `offset`.
  Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, std::int64_t offset = 0)
      : Tensor(std::move(storage), shape, contiguous_strides(shape), dtype, offset) {}

  Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, DType dtype,
         std::int64_t offset)
      : storage_(std::move(storage)),
        shape_(std::move(shape)),
        strides_(std::move(strides)),
        offset_(offset),
        dtype_(dtype) {
    check(storage_ != nullptr, "Tensor needs a storage; got none");
    check(shape_.size() == strides_.size(), "Tensor shape ", shape_text(shape_), " and strides ",
          shape_text(strides_), " differ in rank");
    check(offset_ >= 0, "Tensor offset must be >= 0, got ", offset_);
    check_sizes(shape_);
    check_fits_storage();
  }

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t dim() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size(std::int64_t d) const { return shape_[static_cast<std::size_t>(wrap_dim(d))]; }
  std::int64_t stride(std::int64_t d) const {
    return strides_[static_cast<std::size_t>(wrap_dim(d))];
  }
  std::int64_t offset() const { return offset_; }
  std::int64_t numel() const { return shape_numel(shape_); }
  std::size_t element_size() const { return dtype_size(dtype_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(); }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  bool is_contiguous() const {
    std::int64_t expected = 1;
    for (std::size_t i = shape_.size(); i-- > 0;) {
      if (shape_[i] == 1) continue;  // a size-1 dim's stride never matters
      if (strides_[i] != expected) return false;
      expected *= shape_[i];
    }
    return true;
  }

  bool shares_storage(const Tensor& other) const { return storage_ && storage_ == other.storage_; }

  // Address of element [0, 0, ...].
  void* data_ptr() const {
    check(defined(), "data_ptr() of an undefined tensor");
    return static_cast<char*>(storage_->data()) +
           offset_ * static_cast<std::int64_t>(element_size());
  }

  template <class T>
  T* data() const {
    check(dtype_of<T> == dtype_, "Tensor::data<", dtype_name(dtype_of<T>), ">() on a ",
          dtype_name(dtype_), " tensor; ask for the tensor's own element type");
    return static_cast<T*>(data_ptr());
  }

  // Same elements, new shape (one entry may be -1 to infer it). Needs a contiguous tensor.
  Tensor view(Shape shape) const {
    check(is_contiguous(), "view(", shape_text(shape), ") of a non-contiguous tensor with shape ",
          shape_text(shape_), " and strides ", shape_text(strides_),
          "; make it contiguous first (sk::contiguous)");
    std::int64_t known = 1;
    int inferred = -1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] == -1) {
        check(inferred < 0, "view(", shape_text(shape), "): only one dimension may be -1");
        inferred = static_cast<int>(i);
      } else {
        check(shape[i] >= 0, "view(", shape_text(shape), "): sizes must be >= 0 or -1");
        known *= shape[i];
      }
    }
    if (inferred >= 0) {
      check(known > 0 && numel() % known == 0, "view(", shape_text(shape), ") cannot infer -1 for ",
            numel(), " elements");
      shape[static_cast<std::size_t>(inferred)] = numel() / known;
    }
    check(shape_numel(shape) == numel(), "view(", shape_text(shape), ") has ", shape_numel(shape),
          " elements but the tensor ", shape_text(shape_), " has ", numel());
    return Tensor(storage_, std::move(shape), dtype_, offset_);
  }

  // Elements [start, end) of dimension `d`, every `step`-th one.
  Tensor slice(std::int64_t d, std::int64_t start, std::int64_t end, std::int64_t step = 1) const {
    d = wrap_dim(d);
    const auto index = static_cast<std::size_t>(d);
    check(step > 0, "slice step must be > 0, got ", step);
    check(0 <= start && start <= end && end <= shape_[index], "slice [", start, ", ", end,
          ") of dim ", d, " is outside the size ", shape_[index], " of tensor ",
          shape_text(shape_));
    Shape shape = shape_, strides = strides_;
    shape[index] = (end - start + step - 1) / step;
    strides[index] *= step;
    return Tensor(storage_, std::move(shape), std::move(strides), dtype_,
                  offset_ + start * strides_[index]);
  }

  // Removes dimension `d`, keeping index `i` of it.
  Tensor select(std::int64_t d, std::int64_t i) const {
    d = wrap_dim(d);
    const auto index = static_cast<std::size_t>(d);
    check(0 <= i && i < shape_[index], "select index ", i, " out of range for dim ", d, " of size ",
          shape_[index]);
    Shape shape = shape_, strides = strides_;
    shape.erase(shape.begin() + d);
    strides.erase(strides.begin() + d);
    return Tensor(storage_, std::move(shape), std::move(strides), dtype_,
                  offset_ + i * strides_[index]);
  }

  Tensor transpose(std::int64_t d0, std::int64_t d1) const {
    d0 = wrap_dim(d0);
    d1 = wrap_dim(d1);
    Shape shape = shape_, strides = strides_;
    std::swap(shape[static_cast<std::size_t>(d0)], shape[static_cast<std::size_t>(d1)]);
    std::swap(strides[static_cast<std::size_t>(d0)], strides[static_cast<std::size_t>(d1)]);
    return Tensor(storage_, std::move(shape), std::move(strides), dtype_, offset_);
  }

  // A contiguous view of `shape` starting `first` elements into this contiguous tensor: how a
  // flat buffer hands out one parameter.
  Tensor flat_view(std::int64_t first, Shape shape) const {
    check(is_contiguous(), "flat_view of a non-contiguous tensor ", shape_text(shape_));
    const std::int64_t count = shape_numel(shape);
    check(first >= 0 && count >= 0 && first + count <= numel(), "flat_view of ", count,
          " elements at ", first, " does not fit in a tensor of ", numel(), " elements");
    return Tensor(storage_, std::move(shape), dtype_, offset_ + first);
  }

  // "Tensor(f32, [2, 3], cpu)".
  std::string str() const {
    std::ostringstream out;
    out << *this;
    return out.str();
  }
  friend std::ostream& operator<<(std::ostream& out, const Tensor& t) {
    return out << "Tensor(" << dtype_name(t.dtype_) << ", " << shape_text(t.shape_) << ", "
               << t.device() << ")";
  }

 private:
  std::int64_t wrap_dim(std::int64_t d) const {
    const auto rank = dim();
    check(-rank <= d && d < rank, "dimension ", d, " out of range for a tensor of rank ", rank);
    return d < 0 ? d + rank : d;
  }

  // Every reachable element must lie inside the storage: a wrong view is caught at creation,
  // not as memory corruption later.
  void check_fits_storage() const {
    if (numel() == 0) return;
    std::int64_t last = offset_;
    for (std::size_t i = 0; i < shape_.size(); ++i) {
      check(strides_[i] >= 0, "negative strides are not supported (dim ", i, ")");
      last += (shape_[i] - 1) * strides_[i];
    }
    const auto capacity = static_cast<std::int64_t>(storage_->bytes() / dtype_size(dtype_));
    check(last < capacity, "tensor view ", shape_text(shape_), " with strides ",
          shape_text(strides_), " at offset ", offset_, " reaches element ", last,
          " but its storage holds ", capacity, " ", dtype_name(dtype_), " elements");
  }

  std::shared_ptr<Storage> storage_;
  Shape shape_;
  Shape strides_;
  std::int64_t offset_ = 0;
  DType dtype_ = DType::f32;
};

// A tensor as messages print it (Tensor::str), or `otherwise` when it is undefined or absent: a
// message part formatted only when a failed check streams it (ShapeText says why).
class TensorText {
 public:
  TensorText(const Tensor* t, const char* otherwise) : t_(t), otherwise_(otherwise) {}
  friend std::ostream& operator<<(std::ostream& out, const TensorText& text) {
    if (text.t_ == nullptr || !text.t_->defined()) return out << text.otherwise_;
    return out << *text.t_;
  }

 private:
  const Tensor* t_;
  const char* otherwise_;
};

inline TensorText tensor_text(const Tensor& t, const char* otherwise = "an undefined tensor") {
  return TensorText(&t, otherwise);
}

namespace detail {

// The bytes a tensor's elements can touch, [first, last); `t` holds at least one element.
inline std::pair<const char*, const char*> byte_span(const Tensor& t) {
  std::int64_t low = 0, high = 0;
  for (std::size_t d = 0; d < t.shape().size(); ++d)
    (t.strides()[d] < 0 ? low : high) += (t.shape()[d] - 1) * t.strides()[d];
  const auto* base = static_cast<const char*>(t.data_ptr());
  const auto size = static_cast<std::int64_t>(t.element_size());
  return {base + low * size, base + (high + 1) * size};
}

}  // namespace detail

}  // namespace shardkit
