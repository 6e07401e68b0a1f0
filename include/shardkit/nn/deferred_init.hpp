// A module built under DeferredParameters (core/deferred_init.hpp) made whole: for a module used
// without ShardedModule (which makes the values itself, only this rank's shards under fsdp), or
// the parts ShardedModule keeps whole (buffers, frozen parameters outside fsdp's units).
#pragma once

#include <string>

#include "shardkit/core/deferred_init.hpp"
#include "shardkit/nn/module.hpp"

namespace shardkit::nn {

// Throws, naming the first, if a deferred parameter or buffer of `module` was never initialised.
inline void check_deferred_initialised(const Module& module) {
  for (const auto& [name, p] : module.named_parameters())
    if (is_deferred(p.data()))
      (void)shardkit::detail::recorded_recipe(p.data(), "parameter '" + name + "'");
  for (const auto& [name, b] : module.named_buffers())
    if (is_deferred(b)) (void)shardkit::detail::recorded_recipe(b, "buffer '" + name + "'");
}

// Every deferred parameter and buffer of `module` gets its memory and the values an eager build
// gives it.
inline void materialize(Context& ctx, const Module& module) {
  check_deferred_initialised(module);
  for (const auto& [name, p] : module.named_parameters())
    if (is_deferred(p.data())) shardkit::materialize(ctx, p.data(), "parameter '" + name + "'");
  for (const auto& [name, b] : module.named_buffers())
    if (is_deferred(b)) shardkit::materialize(ctx, b, "buffer '" + name + "'");
}

}  // namespace shardkit::nn
