// Runs the SwAV trainer on the ranks of this process and returns rank 0's report: local ranks
// as threads sharing one device (run_ranks), or, under a launcher (mpirun, torchrun, SLURM),
// this process as one rank of the launcher's world (MPI between CPU processes, NCCL between
// GPUs: make_communicator chooses).
#pragma once

#include <cstdio>
#include <mutex>
#include <utility>

#include "shardkit/comm/comm.hpp"
#if SK_WITH_CUDA
#include "shardkit/cuda.hpp"
#endif
#include "trainer.hpp"

namespace swav {

// One rank: this process's, on a context and communicator it made before (a launched CPU
// process checks the config with them first: launched_checks.hpp).
inline RunReport train_rank(const SwavConfig& config, const Datasets& data, sk::Context& ctx,
                            sk::comm::Communicator& comm) {
  SwavTrainer trainer(config, ctx, comm, data, stdout);
  return trainer.run();
}

inline RunReport train_ranks(const SwavConfig& config, const Datasets& data,
                             const sk::comm::LaunchInfo& launch, int world,
                             const sk::comm::RunRanksOptions& local_ranks,
                             const sk::ContextOptions& process) {
  RunReport report;
  std::mutex lock;
  auto body = [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto r = train_rank(config, data, ctx, comm);
    std::lock_guard guard(lock);
    if (comm.rank() == 0) report = std::move(r);
  };
  if (launch.kind != sk::comm::LaunchKind::single) {
    sk::Context ctx(process);
    auto comm = sk::comm::make_communicator(ctx);
    body(ctx, *comm);
  } else {
    sk::comm::run_ranks(world, body, local_ranks);
  }
  return report;
}

#if SK_WITH_CUDA
// train_ranks on CUDA GPUs. Local ranks share GPU 0 over the in-process communicator (device
// memory); under a launcher each process takes the GPU of its local rank and make_communicator
// gives it NCCL.
inline RunReport train_ranks_gpu(const SwavConfig& config, const Datasets& data,
                                 const sk::comm::LaunchInfo& launch, int world) {
  const bool launched = launch.kind != sk::comm::LaunchKind::single;
  const int gpus = sk::cuda_device_count();
  sk::check<sk::NotAvailable>(
      !launched || launch.local_rank < gpus, "local rank ", launch.local_rank,
      " needs a GPU of its own (NCCL puts one rank on one GPU) but this machine has ", gpus,
      "; start at most ", gpus, " processes per machine, or set config.MACHINE.DEVICE=cpu");
  return train_ranks(config, data, launch, world, sk::comm::cuda_run_options(0),
                     launched
                         ? sk::cuda_context_options(launch.local_rank, launch.rank, config.seed)
                         : sk::ContextOptions{});
}
#endif

}  // namespace swav
