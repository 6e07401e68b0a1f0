// SK_DNNL_CHECK: throws sk::DnnlError with file:line, the call and oneDNN's status.
#pragma once

#include <oneapi/dnnl/dnnl.h>

#include "shardkit/core/error.hpp"

namespace shardkit::detail {

inline const char* dnnl_status_name(dnnl_status_t status) {
  switch (status) {
    case dnnl_out_of_memory:
      return "out of memory";
    case dnnl_invalid_arguments:
      return "invalid arguments";
    case dnnl_unimplemented:
      return "unimplemented (no implementation for these shapes/types)";
    case dnnl_iterator_ends:
      return "iterator ends";
    case dnnl_runtime_error:
      return "runtime error";
    case dnnl_not_required:
      return "not required";
    default:
      return "unknown status";
  }
}

inline void dnnl_check(dnnl_status_t status, const char* call, const char* file, int line) {
  if (status == dnnl_success) return;
  throw DnnlError(library_failure("oneDNN", call, status, dnnl_status_name(status), file, line),
                  status);
}

}  // namespace shardkit::detail

#define SK_DNNL_CHECK(call) ::shardkit::detail::dnnl_check((call), #call, __FILE__, __LINE__)
