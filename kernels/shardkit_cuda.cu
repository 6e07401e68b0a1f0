// The device code of every layer, compiled once: the one translation unit of a program that
// defines sk::cuda_kernel_tables() (declared in <shardkit/cuda.hpp>), through which every CUDA
// Context reaches its kernels. Compile it with nvcc into each program that uses CUDA, exactly
// once (a second copy is a duplicate-symbol link error); everything else stays host C++.
#include "kernels/autograd/autograd_kernels.cuh"
#include "kernels/comm/reduce_kernels.cuh"
#include "kernels/core/tensor_kernels.cuh"
#include "kernels/ops/cuda_backend.cuh"
#include "shardkit/cuda.hpp"

namespace shardkit {

CudaKernelTables cuda_kernel_tables() {
  return CudaKernelTables{.tensor = cuda::device_kernels(),
                          .comm = comm::cuda::device_comm_kernels(),
                          .autograd = autograd::cuda_kernels_table(),
                          .ops = ops::cuda_fused_ops()};
}

}  // namespace shardkit
