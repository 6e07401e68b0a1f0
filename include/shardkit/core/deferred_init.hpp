// Deferred parameters: build a model without giving its parameters memory, and let the engine
// make each rank's values where they will live -- PyTorch FSDP's meta-device initialisation
// (FSDP2's `to_empty` + `reset_parameters`), DeepSpeed's `zero.Init`.
//
//   {
//     sk::DeferredParameters deferred(ctx);       // parameters built here get no memory
//     net = std::make_shared<MyNet>(ctx, ...);    // their fills are recorded, not run
//   }
//   parallel::ShardedModule model(ctx, comm, net, optimizer, {.stage = Stage::fsdp});
//
// Each rank then makes only the values it keeps, from rank 0's recipes (under fsdp its shards:
// never the whole model, nor a whole unit), where an eager build first holds the whole model on
// every rank. The values are the eager build's bit for bit: a fill of a deferred tensor still
// draws its Philox blocks from the context's stream (so every later fill draws what it would
// have), and the recipe (InitRecipe: the constant, or the seed and counter base) makes the same
// elements later, any range of them alone, on any device.
//
// A tensor "made for parameters" is one sk::empty makes under MemoryCategory::parameters -- what
// nn's layers use for their parameters and buffers. Anything but a whole-tensor fill (sk::fill,
// sk::uniform_, sk::normal_, nn::init's) refuses a deferred tensor, naming the fix.
#pragma once

#include <string_view>

#include "shardkit/core/tensor_ops.hpp"

namespace shardkit {

// While it lives, parameters made on `ctx` are deferred. Scopes nest (each restores what it
// found).
class DeferredParameters {
 public:
  explicit DeferredParameters(Context& ctx) : ctx_(&ctx), was_on_(ctx.defers_parameters()) {
    ctx.set_defer_parameters(true);
  }
  ~DeferredParameters() { ctx_->set_defer_parameters(was_on_); }
  DeferredParameters(const DeferredParameters&) = delete;
  DeferredParameters& operator=(const DeferredParameters&) = delete;

 private:
  Context* ctx_;
  bool was_on_;
};

namespace detail {

inline InitRecipe recorded_recipe(const Tensor& deferred, std::string_view what) {
  const InitRecipe recipe = deferred.storage()->init_recipe();
  check<StateError>(recipe.recorded(), what,
                    " was built under DeferredParameters and never initialised (no whole-tensor "
                    "fill, uniform_ or normal_ of it was recorded); initialise it in the scope, "
                    "or build it outside");
  return recipe;
}

// `t` <- the recipe's elements first, first + 1, ... (row-major order), in t's dtype.
inline void run_recipe(Context& ctx, const Tensor& t, const InitRecipe& recipe,
                       std::uint64_t first = 0) {
  if (recipe.kind == InitRecipe::Kind::constant)
    fill(ctx, t, recipe.value);
  else
    tensor_kernels_for(ctx, t).random(ctx, t, recipe.random.from_element(first));
}

}  // namespace detail

// Whether fill_from_recipe can make `t`'s values without its storage: a deferred tensor that is
// all of its storage (a view of part of one -- a slice, a transpose -- needs materialize()).
inline bool fillable_from_recipe(const Tensor& t) {
  return is_deferred(t) && detail::covers_storage(t);
}

// dst <- elements [first, first + dst.numel()) in row-major order of the tensor of `dtype` that
// `recipe` initialised, in dst's dtype (made in `dtype` first, then converted, as a copy of the
// eager tensor would be). Made without the rest of the tensor: a rank makes the range it keeps.
inline void make_from_recipe(Context& ctx, const Tensor& dst, const InitRecipe& recipe, DType dtype,
                             std::int64_t first = 0) {
  detail::check_on_context(ctx, dst, "make_from_recipe");
  check(recipe.recorded(), "make_from_recipe: the recipe records no fill");
  check(first >= 0, "make_from_recipe: first element ", first, " is negative");
  const Tensor target =
      dst.dtype() == dtype ? dst : empty_on(ctx, dst.device(), dst.shape(), dtype);
  detail::run_recipe(ctx, target, recipe, static_cast<std::uint64_t>(first));
  if (!target.shares_storage(dst)) copy(ctx, dst, target);
}

// dst <- the values deferred tensor `src` would hold had it been built eagerly, in dst's dtype.
// `what` names src in the errors.
inline void fill_from_recipe(Context& ctx, const Tensor& dst, const Tensor& src,
                             std::string_view what) {
  detail::check_on_context(ctx, dst, "fill_from_recipe");
  check(dst.shape() == src.shape(), "fill_from_recipe of ", what, ": destination shape ",
        shape_text(dst.shape()), " differs from ", shape_text(src.shape()));
  check<StateError>(fillable_from_recipe(src), "fill_from_recipe of ", what,
                    ": not a deferred tensor that is all of its storage (a view of part of one "
                    "takes materialize() and a copy)");
  make_from_recipe(ctx, dst, detail::recorded_recipe(src, what), src.dtype());
}

// Gives a deferred tensor its memory (counted now) and its recorded values; every view of its
// storage sees them. Does nothing to other tensors.
inline void materialize(Context& ctx, const Tensor& t, std::string_view what) {
  if (!is_deferred(t)) return;
  detail::check_on_context(ctx, t, "materialize");
  const InitRecipe recipe = detail::recorded_recipe(t, what);
  t.storage()->materialize();  // (which drops the recipe)
  // The recipe covers the whole storage in row-major order: run it over a flat view of it.
  const auto elements = static_cast<std::int64_t>(t.storage()->bytes() / t.element_size());
  detail::run_recipe(ctx, Tensor(t.storage(), {elements}, t.dtype()), recipe);
}

}  // namespace shardkit
