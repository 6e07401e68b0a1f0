// Checkpoints of the custom loop: the parameters (model.safetensors, PyTorch names) and the whole
// optimizer state (optimizer.safetensors), both gathered on rank 0 -- under oss/sdp the state is
// consolidated from its owners first -- and each written atomically. A run resumed from them
// continues bit for bit as if it had not stopped, on any stage and any number of ranks.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include <shardkit/io/optimizer_state_file.hpp>
#include <shardkit/io/safetensors.hpp>
#include <shardkit/parallel/data_parallel.hpp>

namespace custom_loop {

// Collective: every rank calls it; rank 0 writes.
template <class Ops>
void save_checkpoint(const std::string& dir, sk::Context& ctx, sk::parallel::DataParallel<Ops>& dp) {
  const auto state = dp.consolidate_optimizer_state(0);
  if (dp.communicator().rank() != 0) return;
  std::vector<sk::io::NamedBytes> params;
  const auto& layout = dp.plan().layout();
  for (std::size_t i = 0; i < layout.size(); ++i)
    params.push_back(sk::io::host_bytes(ctx, layout[i].name, dp.param(i)));
  const std::string steps = std::to_string(state.steps);
  // The optimizer first: a crash between the two leaves step counts that differ, which
  // load_checkpoint refuses, rather than a model that silently runs ahead of its state.
  sk::io::save_optimizer_state(dir + "/optimizer.safetensors", state);
  sk::io::save_safetensors(dir + "/model.safetensors", params, {{"format", "pt"}, {"steps", steps}});
  std::printf("checkpoint: step %s saved to %s\n", steps.c_str(), dir.c_str());
}

// Every rank reads both files and takes its share; returns the steps already taken.
template <class Ops>
std::int64_t load_checkpoint(const std::string& dir, sk::Context& ctx, sk::parallel::DataParallel<Ops>& dp) {
  const auto model = sk::io::load_safetensors(dir + "/model.safetensors");
  const auto state = sk::io::load_optimizer_state(dir + "/optimizer.safetensors");
  const auto steps = model.metadata.find("steps");
  sk::check(steps != model.metadata.end() && steps->second == std::to_string(state.steps),
            "the checkpoint in '", dir, "' is torn: model.safetensors is from step ",
            steps == model.metadata.end() ? std::string("?") : steps->second,
            ", optimizer.safetensors from step ", state.steps, "; resume from a complete one");
  const auto& layout = dp.plan().layout();
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const auto* saved = model.find(layout[i].name);
    sk::check(saved != nullptr, "the checkpoint in '", dir, "' has no parameter '", layout[i].name,
              "': it is from another model (check --hidden)");
    sk::io::copy_to_tensor(ctx, *saved, dp.param(i));
  }
  dp.load_optimizer_state(state);
  return state.steps;
}

}  // namespace custom_loop
