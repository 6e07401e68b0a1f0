// Compile-time configuration: host/device qualifiers and the CUDA availability switch.
#pragma once

// SK_WITH_CUDA is 1 when CUDA's runtime headers may be used: in nvcc translation units, or in
// host translation units built against the CUDA runtime (Meson's shardkit_dep defines
// SHARDKIT_WITH_CUDA there). A plain g++ build with only -I include gets 0 and sees no CUDA.
#if defined(__CUDACC__) || (defined(SHARDKIT_WITH_CUDA) && SHARDKIT_WITH_CUDA)
#define SK_WITH_CUDA 1
#else
#define SK_WITH_CUDA 0
#endif

// SK_WITH_DNNL is 1 when oneDNN (libdnnl) may be used for the CPU convolutions: the build found
// it and defines SHARDKIT_WITH_DNNL (Meson's shardkit_dep, for every translation unit of a
// build alike, so an inline function never has two definitions). Without it, Eigen serves.
#if defined(SHARDKIT_WITH_DNNL) && SHARDKIT_WITH_DNNL
#define SK_WITH_DNNL 1
#else
#define SK_WITH_DNNL 0
#endif

// The CPU's kernel tables (cpu_tensor_kernels(), autograd::cpu_kernels(), ops::cpu_fused_ops():
// every tensor copy, autograd loop and fused optimizer step, for every dtype) can be compiled
// once per program instead of in each translation unit that reaches them -- about 45 s of -O3
// per unit on one core, the largest single cost of a program's build. A build that does so
// defines SHARDKIT_CPU_KERNELS_UNIT=1 for every unit of the program alike (Meson's shardkit_dep
// and shardkit_cpu_dep do) and compiles the unit that defines them, kernels/shardkit_cpu.cpp.
// That unit defines SK_DEFINING_CPU_KERNELS before it includes the tables' headers;
// SK_CPU_TABLES_ELSEWHERE is 1 in every other unit of such a build, where the tables' headers
// only declare them. Without SHARDKIT_CPU_KERNELS_UNIT (plain g++ use) the headers define every
// table inline, as everything else.
#if defined(SHARDKIT_CPU_KERNELS_UNIT) && SHARDKIT_CPU_KERNELS_UNIT
#define SK_CPU_KERNELS_UNIT_BUILD 1
#else
#define SK_CPU_KERNELS_UNIT_BUILD 0
#endif
#if defined(SK_DEFINING_CPU_KERNELS) && !SK_CPU_KERNELS_UNIT_BUILD
#error \
    "a unit that defines the CPU kernel tables (kernels/shardkit_cpu.cpp): compile it, and every other unit of the program, with -DSHARDKIT_CPU_KERNELS_UNIT=1 (without it the headers define the tables inline and this unit would define them twice)"
#endif
#if SK_CPU_KERNELS_UNIT_BUILD && !defined(SK_DEFINING_CPU_KERNELS)
#define SK_CPU_TABLES_ELSEWHERE 1
#else
#define SK_CPU_TABLES_ELSEWHERE 0
#endif
// The tables' accessors are declared and defined in an inline namespace named by the flags that
// change their code -- SHARDKIT_WITH_CUDA, SHARDKIT_WITH_DNNL, and OpenMP, which picks
// ThreadPool's implementation: a unit compiled with other flags than the tables' unit that
// reaches a table (every tensor operation does) refers to another name, and the program fails to
// link with an undefined reference that says which
// (shardkit::ops::built_with_cuda0_dnnl1_openmp0::cpu_fused_ops(), say) instead of pairing two
// builds' inline functions in silence. A unit that reaches no table is not caught. (Meson's build
// passes the same flags to every unit; a build of one's own that compiles kernels/*.cpp apart
// must too.)
#if defined(_OPENMP)
#define SK_WITH_OPENMP 1
#else
#define SK_WITH_OPENMP 0
#endif
#define SK_CPU_KERNELS_ABI_NAME(cuda, dnnl, openmp) \
  SK_CPU_KERNELS_ABI_NAME_(cuda, dnnl, openmp)  // (expands the flags first)
#define SK_CPU_KERNELS_ABI_NAME_(cuda, dnnl, openmp) \
  built_with_cuda##cuda##_dnnl##dnnl##_openmp##openmp
#define SK_CPU_KERNELS_ABI SK_CPU_KERNELS_ABI_NAME(SK_WITH_CUDA, SK_WITH_DNNL, SK_WITH_OPENMP)
// How the tables' functions are defined: inline in headers, ordinary in their own unit.
#if defined(SK_DEFINING_CPU_KERNELS)
#define SK_CPU_KERNELS_LINKAGE
#else
#define SK_CPU_KERNELS_LINKAGE inline
#endif

#if defined(__CUDACC__)
#define SK_HOST_DEVICE __host__ __device__
#define SK_DEVICE __device__
#define SK_INLINE __forceinline__
#else
#define SK_HOST_DEVICE
#define SK_DEVICE
#define SK_INLINE inline __attribute__((always_inline))
#endif

// Loop unrolling hint for whichever compiler sees the loop: nvcc's device pass, or g++. nvcc's
// host pass accepts neither spelling without a warning, so it gets none (host loops in .cu
// files are not hot).
#if defined(__CUDA_ARCH__)
#define SK_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)
#define SK_UNROLL
#else
#define SK_UNROLL _Pragma("GCC unroll 8")
#endif

// True inside device code only (the device pass of nvcc).
#if defined(__CUDA_ARCH__)
#define SK_DEVICE_CODE 1
#else
#define SK_DEVICE_CODE 0
#endif

namespace shardkit {

inline constexpr bool kWithCuda = SK_WITH_CUDA != 0;

}  // namespace shardkit
