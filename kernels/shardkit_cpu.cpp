// The CPU's kernel tables, compiled once per program (the CPU's counterpart of shardkit_cuda.cu):
// sk::cpu_tensor_kernels() (every copy, fill, add, divide and random fill between the seven
// dtypes), sk::autograd::cpu_kernels() (every loop, GEMM and convolution the autograd ops run)
// and sk::ops::cpu_fused_ops() (SGD, LARC-SGD, AdamW, norms, casts, unscale-and-check, block
// quantisation, for every storage dtype) -- the largest single cost of a program's build.
//
// One unit: a program's first build on two cores (where ninja 1.11 runs three jobs) then
// compiles it, the program's own units and nothing else at once, none waiting for a slot; as two
// units of about half its cost, ninja started both first and the README's trainer took the third
// slot only when knn.cpp ended, then ran alone for its last 20-27 s (docs/performance.md: the
// build in 55-64 s against 68-70 s).
//
// Optional: without this unit the headers define the tables inline in each unit that reaches
// them (plain header-only use). With it, the build passes -DSHARDKIT_CPU_KERNELS_UNIT=1 to every
// unit of the program, this one included, and compiles it exactly once into the program
// (core/config.hpp); the flags that change code (SHARDKIT_WITH_CUDA, SHARDKIT_WITH_DNNL,
// SHARDKIT_WITH_MPI, OpenMP) must be the same here as in the rest of the program -- a unit that
// differs in the first, second or last fails to link (core/config.hpp, SK_CPU_KERNELS_ABI).
#define SK_DEFINING_CPU_KERNELS 1  // (all three tables: core/config.hpp)

#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/core/cpu_kernel_table.hpp"
#include "shardkit/ops/device_ops.hpp"
