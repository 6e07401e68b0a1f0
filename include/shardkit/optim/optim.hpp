// The optim layer: sharded optimizers over flat-buffer pieces and their whole state.
#pragma once

#include "shardkit/optim/consolidation.hpp"
#include "shardkit/optim/optimizer_state.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
