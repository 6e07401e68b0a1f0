// The shardkit host API: compiles with plain g++ (no CUDA headers unless SHARDKIT_WITH_CUDA=1).
// Device code lives in <kernels/shardkit_cuda.cuh>, for .cu translation units.
#pragma once

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/comm/comm.hpp"
#include "shardkit/core/core.hpp"
#include "shardkit/io/io.hpp"
#include "shardkit/io/module_checkpoint.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/ops/ops.hpp"
#include "shardkit/optim/optim.hpp"
#include "shardkit/parallel/parallel.hpp"
#include "shardkit/shard/shard.hpp"
