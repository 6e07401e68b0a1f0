// SK_CUDNN_CHECK: throws sk::CudnnError with file:line, the call, cuDNN's status and its last
// detail.
#pragma once

#include "shardkit/core/cuda_check.hpp"

#include <cudnn.h>

namespace shardkit::detail {

inline void cudnn_check(cudnnStatus_t status, const char* call, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  (void)cudaGetLastError();
  std::string message = cudnnGetErrorString(status);
  // cuDNN 9 keeps a longer explanation of the last failure in this thread.
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  if (detail[0] != '\0') message += concat(" (", detail, ")");
  throw CudnnError(library_failure("cuDNN", call, status, message, file, line), status);
}

}  // namespace shardkit::detail

#define SK_CUDNN_CHECK(call) ::shardkit::detail::cudnn_check((call), #call, __FILE__, __LINE__)
