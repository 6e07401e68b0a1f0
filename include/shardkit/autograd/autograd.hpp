// The autograd layer: Variable, the per-context tape, backward, and differentiable ops on Eigen
// (CPU) or cuBLAS/cuDNN and own kernels (GPU; kernels/autograd/autograd_kernels.cuh).
#pragma once

#include "shardkit/autograd/backward.hpp"
#include "shardkit/autograd/basic.hpp"
#include "shardkit/autograd/conv.hpp"
#include "shardkit/autograd/dropout.hpp"
#include "shardkit/autograd/linear.hpp"
#include "shardkit/autograd/norm.hpp"
#include "shardkit/autograd/pool.hpp"
#include "shardkit/autograd/softmax.hpp"
#include "shardkit/autograd/tape.hpp"
#include "shardkit/autograd/variable.hpp"
