// How long a checkpoint stops training: a save in the background (AsyncCheckpointer) against
// the same save in the foreground (save_step_checkpoint), in one run. ResNet-50 on one rank
// (DataParallel, AdamW after one step: f32 master and two moments, 307 MB), step checkpoints
// in the sharded layout under FOLDER, foreground and background saves alternating for R
// rounds; medians. The target: the background save's blocking part <= 10% of the
// foreground save. The floor of that blocking part is one copy of the state into host memory,
// shown beside it as a one-thread memcpy of the same bytes into a buffer already mapped.
// Usage: checkpoint_save [FOLDER (default: the temporary folder)] [ROUNDS (default 3)]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <shardkit/checkpoint/async_checkpoint.hpp>
#include <shardkit/ops/cpu_backend.hpp>
#include "offload_step.hpp"
#include "timing.hpp"

namespace sk = shardkit;
namespace ckpt = shardkit::checkpoint;

namespace {

using shardkit::bench::median;
using shardkit::bench::seconds_since;

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path folder =
      argc > 1 ? std::filesystem::path(argv[1])
               : std::filesystem::temp_directory_path() /
                     ("shardkit_checkpoint_save_" + std::to_string(::getpid()));
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  sk::Context ctx;
  sk::bench::offload_step::Engine engine(ctx, sk::optim::OptimizerKind::adamw, sk::DType::f32,
                                         false);
  engine.dp->step(1e-3f);  // the moments exist
  const double state_bytes = 3.0 * 4.0 * static_cast<double>(sk::workloads::kResNet50Params);

  // The floor: one copy of the state's bytes, source and destination already mapped.
  std::vector<char> from(static_cast<std::size_t>(state_bytes), 1), to(from.size(), 2);
  std::vector<double> copies;
  for (int r = 0; r < 3; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(to.data(), from.data(), from.size());
    copies.push_back(seconds_since(start));
  }

  const auto foreground_dir = (folder / "foreground").string();
  const auto background_dir = (folder / "background").string();
  ckpt::CheckpointOptions options;
  options.layout = ckpt::CheckpointLayout::sharded;
  ckpt::AsyncCheckpointer saver(background_dir);
  std::vector<double> foreground, blocking, first_blocking, written;
  for (int r = 0; r <= rounds; ++r) {  // round 0 warms the background saver's staging
    auto state = engine.dp->training_state();
    auto start = std::chrono::steady_clock::now();
    if (r > 0) {
      (void)ckpt::save_step_checkpoint(foreground_dir, r, state, options);
      foreground.push_back(seconds_since(start));
    }
    start = std::chrono::steady_clock::now();
    saver.save(r + 1, state, options);
    (r == 0 ? first_blocking : blocking).push_back(seconds_since(start));
    saver.finish();  // (measured: the background write as a whole)
    if (r > 0) written.push_back(seconds_since(start));
  }
  std::filesystem::remove_all(folder);

  const double fg = median(foreground), bg = median(blocking);
  std::printf(
      "checkpoint_save: ResNet-50 on one rank, AdamW state (%.0f MB), sharded layout, "
      "%d rounds (medians), in %s\n",
      state_bytes / 1e6, rounds, folder.string().c_str());
  std::printf("  foreground save (save_step_checkpoint)     %8.1f ms   %6.2f GB/s\n", fg * 1e3,
              state_bytes / fg / 1e9);
  std::printf(
      "  background save, blocking part             %8.1f ms   %6.2f GB/s   %.3fx the "
      "foreground save (target <= 0.10)\n",
      bg * 1e3, state_bytes / bg / 1e9, bg / fg);
  std::printf("  background save, first (staging mapped)    %8.1f ms\n", first_blocking[0] * 1e3);
  std::printf("  background save, until written (finish)   %8.1f ms\n", median(written) * 1e3);
  std::printf(
      "  floor: memcpy of the state's bytes         %8.1f ms   %6.2f GB/s   (one thread; "
      "the snapshot copies on the context's %d)\n",
      median(copies) * 1e3, state_bytes / median(copies) / 1e9, ctx.cpu_threads());
  return 0;
}
