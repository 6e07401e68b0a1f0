// The CPU's tensor and autograd kernels (sk::cpu_tensor_kernels(): every copy, fill, add,
// divide and random fill between the seven dtypes; sk::autograd::cpu_kernels(): every loop, GEMM
// and convolution the autograd ops run), compiled once per program. With kernels/ops/
// cpu_fused_ops.cpp it holds the CPU's kernel tables, the largest single cost of a program's
// build, in two units of similar cost: a first build on two cores (where ninja runs three jobs)
// compiles both side by side with the program's own code instead of waiting on one long unit.
//
// Optional: without these units the headers define the tables inline in each unit that reaches
// them (plain header-only use). With them, the build passes -DSHARDKIT_CPU_KERNELS_UNIT=1 to
// every unit of the program, these included, and compiles each exactly once into the program
// (core/config.hpp); the flags that change code (SHARDKIT_WITH_CUDA, SHARDKIT_WITH_DNNL,
// SHARDKIT_WITH_MPI, OpenMP) must be the same here as in the rest of the program -- a unit that
// differs in the first, second or last fails to link (core/config.hpp, SK_CPU_KERNELS_ABI).
#define SK_DEFINING_CPU_KERNELS (SK_CPU_TENSOR_TABLE | SK_CPU_AUTOGRAD_TABLE)

#include "shardkit/autograd/cpu_kernel_table.hpp"
#include "shardkit/core/cpu_kernel_table.hpp"
