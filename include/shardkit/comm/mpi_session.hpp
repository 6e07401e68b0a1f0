// MpiSession: MPI_Init_thread on construction (unless MPI already runs), MPI_Finalize when the
// last owner goes. MPI is process-wide by nature; the session makes its lifetime explicit
// instead of hiding it in a global. Compiled only with SHARDKIT_WITH_MPI (Meson's shardkit_dep
// defines it when MPI was found).
#pragma once

#if defined(SHARDKIT_WITH_MPI) && SHARDKIT_WITH_MPI

#include <memory>

#include "shardkit/core/mpi_check.hpp"

namespace shardkit::comm {

class MpiSession {
 public:
  // Initialises MPI with MPI_THREAD_MULTIPLE requested (ranks may drive communicators from
  // several threads); `argc`/`argv` may be null.
  MpiSession(int* argc = nullptr, char*** argv = nullptr) {
    int initialized = 0;
    SK_MPI_CHECK(MPI_Initialized(&initialized));
    if (initialized) return;
    int finalized = 0;
    SK_MPI_CHECK(MPI_Finalized(&finalized));
    check<StateError>(!finalized,
                      "MPI was already finalized in this process and cannot start "
                      "again; keep one MpiSession alive for the whole program");
    int provided = 0;
    SK_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    owns_ = true;
    // Errors must come back as status values (SK_MPI_CHECK throws), not abort the job.
    SK_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  }
  ~MpiSession() {
    if (owns_) (void)MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  // True when this session started MPI (and will finalize it).
  bool owns_mpi() const { return owns_; }

  static int world_rank() {
    int rank = 0;
    SK_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    return rank;
  }
  static int world_size() {
    int size = 0;
    SK_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
    return size;
  }

 private:
  bool owns_ = false;
};

}  // namespace shardkit::comm

#endif  // SHARDKIT_WITH_MPI
