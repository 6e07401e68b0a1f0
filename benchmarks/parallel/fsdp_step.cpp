// The FSDP / DDP step-time ratio on the CPU (fsdp_step.hpp): ranks as threads.
// Usage: fsdp_step [ranks] [images per rank] [timed steps] [graph] [nvme=DIR] [only=TEXT]
//   graph      each step replayed from a StepGraph
//   nvme=DIR   add the offload rows (host memory; files in DIR, a directory on a fast disk)
//   only=TEXT  only the configurations whose name contains TEXT (and ddp, the ratios' base)
#include "fsdp_step.hpp"
#include "shardkit/ops/cpu_backend.hpp"

int main(int argc, char** argv) {
  namespace fs = shardkit::bench::fsdp_step;
  fs::Workload w;
  if (!fs::parse_args(argc, argv, w)) return 2;
  fs::run_all("CPU", w, {}, [](shardkit::Context&) {});
  return 0;
}
