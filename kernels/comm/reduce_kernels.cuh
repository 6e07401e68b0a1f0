// The device side of the local backend: the rank-order reduction kernel behind
// DeviceCommKernels (the same reduce_element rule the CPU loop applies, so device and host give
// the same bits), the captured steps' rendezvous (flag_barrier.cuh), and run_ranks options wired
// to them.
#pragma once

#include "kernels/comm/flag_barrier.cuh"
#include "kernels/core/tensor_kernels.cuh"
#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/cuda_check.hpp"

namespace shardkit::comm::cuda {

template <class T>
__global__ void reduce_kernel(DeviceReduceParams params) {
  const T* const* sources = reinterpret_cast<const T* const*>(params.sources);
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < params.count;
       i += stride) {
    // Every source of element i is read before any destination of it is written: in-place safe.
    const T value = reduce_element(sources, params.source_count, i, params.op);
    for (int d = 0; d < params.destination_count; ++d)
      static_cast<T*>(params.destinations[d])[i] = value;
  }
}

inline void reduce(CUstream_st* stream, const DeviceReduceParams& params) {
  if (params.count == 0) return;
  const auto n = static_cast<std::int64_t>(params.count);
  visit_dtype(params.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_comm_dtype(dtype_of<T>)) {
      reduce_kernel<T>
          <<<shardkit::cuda::grid_for(n), shardkit::cuda::kThreadsPerBlock, 0, stream>>>(params);
      SK_CUDA_CHECK_LAUNCH("comm reduce_kernel");
    } else {
      fail<InvalidArgument>("device reduction of dtype ", dtype_name(params.dtype),
                            "; collectives reduce f32, f64, f16 or bf16");
    }
  });
}

// The table a LocalWorld calls through. Constant: no global mutable state.
inline const DeviceCommKernels* device_comm_kernels() {
  static constexpr DeviceCommKernels kTable{.reduce = &cuda::reduce,
                                            .flag_barrier = &cuda::flag_barrier};
  return &kTable;
}

}  // namespace shardkit::comm::cuda
