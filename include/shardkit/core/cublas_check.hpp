// SK_CUBLAS_CHECK: throws sk::CublasError with file:line, the call and cuBLAS's status string.
#pragma once

#include "shardkit/core/cuda_check.hpp"

#include <cublas_v2.h>

namespace shardkit::detail {

inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  (void)cudaGetLastError();
  throw CublasError(
      library_failure("cuBLAS", call, status, cublasGetStatusString(status), file, line), status);
}

}  // namespace shardkit::detail

#define SK_CUBLAS_CHECK(call) ::shardkit::detail::cublas_check((call), #call, __FILE__, __LINE__)
