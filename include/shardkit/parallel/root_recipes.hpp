// Rank root's recipes on every rank: what lets each rank make the values of rank root's deferred
// parameters itself (core/deferred_init.hpp), only the range it keeps, instead of receiving
// them whole by broadcast. One collective of a few dozen bytes per parameter replaces one of the
// parameters' own bytes, and under fsdp no rank ever holds a unit whole at the wrap.
//
// A recipe is the constant, or the Philox seed and counter base, plus the dtype the tensor was
// built in: the same numbers on every rank and device, so a rank's range equals rank root's
// tensor's elements bit for bit (PyTorch's DTensor random ops give a sharded init the values of
// the unsharded one the same way, by offsets into one stream). Ranks seeded differently still
// get rank root's values.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/deferred_init.hpp"

namespace shardkit::parallel {

// How to make one parameter's values: its recipe and the dtype it was built in.
struct ParamRecipe {
  InitRecipe recipe;
  DType dtype = DType::f32;
};

namespace detail {

// One parameter's entry on the wire, as plain bytes (a u8 broadcast travels on every
// communicator).
struct RecipeEntry {
  std::uint8_t present = 0;  // 1: rank root's parameter is deferred and all of its storage
  std::uint8_t kind = 0;     // InitRecipe::Kind
  std::uint8_t random_kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t unused[4] = {};  // (no padding: every byte on the wire defined)
  std::int64_t numel = 0;       // (checked: every rank built the same shapes)
  double value = 0.0;
  double a = 0.0;
  double b = 0.0;
  std::uint64_t seed = 0;
  std::uint64_t counter_base = 0;
  std::uint64_t skip = 0;
};
static_assert(sizeof(RecipeEntry) == 64, "RecipeEntry has no padding");

inline RecipeEntry recipe_entry(const Tensor& value) {
  RecipeEntry e;
  e.numel = value.numel();
  if (!fillable_from_recipe(value)) return e;
  const InitRecipe recipe = value.storage()->init_recipe();
  if (!recipe.recorded()) return e;  // (nn::check_deferred_initialised names it)
  e.present = 1;
  e.kind = static_cast<std::uint8_t>(recipe.kind);
  e.random_kind = static_cast<std::uint8_t>(recipe.random.kind);
  e.dtype = static_cast<std::uint8_t>(value.dtype());
  e.value = recipe.value;
  e.a = recipe.random.a;
  e.b = recipe.random.b;
  e.seed = recipe.random.seed;
  e.counter_base = recipe.random.counter_base;
  e.skip = recipe.random.skip;
  return e;
}

inline ParamRecipe param_recipe(const RecipeEntry& e) {
  ParamRecipe r;
  r.recipe.kind = static_cast<InitRecipe::Kind>(e.kind);
  r.recipe.value = e.value;
  r.recipe.random =
      RandomSpec{static_cast<RandomKind>(e.random_kind), e.a, e.b, e.seed, e.counter_base, e.skip};
  r.dtype = static_cast<DType>(e.dtype);
  return r;
}

}  // namespace detail

// Entry i: how to make rank root's parameter values[i] -- present where that tensor is deferred
// and all of its storage (fillable_from_recipe), empty where its values must come by broadcast.
// The same on every rank. Collective over `comm`.
inline std::vector<std::optional<ParamRecipe>> root_recipes(Context& ctx, comm::Communicator& comm,
                                                            const std::vector<Tensor>& values,
                                                            int root = 0) {
  std::vector<detail::RecipeEntry> entries;
  entries.reserve(values.size());
  for (const auto& v : values) entries.push_back(detail::recipe_entry(v));
  const auto bytes = static_cast<std::int64_t>(entries.size() * sizeof(detail::RecipeEntry));
  std::vector<std::uint8_t> host(static_cast<std::size_t>(bytes));
  if (bytes > 0) std::memcpy(host.data(), entries.data(), host.size());
  if (comm.size() > 1 && bytes > 0) {
    Tensor wire = from_vector(ctx, host, {bytes}, MemoryCategory::communication);
    comm.broadcast(wire, root).wait();
    host = to_vector<std::uint8_t>(ctx, wire);
  }
  std::vector<std::optional<ParamRecipe>> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    detail::RecipeEntry root_entry;
    std::memcpy(&root_entry, host.data() + i * sizeof(root_entry), sizeof(root_entry));
    check(root_entry.numel == values[i].numel(), "root_recipes: parameter #", i, " has ",
          values[i].numel(), " elements on rank ", comm.rank(), " but ", root_entry.numel,
          " on rank ", root, "; every rank must build the same model");
    if (root_entry.present != 0) out[i] = detail::param_recipe(root_entry);
  }
  return out;
}

}  // namespace shardkit::parallel
