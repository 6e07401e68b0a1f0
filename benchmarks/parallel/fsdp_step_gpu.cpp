// The FSDP / DDP step-time ratio on a GPU (fsdp_step.hpp): ranks are threads sharing GPU 0
// over the in-process communicator on device memory; the clock waits for the stream. Exits 0
// with a note when no GPU is usable. Usage: fsdp_step_gpu [ranks] [images per rank] [steps]
// [graph] [nvme=DIR] [only=TEXT] (as fsdp_step's)
#include <cstdio>

#include "fsdp_step.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

int main(int argc, char** argv) {
  namespace sk = shardkit;
  namespace fs = shardkit::bench::fsdp_step;
  if (sk::cuda_device_count() == 0) {
    std::printf("fsdp_step_gpu: no usable CUDA GPU: nothing to measure\n");
    return 0;
  }
  fs::Workload w;
  w.batch = 64;
  w.steps = 10;
  if (!fs::parse_args(argc, argv, w)) return 2;
  fs::run_all("GPU", w, sk::comm::cuda_run_options(0), [](sk::Context& ctx) { ctx.synchronize(); });
  return 0;
}
