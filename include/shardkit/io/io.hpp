// The io layer: datasets (IDX / Fashion-MNIST), the stateful distributed sampler, and
// safetensors checkpoints: training checkpoints of any stage (full or sharded, loadable on any
// stage and world size), module state dicts, optimizer state.
#pragma once

#include "shardkit/io/checkpoint.hpp"
#include "shardkit/io/checkpoint_source.hpp"
#include "shardkit/io/checkpoint_steps.hpp"
#include "shardkit/io/fashion_mnist.hpp"
#include "shardkit/io/idx_file.hpp"
#include "shardkit/io/optimizer_state_file.hpp"
#include "shardkit/io/safetensors.hpp"
#include "shardkit/io/stateful_sampler.hpp"
