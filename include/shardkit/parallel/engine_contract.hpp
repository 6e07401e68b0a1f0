// TrainingEngine: what every engine offers a training loop, written once in Engine (engine.hpp)
// and offered again by ShardedModule over its engine -- the step, the loss-scaled step,
// gradient clipping, gradient accumulation, clearing gradients, the state checkpoints save and
// load, and post-step hooks. The static_asserts below check each class against it, so a
// missing or mistyped member is a compile error that names the contract.
#pragma once

#include <concepts>

#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/parallel/training_state.hpp"

namespace shardkit::parallel {

template <class E>
concept TrainingEngine = requires(E& engine, float lr, double max_norm,
                                  optim::DynamicLossScaler& scaler, Engine::StepHook hook) {
  engine.step(lr);                                    // the fused optimizer step
  { engine.step(lr, scaler) } -> std::same_as<void>;  // skipped on the device on an overflow
  { engine.clip_grad_norm(max_norm) } -> std::same_as<Tensor>;  // the global norm, on the device
  engine.no_sync();                                             // accumulate without traffic
  engine.zero_grad();
  { engine.training_state() } -> std::same_as<TrainingState>;  // what checkpoints hold
  engine.register_post_step_hook(hook);                        // after each applied step
};

#define SK_CHECK_TRAINING_ENGINE(E)                                                   \
  static_assert(::shardkit::parallel::TrainingEngine<E>, #E                           \
                " must offer the training contract of parallel/engine_contract.hpp: " \
                "step(lr), step(lr, scaler), clip_grad_norm(max_norm) -> Tensor, "    \
                "no_sync(), zero_grad(), training_state(), register_post_step_hook(hook)")

SK_CHECK_TRAINING_ENGINE(Engine);
SK_CHECK_TRAINING_ENGINE(DataParallel);
SK_CHECK_TRAINING_ENGINE(FsdpEngine);
SK_CHECK_TRAINING_ENGINE(ShardedModule);

}  // namespace shardkit::parallel
