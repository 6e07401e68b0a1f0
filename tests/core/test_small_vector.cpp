// SmallVector (a tensor's Shape): elements inside the object up to N, on the heap past it, with
// std::vector's behaviour either way -- checked against a std::vector doing the same edits.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "shardkit/core/small_vector.hpp"
#include "shardkit/core/tensor.hpp"

namespace sk = shardkit;
using Small = sk::SmallVector<std::int64_t, 4>;

namespace {

void check_same(const Small& small, const std::vector<std::int64_t>& reference) {
  REQUIRE(small.size() == reference.size());
  for (std::size_t i = 0; i < reference.size(); ++i) CHECK(small[i] == reference[i]);
  CHECK(std::vector<std::int64_t>(small) == reference);
}

}  // namespace

TEST_CASE("SmallVector keeps up to N elements inside and moves to the heap past them") {
  Small v{1, 2, 3, 4};
  CHECK(v.capacity() == 4);
  const std::int64_t* inside = v.data();
  v.push_back(v[0]);  // an element of its own, while it moves to the heap
  CHECK(v.data() != inside);
  CHECK(v.capacity() >= 5);
  check_same(v, {1, 2, 3, 4, 1});

  // Copies and moves in both states; a moved-from vector is empty and usable.
  Small heap_copy = v, inline_copy{7, 8};
  check_same(heap_copy, {1, 2, 3, 4, 1});
  Small moved = std::move(heap_copy);
  check_same(moved, {1, 2, 3, 4, 1});
  CHECK(heap_copy.empty());
  heap_copy.push_back(9);
  check_same(heap_copy, {9});
  Small moved_inline = std::move(inline_copy);
  check_same(moved_inline, {7, 8});
  moved_inline = std::move(moved);  // inline <- heap
  check_same(moved_inline, {1, 2, 3, 4, 1});
  moved_inline = Small{5};  // heap <- inline
  check_same(moved_inline, {5});
  swap(moved_inline, v);
  check_same(v, {5});
  check_same(moved_inline, {1, 2, 3, 4, 1});

  // Filled with one of its own elements while it moves to the heap, and assigned to itself.
  Small fill{6, 7};
  fill.resize(9, fill[1]);
  check_same(fill, {6, 7, 7, 7, 7, 7, 7, 7, 7});
  fill.assign(12, fill[0]);
  check_same(fill, std::vector<std::int64_t>(12, 6));
  Small grow{1, 2, 3};
  grow.insert(grow.begin() + 1, 4, grow[2]);
  check_same(grow, {1, 3, 3, 3, 3, 2, 3});
  const Small& same = grow;
  grow = same;
  check_same(grow, {1, 3, 3, 3, 3, 2, 3});

  CHECK(Small{1, 2} == Small(std::vector<std::int64_t>{1, 2}));
  CHECK(Small{1, 2} < Small{1, 3});
  CHECK(Small{1, 2} != Small{1, 2, 0});
  CHECK_THROWS_AS((void)Small{1}.at(1), std::out_of_range);
}

TEST_CASE("SmallVector's edits match std::vector's over random sequences") {
  std::mt19937 random(5);
  for (int trial = 0; trial < 200; ++trial) {
    Small small;
    std::vector<std::int64_t> reference;
    for (int step = 0; step < 40; ++step) {
      const auto value = static_cast<std::int64_t>(random() % 100);
      const std::size_t at = reference.empty() ? 0 : random() % (reference.size() + 1);
      switch (random() % 7) {
        case 0:
        case 1:
          small.push_back(value);
          reference.push_back(value);
          break;
        case 2:
          small.insert(small.begin() + static_cast<std::ptrdiff_t>(at), value);
          reference.insert(reference.begin() + static_cast<std::ptrdiff_t>(at), value);
          break;
        case 3:
          if (at < reference.size()) {
            small.erase(small.begin() + static_cast<std::ptrdiff_t>(at));
            reference.erase(reference.begin() + static_cast<std::ptrdiff_t>(at));
          }
          break;
        case 4: {
          const std::size_t count = random() % 6;
          small.resize(count, value);
          reference.resize(count, value);
          break;
        }
        case 5: {  // a range of its own elements, inserted into itself
          const std::vector<std::int64_t> part(reference.begin(),
                                               reference.begin() + static_cast<std::ptrdiff_t>(at));
          small.insert(small.begin(), small.begin(),
                       small.begin() + static_cast<std::ptrdiff_t>(at));
          reference.insert(reference.begin(), part.begin(), part.end());
          break;
        }
        default:
          if (!reference.empty()) {
            small.pop_back();
            reference.pop_back();
          }
      }
      check_same(small, reference);
    }
  }
}

TEST_CASE("a tensor's shape up to six dimensions lives inside the tensor") {
  sk::Context ctx;
  const sk::Tensor t = sk::empty(ctx, {2, 3, 4, 5, 6, 7}, sk::DType::f32);
  const sk::Tensor copy = t;
  CHECK(copy.shape() == t.shape());
  CHECK(copy.shape().data() != t.shape().data());
  CHECK(reinterpret_cast<const char*>(copy.shape().data()) >= reinterpret_cast<const char*>(&copy));
  CHECK(reinterpret_cast<const char*>(copy.shape().data()) <
        reinterpret_cast<const char*>(&copy) + sizeof(copy));
  const sk::Tensor seven = sk::empty(ctx, {1, 2, 1, 2, 1, 2, 3}, sk::DType::f32);  // past it
  CHECK(seven.numel() == 24);
  CHECK(seven.view({24}).shape() == sk::Shape{24});
  CHECK(seven.strides() == sk::Shape{24, 12, 12, 6, 6, 3, 1});
}
