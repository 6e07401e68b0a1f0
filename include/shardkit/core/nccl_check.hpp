// SK_NCCL_CHECK: throws sk::NcclError with file:line, the call and NCCL's messages.
#pragma once

#include "shardkit/core/cuda_check.hpp"

#include <nccl.h>

namespace shardkit::detail {

inline void nccl_check(ncclResult_t status, const char* call, const char* file, int line) {
  // ncclInProgress is the normal answer of non-blocking communicators, not a failure.
  if (status == ncclSuccess || status == ncclInProgress) return;
  (void)cudaGetLastError();
  std::string message = ncclGetErrorString(status);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') message += concat(" (", last, ")");
  throw NcclError(library_failure("NCCL", call, status, message, file, line), status);
}

}  // namespace shardkit::detail

#define SK_NCCL_CHECK(call) ::shardkit::detail::nccl_check((call), #call, __FILE__, __LINE__)
