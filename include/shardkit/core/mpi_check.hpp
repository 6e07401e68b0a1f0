// SK_MPI_CHECK: throws sk::MpiError with file:line, the call and MPI's error string.
#pragma once

#include "shardkit/core/error.hpp"

// Only MPI's C API: OpenMPI's deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

namespace shardkit::detail {

inline void mpi_check(int status, const char* call, const char* file, int line) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) length = 0;
  throw MpiError(library_failure("MPI", call, status, std::string(text, length), file, line),
                 status);
}

}  // namespace shardkit::detail

// Needs MPI_ERRORS_RETURN on the communicator, otherwise MPI aborts before returning a status.
#define SK_MPI_CHECK(call) ::shardkit::detail::mpi_check((call), #call, __FILE__, __LINE__)
