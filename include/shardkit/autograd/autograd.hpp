// The autograd layer: Variable, the per-context tape, backward, and differentiable ops on Eigen
// (CPU) or cuBLAS/cuDNN and own kernels (GPU; kernels/autograd/autograd_kernels.cuh).
#pragma once

#include "shardkit/autograd/engine.hpp"
#include "shardkit/autograd/ops_basic.hpp"
#include "shardkit/autograd/ops_conv.hpp"
#include "shardkit/autograd/ops_linear.hpp"
#include "shardkit/autograd/ops_norm.hpp"
#include "shardkit/autograd/ops_pool.hpp"
#include "shardkit/autograd/ops_softmax.hpp"
#include "shardkit/autograd/tape.hpp"
#include "shardkit/autograd/variable.hpp"
