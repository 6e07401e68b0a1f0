// The shardkit host API: compiles with plain g++ (no CUDA headers unless SHARDKIT_WITH_CUDA=1).
// CUDA: <shardkit/cuda.hpp> makes CUDA contexts; kernels/shardkit_cuda.cu holds the device code.
#pragma once

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/checkpoint/checkpoint.hpp"
#include "shardkit/comm/comm.hpp"
#include "shardkit/core/core.hpp"
#include "shardkit/data/data.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/ops/ops.hpp"
#include "shardkit/optim/optim.hpp"
#include "shardkit/parallel/parallel.hpp"
#include "shardkit/shard/shard.hpp"
