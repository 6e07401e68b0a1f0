// make_communicator(ctx): the right communicator for how the process was launched.
// - under mpirun: MPI over MPI_COMM_WORLD for a CPU context; for a CUDA context, NCCL whose
//   unique id rank 0 broadcasts over MPI;
// - RANK / WORLD_SIZE set: NCCL (CUDA context needed). Every rank must reach the same id:
//   either NCCL_COMM_ID=host:port is set (NCCL derives the id from it and rank 0 listens there),
//   or SHARDKIT_NCCL_ID_FILE names a file on a filesystem all ranks share (rank 0 writes the id,
//   the others wait for it; use a fresh path per job, e.g. with the job id in it);
// - nothing set: a single-rank local communicator (collectives are copies).
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "shardkit/comm/launch.hpp"
#include "shardkit/comm/local_communicator.hpp"
#include "shardkit/comm/mpi_communicator.hpp"
#include "shardkit/comm/nccl_communicator.hpp"
#include "shardkit/core/context.hpp"

namespace shardkit::comm {

namespace detail {

#if SK_WITH_CUDA
// Rank 0 writes the id next to `path` and renames it into place (readers never see half a
// file); the others poll until it appears or the timeout passes.
inline ncclUniqueId nccl_id_from_file(const std::string& path, int rank,
                                      std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  if (rank == 0) {
    id = NcclCommunicator::unique_id();
    const std::string temporary = path + ".tmp";
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
      check<IoError>(out.good(), "cannot write the NCCL id to '", temporary,
                     "' (SHARDKIT_NCCL_ID_FILE); pick a writable path on a shared filesystem");
    }
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    check<IoError>(!error, "cannot rename '", temporary, "' to '", path, "': ", error.message());
    return id;
  }
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    std::error_code error;
    if (std::filesystem::file_size(path, error) == sizeof id && !error) {
      std::ifstream in(path, std::ios::binary);
      in.read(reinterpret_cast<char*>(&id), sizeof id);
      if (in.gcount() == static_cast<std::streamsize>(sizeof id)) return id;
    }
    if (std::chrono::steady_clock::now() - start >= timeout)
      fail<TimeoutError>("rank ", rank, " waited ", timeout.count(),
                         " ms for rank 0 to write the "
                         "NCCL id to '",
                         path,
                         "' (SHARDKIT_NCCL_ID_FILE); check that rank 0 runs "
                         "and that the path is on a filesystem every rank sees");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}
#endif

}  // namespace detail

inline std::unique_ptr<Communicator> make_communicator(Context& ctx, CommOptions options = {},
                                                       const EnvLookup& env = process_env) {
  const LaunchInfo launch = detect_launch(env);
  switch (launch.kind) {
    case LaunchKind::single:
      return LocalCommunicator::single(ctx, options);
    case LaunchKind::mpi: {
#if defined(SHARDKIT_WITH_MPI) && SHARDKIT_WITH_MPI
      auto mpi = MpiCommunicator::world(ctx, options);
      if (ctx.device().is_cpu()) return mpi;
#if SK_WITH_CUDA
      // 64 16-bit words: moved bit for bit (MPI_UINT16_T), never interpreted as floats.
      static_assert(sizeof(ncclUniqueId) % 2 == 0, "ncclUniqueId must be a whole number of words");
      ncclUniqueId id{};
      if (mpi->rank() == 0) id = NcclCommunicator::unique_id();
      mpi->broadcast(Buffer(&id, sizeof id / 2, DType::f16), 0).wait();
      auto nccl = std::make_unique<NcclCommunicator>(ctx, id, mpi->rank(), mpi->size(), options);
      nccl->attach(mpi->session());  // MPI stays initialised (and is finalized) with NCCL's comm
      return nccl;
#else
      fail<NotAvailable>("a CUDA context in a build without CUDA");
#endif
#else
      fail<NotAvailable>("this process was launched by mpirun (", launch.source,
                         ") but shardkit was built without MPI; install libopenmpi-dev and "
                         "reconfigure (Meson then defines SHARDKIT_WITH_MPI), or launch with "
                         "RANK/WORLD_SIZE");
#endif
    }
    case LaunchKind::env: {
      if (ctx.device().is_cpu()) {
        if (launch.size == 1) return LocalCommunicator::single(ctx, options);
        fail<NotAvailable>(launch.source, " ask for ", launch.size,
                           " ranks, but the context is on "
                           "the CPU: CPU processes talk through MPI (launch with mpirun), and "
                           "RANK/WORLD_SIZE launches need a CUDA context for NCCL");
      }
#if SK_WITH_CUDA
      ncclUniqueId id;
      if (env("NCCL_COMM_ID")) {
        id = NcclCommunicator::unique_id();  // derived from NCCL_COMM_ID: equal on every rank
      } else if (const auto path = env("SHARDKIT_NCCL_ID_FILE")) {
        id = detail::nccl_id_from_file(*path, launch.rank, options.timeout);
      } else if (launch.size == 1) {
        id = NcclCommunicator::unique_id();
      } else {
        fail<InvalidArgument>(launch.source, " ask for ", launch.size,
                              " NCCL ranks but no way to "
                              "share NCCL's id is set: export NCCL_COMM_ID=<rank 0 host>:<free "
                              "port> or SHARDKIT_NCCL_ID_FILE=<path on a shared filesystem>");
      }
      return std::make_unique<NcclCommunicator>(ctx, id, launch.rank, launch.size, options);
#else
      fail<NotAvailable>("a CUDA context in a build without CUDA");
#endif
    }
  }
  fail<InvalidArgument>("unknown launch kind");
}

}  // namespace shardkit::comm
