// The CPU's fused optimizer and cast kernels (sk::ops::cpu_fused_ops(): SGD, LARC-SGD, AdamW,
// norms, casts, unscale-and-check, block quantisation, for every storage dtype), compiled once
// per program: the second of the two units of the CPU's kernel tables
// (kernels/autograd/cpu_kernels.cpp says how they are built).
#define SK_DEFINING_CPU_KERNELS SK_CPU_FUSED_OPS_TABLE

#include "shardkit/ops/device_ops.hpp"
