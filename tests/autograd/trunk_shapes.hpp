// What every trunk's child_output_shape must agree with: the shapes a forward gives. Shared by
// the ResNet, RegNet and EfficientNet tests.
#pragma once

#include <doctest/doctest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/nn/trunk.hpp"

namespace shardkit::testing {

// Runs `images` (a batch of one, [1, C, H, W]) through `trunk` with a hook on each child and
// checks that child_output_shape(name, H, W) is the [C, H, W] the child returned; the children
// in `without_shape` (flatten, a classifier, dropout) must be refused by name instead. Returns
// how many children were compared, for the caller to check that none was missed.
inline int check_child_output_shapes(Context& ctx, nn::Trunk& trunk,
                                     const autograd::Variable& images,
                                     const std::set<std::string>& without_shape) {
  REQUIRE(images.shape().size() == 4);
  REQUIRE(images.shape()[0] == 1);
  const std::int64_t h = images.shape()[2], w = images.shape()[3];
  std::vector<std::pair<std::string, Shape>> seen;
  std::vector<std::pair<nn::Module*, nn::HookId>> hooks;
  for (const auto& [name, child] : trunk.children())
    hooks.emplace_back(child.get(), child->register_forward_hook(
                                        [&seen, name = name](nn::Module&, const autograd::Variable&,
                                                             const autograd::Variable& y) {
                                          seen.emplace_back(name, y.shape());
                                        }));
  (void)trunk(ctx, images);
  for (const auto& [child, id] : hooks) child->remove_hook(id);  // (they point at `seen`)
  int compared = 0;
  for (const auto& [name, shape] : seen) {
    CAPTURE(name);
    if (without_shape.contains(name)) {
      CHECK_THROWS_WITH(
          trunk.child_output_shape(name, h, w),
          doctest::Contains(("no child \"" + name + "\" with a [C, H, W] output").c_str()));
      continue;
    }
    const auto c = trunk.child_output_shape(name, h, w);
    CHECK(shape == Shape{1, c[0], c[1], c[2]});
    ++compared;
  }
  return compared;
}

}  // namespace shardkit::testing
