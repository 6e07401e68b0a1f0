// The checkpoint layer: safetensors files (atomic, checksummed), training checkpoints of any
// stage (full or sharded, loadable on any stage and world size), step folders (saved in the
// foreground or in the background: async_checkpoint.hpp), module state
// dicts and optimizer-state files, and the offline rewrites of checkpoints (consolidate,
// reshard, to and from PyTorch state dicts).
#pragma once

#include "shardkit/checkpoint/async_checkpoint.hpp"
#include "shardkit/checkpoint/checkpoint_rewrite.hpp"
#include "shardkit/checkpoint/checkpoint_source.hpp"
#include "shardkit/checkpoint/module_state.hpp"
#include "shardkit/checkpoint/optimizer_state_file.hpp"
#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/checkpoint/step_folders.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
