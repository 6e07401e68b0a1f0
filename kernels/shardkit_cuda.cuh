// For .cu translation units that launch kernels of their own beside shardkit's: the host API,
// the CUDA contexts (<shardkit/cuda.hpp>), every layer's device code and the CUDA ops backend.
// The kernel tables themselves are defined once, in kernels/shardkit_cuda.cu.
#pragma once

#include "kernels/autograd/autograd_kernels.cuh"
#include "kernels/comm/reduce_kernels.cuh"
#include "kernels/core/tensor_kernels.cuh"
#include "kernels/ops/cuda_backend.cuh"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"
