// Everything shardkit offers to .cu translation units: the host API, the CUDA kernels of every
// layer, the CUDA ops backend, and the one way to make a CUDA Context (cuda_context.cuh).
#pragma once

#include "kernels/cuda_context.cuh"
#include "kernels/ops/cuda_backend.cuh"
#include "shardkit/shardkit.hpp"
