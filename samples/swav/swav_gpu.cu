// The SwAV trainer's GPU path: train_ranks for sk::ops::Cuda. Local ranks share GPU 0 over the
// in-process communicator (device memory); under a launcher each process takes the GPU of its
// local rank and make_communicator gives it NCCL. swav.cpp calls it for MACHINE.DEVICE gpu, or
// auto on a machine with a GPU.
#include <kernels/cuda_context.cuh>
#include <kernels/ops/cuda_backend.cuh>

#include "ranks.hpp"

namespace swav {

RunReport train_ranks_gpu(const SwavConfig& config, const Datasets& data,
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

}  // namespace swav
