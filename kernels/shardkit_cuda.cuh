// Everything shardkit offers to .cu translation units: the host API plus the CUDA kernels.
#pragma once

#include "shardkit/shardkit.hpp"
#include "kernels/core/tensor_kernels.cuh"
#include "kernels/comm/reduce_kernels.cuh"
#include "kernels/ops/cuda_backend.cuh"
#include "kernels/autograd/autograd_kernels.cuh"
