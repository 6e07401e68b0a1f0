// The io layer: datasets (IDX / Fashion-MNIST), the stateful distributed sampler, and
// safetensors checkpoints (optimizer state among them).
#pragma once

#include "shardkit/io/fashion_mnist.hpp"
#include "shardkit/io/idx_file.hpp"
#include "shardkit/io/optimizer_state_file.hpp"
#include "shardkit/io/safetensors.hpp"
#include "shardkit/io/stateful_sampler.hpp"
