// TrainingState: what a checkpoint saves and restores of a sharded training run, whatever the
// stage -- the one view io/checkpoint.hpp works on, so a checkpoint written under one stage
// and world size loads under any other.
//
//   optimizer   its PieceTable says which elements of which trainable parameter this rank
//               updates; piece_params() are those elements' values, state_buffers() their
//               optimizer state, steps() the step count. Under DDP the table is replicated
//               (every rank holds everything); under OSS/SDP a rank's pieces are its range of
//               the flat buffer; under FSDP its shard of every unit.
//   replicated  tensors every rank holds whole and alike, by name: module buffers (batch-norm
//               statistics), frozen parameters. Rank 0 saves them; every rank loads them.
//   after_load  called once a load has written this rank's pieces: makes the ranks' copies of
//               the parameters agree again (OSS/SDP all-gather the owners' ranges; DDP and
//               FSDP need nothing: every rank wrote all it holds). Also called after other
//               writes to the pieces (normalize_rows).
//   forget_trajectory  called by a checkpoint's load only, before after_load: drops what the
//               run carried from its own past that a checkpoint does not hold (qgZ's
//               error-feedback residuals), so a loaded run goes on as a new process would.
//   scaler      the dynamic loss scaler, when the run has one (the caller sets it).
//   replicas    under hybrid sharding, the ranks of the other groups that hold the same pieces
//               (comm is then this rank's shard group): the first group saves, every group
//               loads.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"

namespace shardkit::parallel {

struct TrainingState {
  optim::ShardedOptimizer* optimizer = nullptr;
  comm::Communicator* comm = nullptr;
  comm::Communicator* replicas = nullptr;
  std::vector<std::pair<std::string, Tensor>> replicated;
  std::function<void()> after_load;
  std::function<void()> forget_trajectory;
  std::string stage;  // recorded in checkpoints, for people and tools that inspect them
  // The loss scaler, if the run has one (set it before saving or loading): its scale and
  // growth tracker travel with the checkpoint.
  optim::DynamicLossScaler* scaler = nullptr;
};

}  // namespace shardkit::parallel
