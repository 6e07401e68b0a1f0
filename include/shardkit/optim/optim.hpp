// The optim layer: sharded optimizers over flat-buffer pieces, and the CPU ops backend.
#pragma once

#include "shardkit/optim/cpu_backend.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
