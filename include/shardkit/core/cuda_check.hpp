// SK_CUDA_CHECK / SK_CUDA_CHECK_LAUNCH: throw sk::CudaError with file:line, the call and CUDA's
// message.
#pragma once

#include "shardkit/core/config.hpp"
#include "shardkit/core/error.hpp"

#if !SK_WITH_CUDA
#error \
    "shardkit/core/cuda_check.hpp needs CUDA: compile with nvcc or define SHARDKIT_WITH_CUDA=1 and add CUDA's include folder"
#endif

#include <cuda_runtime.h>

namespace shardkit::detail {

inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  // Reset the runtime's last-error slot so that the next, unrelated check does not report this
  // failure again (errors that corrupt the context stay sticky whatever we do).
  (void)cudaGetLastError();
  throw CudaError(
      library_failure("CUDA", call, status,
                      concat(cudaGetErrorName(status), ": ", cudaGetErrorString(status)), file,
                      line),
      status);
}

}  // namespace shardkit::detail

#define SK_CUDA_CHECK(call) ::shardkit::detail::cuda_check((call), #call, __FILE__, __LINE__)

// After a kernel launch: launch-configuration errors only show up in cudaGetLastError().
#define SK_CUDA_CHECK_LAUNCH(kernel_name) \
  ::shardkit::detail::cuda_check(cudaGetLastError(), "launch of " kernel_name, __FILE__, __LINE__)
