// The fused-ops layer: element functors (SGD, LARC coefficients, Adam/AdamW, casts, sums of
// squares, unscale, the step gate), their entry points over a backend tag, and the CPU backend. The
// CUDA backend: kernels/ops/cuda_backend.cuh.
#pragma once

#include "shardkit/ops/adam.hpp"
#include "shardkit/ops/backend.hpp"
#include "shardkit/ops/cast.hpp"
#include "shardkit/ops/cpu_apply.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/ops/element.hpp"
#include "shardkit/ops/functor.hpp"
#include "shardkit/ops/fused_ops.hpp"
#include "shardkit/ops/larc.hpp"
#include "shardkit/ops/larc_param_squares.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/op_args.hpp"
#include "shardkit/ops/sgd.hpp"
#include "shardkit/ops/spans.hpp"
#include "shardkit/ops/step_gate.hpp"
