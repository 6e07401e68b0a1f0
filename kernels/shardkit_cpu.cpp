// The CPU's kernel tables, compiled once: the one translation unit of a program that defines
// sk::cpu_tensor_kernels(), sk::autograd::cpu_kernels() and sk::ops::cpu_fused_ops() -- every
// tensor copy and fill, autograd loop and fused optimizer step, for every dtype, at the program's
// optimisation level. Optional: without
// it the headers define both inline in each unit that reaches them (plain header-only use).
// With it, the build passes -DSHARDKIT_CPU_KERNELS_UNIT=1 to every unit of the program,
// this one included, and compiles this file exactly once into the program (core/config.hpp,
// SK_CPU_KERNELS_ELSEWHERE); the flags that change code (SHARDKIT_WITH_CUDA, SHARDKIT_WITH_DNNL,
// SHARDKIT_WITH_MPI) must be the same here as in the rest of the program.
#if !defined(SHARDKIT_CPU_KERNELS_UNIT) || !SHARDKIT_CPU_KERNELS_UNIT
#error \
    "kernels/shardkit_cpu.cpp: compile it, and every other unit of the program, with -DSHARDKIT_CPU_KERNELS_UNIT=1 (without it the headers define the CPU tables inline and this file would define them twice)"
#endif
#define SK_DEFINING_CPU_KERNELS 1

#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/core/cpu_kernel_table.hpp"
#include "shardkit/ops/device_ops.hpp"
