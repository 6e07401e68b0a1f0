// ParamLayout and FlatBuffer: offsets, alignment, views sharing one buffer, bad input.
#include <doctest/doctest.h>

#include <string>

#include "shardkit/parallel/flat_buffer.hpp"

namespace sk = shardkit;
using sk::shard::ParamLayout;
using sk::shard::ParamSpec;

TEST_CASE("parameters are laid out in order, each start aligned") {
  ParamLayout layout({{"a.weight", {3, 5}}, {"a.bias", {3}}, {"frozen", {7}, false}, {"b", {16}}});
  REQUIRE(layout.size() == 4);
  CHECK(layout[0].offset == 0);
  CHECK(layout[1].offset == 16);
  CHECK(layout[2].offset == 32);
  CHECK(layout[3].offset == 48);
  CHECK(layout.padded_numel() == 64);
  CHECK(layout.numel() == 15 + 3 + 7 + 16);
  CHECK(layout.trainable_numel() == 15 + 3 + 16);
  CHECK(layout.index_of("frozen") == 2);
  CHECK(layout.sizes() == std::vector<std::int64_t>{15, 3, 7, 16});
  ParamLayout packed({{"a", {3}}, {"b", {5}}}, 1);
  CHECK(packed[1].offset == 3);
  CHECK(packed.padded_numel() == 8);
}

TEST_CASE("the fingerprint tells layouts apart") {
  ParamLayout a({{"x", {4, 4}}, {"y", {4}}});
  ParamLayout same({{"x", {4, 4}}, {"y", {4}}});
  ParamLayout other_shape({{"x", {4, 3}}, {"y", {4}}});
  ParamLayout other_name({{"x", {4, 4}}, {"z", {4}}});
  ParamLayout other_flag({{"x", {4, 4}}, {"y", {4}, false}});
  CHECK(a.fingerprint() == same.fingerprint());
  CHECK(a.fingerprint() != other_shape.fingerprint());
  CHECK(a.fingerprint() != other_name.fingerprint());
  CHECK(a.fingerprint() != other_flag.fingerprint());
}

TEST_CASE("bad layouts are refused with the name and the fix") {
  try {
    ParamLayout({{"w", {2}}, {"w", {3}}});
    FAIL("no throw");
  } catch (const sk::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("'w' appears twice") != std::string::npos);
  }
  CHECK_THROWS_AS(ParamLayout({{"", {2}}}), sk::InvalidArgument);
  CHECK_THROWS_AS(ParamLayout({{"n", {-1}}}), sk::InvalidArgument);
  CHECK_THROWS_AS(ParamLayout({{"n", {1}}}).index_of("m"), sk::InvalidArgument);
}

TEST_CASE("a flat buffer hands out views of one allocation; padding is zero") {
  sk::Context ctx({.seed = 3});
  ParamLayout layout({{"w", {5, 3}}, {"b", {5}}, {"s", {1}}});
  sk::parallel::FlatBuffer params(ctx, layout, sk::DType::f32, sk::MemoryCategory::parameters);
  sk::parallel::FlatBuffer grads(ctx, layout, sk::DType::f32, sk::MemoryCategory::gradients);
  CHECK(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 4 * layout.padded_numel());
  CHECK(ctx.memory_stats().current(sk::MemoryCategory::gradients) == 4 * layout.padded_numel());
  for (std::size_t i = 0; i < params.size(); ++i) {
    CHECK(params[i].shares_storage(params.flat()));
    CHECK(params[i].shape() == layout[i].shape);
    sk::uniform_(ctx, params[i], 1.0, 2.0);
  }
  CHECK(params.at("b").data<float>() == params.flat().data<float>() + 16);
  const auto all = sk::to_vector<float>(ctx, params.flat());
  for (std::int64_t e = 0; e < layout.padded_numel(); ++e) {
    bool inside = false;
    for (const auto& slot : layout.slots())
      inside |= e >= slot.offset && e < slot.offset + slot.numel;
    CHECK((inside ? all[e] >= 1.0f : all[e] == 0.0f));
  }
  CHECK(sk::to_vector<float>(ctx, params.range(16, 21)) == sk::to_vector<float>(ctx, params[1]));
}
