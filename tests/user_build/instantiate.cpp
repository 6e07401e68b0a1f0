// What a user's own build compiles: the host API under the user's compiler and flags, with the
// engines, the module wrapper, the optimizer and the checkpoints instantiated for the CPU backend
// (explicit instantiation compiles every member, not just those a test happens to call).
// scripts/check-user-build compiles it with g++ and clang++, -Wall -Wextra -Werror, at the
// compilers' default -march and at x86-64-v3: the project's own -march hides ABI warnings
// (-Wpsabi) that a plain build sees.
#include <shardkit/shardkit.hpp>

namespace sk = shardkit;

template class sk::optim::ShardedOptimizer<sk::ops::Cpu>;
template class sk::parallel::DataParallel<sk::ops::Cpu>;
template class sk::parallel::FsdpEngine<sk::ops::Cpu>;
template class sk::parallel::Fsdp<sk::ops::Cpu>;
template class sk::parallel::ShardedModule<sk::ops::Cpu>;

int main() {
  sk::Context ctx({.seed = 1});
  auto t = sk::zeros(ctx, {4}, sk::DType::f32);
  return t.numel() == 4 ? 0 : 1;
}
