// The one way to get a CUDA Context: every layer's table of device code (core's tensor kernels,
// comm's device reductions, autograd's kernels) wired in at creation. Include from .cu files;
// it brings no Eigen, so translation units that must stay Eigen-free can use it too.
//
//   auto ctx = sk::make_cuda_context(0);                                // one rank on GPU 0
//   sk::comm::run_ranks(4, fn, sk::comm::cuda_run_options(0));          // 4 ranks sharing GPU 0
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/autograd/autograd_kernels.cuh"
#include "kernels/comm/reduce_kernels.cuh"
#include "kernels/core/tensor_kernels.cuh"
#include "kernels/ops/cuda_backend.cuh"
#include "shardkit/comm/run_ranks.hpp"

namespace shardkit {

inline CudaKernelTables cuda_kernel_tables() {
  return CudaKernelTables{.tensor = cuda::device_kernels(),
                          .comm = comm::cuda::device_comm_kernels(),
                          .autograd = autograd::cuda_kernels_table(),
                          .ops = ops::cuda_fused_ops()};
}

// Options for a Context on CUDA GPU `device`:  sk::Context ctx(sk::cuda_context_options(0));
inline ContextOptions cuda_context_options(int device, int rank = 0, std::uint64_t seed = 0) {
  return ContextOptions{Device::cuda(device), rank, seed, cuda_kernel_tables()};
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
