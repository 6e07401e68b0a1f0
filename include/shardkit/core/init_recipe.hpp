// InitRecipe: how a tensor built without memory (DeferredParameters, deferred_init.hpp) was
// initialised -- one fill of the whole tensor, recorded instead of run, so that the values can
// be made later, anywhere and piece by piece, and equal the ones an eager build gets bit for bit.
// A random fill keeps its Philox seed and counter base: element i's value depends on nothing
// else (philox.hpp).
#pragma once

#include <cstdint>

#include "shardkit/core/philox.hpp"

namespace shardkit {

struct InitRecipe {
  enum class Kind : std::uint8_t { none, constant, random };
  Kind kind = Kind::none;  // none: not initialised yet
  double value = 0.0;      // constant: every element's value
  RandomSpec random{};     // random: the fill as the context drew it

  static InitRecipe constant_fill(double value) { return {Kind::constant, value, {}}; }
  static InitRecipe random_fill(const RandomSpec& spec) { return {Kind::random, 0.0, spec}; }
  bool recorded() const { return kind != Kind::none; }
};

}  // namespace shardkit
