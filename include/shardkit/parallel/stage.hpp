// The ZeRO stages by what each rank keeps of the model states (parameters P, gradients G,
// optimizer state S; N ranks):
//
//   ddp   P, G, S whole on every rank (PyTorch DDP)
//   oss   S sharded (ZeRO-1, FairScale OSS)
//   sdp   S and G sharded (ZeRO-2, FairScale ShardedDataParallel)
//   fsdp  S, G and P sharded; parameters gathered unit by unit around their use (ZeRO-3,
//         FairScale / PyTorch FullyShardedDataParallel)
#pragma once

#include <string_view>

#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::parallel {

enum class Stage { ddp, oss, sdp, fsdp };

inline constexpr Stage kAllStages[] = {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp};

inline constexpr EnumName<Stage> kStageNames[] = {
    {Stage::ddp, "ddp"}, {Stage::oss, "oss"}, {Stage::sdp, "sdp"}, {Stage::fsdp, "fsdp"}};

inline std::string_view stage_name(Stage stage) { return name_of(stage, kStageNames); }

inline Stage parse_stage(std::string_view name) {
  return parse_name(name, kStageNames, "ZeRO stage",
                    "ddp, oss (ZeRO-1), sdp (ZeRO-2) or fsdp (ZeRO-3)");
}

// Model-state bytes per rank by the ZeRO accounting (docs/semantics.md): parameters and
// gradients of `bytes` each (4 in f32 training; 2 under mixed precision, where the f32 master
// counts in the optimizer state) and k bytes of optimizer state per parameter (f32 Adam 8;
// mixed-precision Adam 12, the master included), psi parameters, n ranks.
inline double zero_model_state_bytes(Stage stage, double psi, double k, int n, double bytes = 4) {
  switch (stage) {
    case Stage::ddp:
      return (2 * bytes + k) * psi;
    case Stage::oss:
      return 2 * bytes * psi + k * psi / n;
    case Stage::sdp:
      return bytes * psi + (bytes + k) * psi / n;
    case Stage::fsdp:
      return (2 * bytes + k) * psi / n;
  }
  return 0;
}

}  // namespace shardkit::parallel
