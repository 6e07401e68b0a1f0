// The FSDP / DDP step-time ratio on the CPU (fsdp_step.hpp): ranks as threads.
// Usage: fsdp_step [ranks] [images per rank] [timed steps] [graph]
#include <cstdlib>
#include <string>

#include "fsdp_step.hpp"
#include "shardkit/ops/cpu_backend.hpp"

int main(int argc, char** argv) {
  namespace fs = shardkit::bench::fsdp_step;
  fs::Workload w;
  if (argc > 1) w.world = std::atoi(argv[1]);
  if (argc > 2) w.batch = std::atoll(argv[2]);
  if (argc > 3) w.steps = std::atoi(argv[3]);
  w.graph = argc > 4 && std::string(argv[4]) == "graph";
  fs::run_all("CPU", w, {}, [](shardkit::Context&) {});
  return 0;
}
