// SmallVector<T, N>: a vector of trivially copyable elements whose first N live inside the
// object. A Tensor's shape and strides are two of them (Shape): every op makes and copies
// tensors, and as std::vectors their shapes were seven of the thirteen heap allocations of a
// small autograd op's forward (docs/performance.md, "Host cost per op"); a tensor of up to N
// dimensions now allocates none for them. Past N elements it moves to the heap like a vector.
//
// The interface is std::vector's subset that shardkit uses, and it converts to and from
// std::vector<T> (which allocates, as a vector does) for code that takes or gives one.
#pragma once

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace shardkit {

template <class T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "SmallVector copies its elements as bytes");
  static_assert(N > 0, "SmallVector needs room for at least one element inside");

 public:
  using value_type = T;
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;
  using reference = T&;
  using const_reference = const T&;
  using pointer = T*;
  using const_pointer = const T*;
  using iterator = T*;
  using const_iterator = const T*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  SmallVector() noexcept = default;
  explicit SmallVector(size_type count) { resize(count); }
  SmallVector(size_type count, const T& value) { assign(count, value); }
  SmallVector(std::initializer_list<T> values) { assign(values.begin(), values.end()); }
  template <class It, class = typename std::iterator_traits<It>::iterator_category>
  SmallVector(It first, It last) {
    assign(first, last);
  }
  // (implicit, like the vector it stands in for)
  SmallVector(const std::vector<T>& values) { assign(values.begin(), values.end()); }

  SmallVector(const SmallVector& other) { assign(other.begin(), other.end()); }
  SmallVector(SmallVector&& other) noexcept { take(other); }
  SmallVector& operator=(const SmallVector& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  SmallVector& operator=(std::initializer_list<T> values) {
    assign(values.begin(), values.end());
    return *this;
  }
  ~SmallVector() { release(); }

  operator std::vector<T>() const { return std::vector<T>(begin(), end()); }

  void assign(size_type count, const T& value) {
    const T copy = value;  // (value may be one of ours)
    clear();
    resize(count, copy);
  }
  template <class It, class = typename std::iterator_traits<It>::iterator_category>
  void assign(It first, It last) {
    clear();
    if constexpr (std::is_base_of_v<std::forward_iterator_tag,
                                    typename std::iterator_traits<It>::iterator_category>) {
      reserve(static_cast<size_type>(std::distance(first, last)));
      for (; first != last; ++first) data_[size_++] = static_cast<T>(*first);
    } else {
      for (; first != last; ++first) push_back(static_cast<T>(*first));
    }
  }

  size_type size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  size_type capacity() const noexcept { return capacity_; }
  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }

  iterator begin() noexcept { return data_; }
  iterator end() noexcept { return data_ + size_; }
  const_iterator begin() const noexcept { return data_; }
  const_iterator end() const noexcept { return data_ + size_; }
  const_iterator cbegin() const noexcept { return data_; }
  const_iterator cend() const noexcept { return data_ + size_; }
  reverse_iterator rbegin() noexcept { return reverse_iterator(end()); }
  reverse_iterator rend() noexcept { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const noexcept { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const noexcept { return const_reverse_iterator(begin()); }

  T& operator[](size_type i) noexcept { return data_[i]; }
  const T& operator[](size_type i) const noexcept { return data_[i]; }
  T& at(size_type i) {
    if (i >= size_) throw std::out_of_range("SmallVector::at: index past the end");
    return data_[i];
  }
  const T& at(size_type i) const {
    if (i >= size_) throw std::out_of_range("SmallVector::at: index past the end");
    return data_[i];
  }
  T& front() noexcept { return data_[0]; }
  const T& front() const noexcept { return data_[0]; }
  T& back() noexcept { return data_[size_ - 1]; }
  const T& back() const noexcept { return data_[size_ - 1]; }

  void reserve(size_type wanted) {
    if (wanted <= capacity_) return;
    const size_type grown = std::max(wanted, 2 * capacity_);
    T* heap = std::allocator<T>().allocate(grown);
    if (size_ != 0) std::memcpy(heap, data_, size_ * sizeof(T));
    release();
    data_ = heap;
    capacity_ = grown;
  }
  void resize(size_type count) { resize(count, T{}); }
  void resize(size_type count, const T& value) {
    const T copy = value;  // (value may be one of ours, which reserve moves)
    reserve(count);
    for (size_type i = size_; i < count; ++i) data_[i] = copy;
    size_ = count;
  }
  void clear() noexcept { size_ = 0; }
  void push_back(const T& value) {
    if (size_ == capacity_) {
      const T copy = value;  // (value may be one of ours, which reserve moves)
      reserve(size_ + 1);
      data_[size_++] = copy;
      return;
    }
    data_[size_++] = value;
  }
  template <class... Args>
  T& emplace_back(Args&&... args) {
    push_back(T(std::forward<Args>(args)...));
    return back();
  }
  void pop_back() noexcept { --size_; }

  iterator insert(const_iterator position, const T& value) { return insert(position, 1, value); }
  iterator insert(const_iterator position, size_type count, const T& value) {
    const T copy = value;
    const auto at = static_cast<size_type>(position - data_);
    reserve(size_ + count);
    std::memmove(data_ + at + count, data_ + at, (size_ - at) * sizeof(T));
    std::fill_n(data_ + at, count, copy);
    size_ += count;
    return data_ + at;
  }
  template <class It, class = typename std::iterator_traits<It>::iterator_category>
  iterator insert(const_iterator position, It first, It last) {
    const auto at = static_cast<size_type>(position - data_);
    const SmallVector values(first, last);  // (the range may be in this vector)
    reserve(size_ + values.size());
    std::memmove(data_ + at + values.size(), data_ + at, (size_ - at) * sizeof(T));
    std::copy(values.begin(), values.end(), data_ + at);
    size_ += values.size();
    return data_ + at;
  }
  iterator insert(const_iterator position, std::initializer_list<T> values) {
    return insert(position, values.begin(), values.end());
  }
  iterator erase(const_iterator position) { return erase(position, position + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const auto at = static_cast<size_type>(first - data_);
    const auto count = static_cast<size_type>(last - first);
    std::memmove(data_ + at, data_ + at + count, (size_ - at - count) * sizeof(T));
    size_ -= count;
    return data_ + at;
  }

  void swap(SmallVector& other) noexcept {
    SmallVector held(std::move(other));
    other = std::move(*this);
    *this = std::move(held);
  }
  friend void swap(SmallVector& a, SmallVector& b) noexcept { a.swap(b); }

  friend bool operator==(const SmallVector& a, const SmallVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend auto operator<=>(const SmallVector& a, const SmallVector& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool on_heap() const noexcept { return data_ != inline_; }
  void release() noexcept {
    if (on_heap()) std::allocator<T>().deallocate(data_, capacity_);
    data_ = inline_;
    capacity_ = N;
  }
  // Takes other's elements and leaves it empty (other holds no heap memory afterwards).
  void take(SmallVector& other) noexcept {
    if (other.on_heap()) {
      data_ = other.data_;
      capacity_ = other.capacity_;
    } else {
      std::memcpy(inline_, other.inline_, other.size_ * sizeof(T));
    }
    size_ = other.size_;
    other.data_ = other.inline_;
    other.capacity_ = N;
    other.size_ = 0;
  }

  T* data_ = inline_;
  size_type size_ = 0;
  size_type capacity_ = N;
  T inline_[N];
};

}  // namespace shardkit
