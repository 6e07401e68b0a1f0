// Runs a TransferPlan on a CUDA stream: device copies for the copies, the rank-order reduction
// kernel (DeviceCommKernels) for the reductions -- the device twin of local_host_ops.hpp, with
// the same bits. The world's stream runs whole plans; a captured step's rank its own share.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <algorithm>
#include <string_view>

#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/comm/transfer_plan.hpp"
#include "shardkit/core/cuda_check.hpp"

namespace shardkit::comm {

// `name` ("all_reduce #12") and `world_size` are for the error when the kernels are missing.
inline void run_plan_on_device(const TransferPlan& plan, cudaStream_t stream,
                               const DeviceCommKernels* kernels, std::string_view name,
                               int world_size) {
  for (const CopyStep& c : plan.copies)
    SK_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream));
  const std::size_t esize = dtype_size(plan.dtype);
  for (const ReduceStep& step : plan.reductions) {
    if (step.sources.size() == 1) {  // one rank: the result is the input, bit for bit
      for (void* dst : step.destinations)
        if (dst != step.sources[0])
          SK_CUDA_CHECK(cudaMemcpyAsync(dst, step.sources[0], step.count * esize,
                                        cudaMemcpyDeviceToDevice, stream));
      continue;
    }
    check<NotAvailable>(kernels != nullptr, "local ", name, ": reducing device memory over ",
                        world_size,
                        " ranks needs the reduction kernel; build the world with "
                        "the comm table of sk::cuda_kernel_tables() from <shardkit/cuda.hpp> "
                        "(sk::comm::cuda_run_options does it for run_ranks)");
    DeviceReduceParams params;
    params.source_count = static_cast<int>(step.sources.size());
    params.destination_count = static_cast<int>(step.destinations.size());
    std::copy(step.sources.begin(), step.sources.end(), params.sources);
    std::copy(step.destinations.begin(), step.destinations.end(), params.destinations);
    params.count = step.count;
    params.dtype = plan.dtype;
    params.op = plan.op;
    kernels->reduce(stream, params);
  }
}

}  // namespace shardkit::comm

#endif  // SK_WITH_CUDA
