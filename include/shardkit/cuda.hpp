// CUDA contexts from host code: the one way to get a CUDA Context, usable from any translation
// unit of a build with CUDA (SHARDKIT_WITH_CUDA=1 and CUDA's include folder; plain g++ is
// enough). The device code of every layer -- core's tensor kernels, comm's device reductions,
// autograd's kernels, the fused optimizer ops -- is compiled once, by nvcc, in one translation
// unit: kernels/shardkit_cuda.cu, which defines sk::cuda_kernel_tables(). Add that file to your
// program's CUDA sources (Meson: shardkit_cuda_dep does); .cu files of your own that launch
// kernels include <kernels/shardkit_cuda.cuh> as well.
//
//   auto ctx = sk::make_cuda_context(0);                                // one rank on GPU 0
//   sk::comm::run_ranks(4, fn, sk::comm::cuda_run_options(0));          // 4 ranks sharing GPU 0
#pragma once

#include <cstdint>
#include <memory>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/context.hpp"

#if !SK_WITH_CUDA
#error "<shardkit/cuda.hpp> needs CUDA: define SHARDKIT_WITH_CUDA=1 and add CUDA's include folder"
#endif

namespace shardkit {

// Every layer's table of device code (core/device_kernels.hpp), from kernels/shardkit_cuda.cu.
CudaKernelTables cuda_kernel_tables();

// Options for a Context on CUDA GPU `device`:  sk::Context ctx(sk::cuda_context_options(0));
inline ContextOptions cuda_context_options(int device, int rank = 0, std::uint64_t seed = 0) {
  ContextOptions options;
  options.device = Device::cuda(device);
  options.rank = rank;
  options.seed = seed;
  options.kernels = cuda_kernel_tables();
  return options;
}

inline std::unique_ptr<Context> make_cuda_context(int device, int rank = 0,
                                                  std::uint64_t seed = 0) {
  return std::make_unique<Context>(cuda_context_options(device, rank, seed));
}

namespace comm {

// run_ranks options for ranks sharing CUDA GPU `device`: sk::comm::run_ranks(4, fn,
// sk::comm::cuda_run_options(0)).
inline RunRanksOptions cuda_run_options(int device, CommOptions comm = {}, std::uint64_t seed = 0) {
  RunRanksOptions options;
  options.device = Device::cuda(device);
  options.kernels = cuda_kernel_tables();
  options.comm = comm;
  options.seed = seed;
  return options;
}

}  // namespace comm
}  // namespace shardkit
