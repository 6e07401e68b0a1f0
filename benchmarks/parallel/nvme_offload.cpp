// Offload to NVMe (parallel/offload.hpp's nvme_path): what a step costs when the optimizer's f32
// master and state live in files instead of host memory. ResNet-50 on one rank (25.6 M
// parameters, f32, gradients already reduced: offload_step.hpp), AdamW and LARC-SGD; per
// optimizer, medians of R steps, alternating the two placements:
//
//   host ms     the step with the master and state in host memory (offload.optimizer)
//   disk ms     the same step with them in files in DIR, streamed through RAM in chunks
//   floor ms    the disk's own time for the bytes that step must move: the state read once and
//               written once (AdamW: master, m, v = 12 bytes a parameter each way; LARC-SGD:
//               master, momentum = 8, and the master read once more for the norms, which LARC
//               needs before the first chunk), reads and writes overlapped (the longer), at
//               the best of three read and write bandwidths measured in the same run on a file
//               in DIR (written back as the spill writes, dropped from the page cache, read back)
//   of floor    floor / disk: the fraction of the disk's pace the step reaches
//   in RAM      the state's bytes left in RAM after a step (mincore)
//
// Usage: nvme_offload [DIR, default .] [rounds, default 3]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "offload_step.hpp"
#include "timing.hpp"

namespace sk = shardkit;
namespace os = shardkit::bench::offload_step;

namespace {

using shardkit::bench::median;
using shardkit::bench::seconds_since;

// The disk's sequential write (to stable storage) and read (from the device, not the page
// cache) bandwidths for a file of `bytes` in `dir`, in bytes per second.
std::pair<double, double> disk_bandwidth(const std::string& dir, std::size_t bytes) {
  std::string name = dir + "/shardkit-bandwidth-XXXXXX";
  const int fd = ::mkstemp(name.data());
  sk::check(fd >= 0, "nvme_offload: cannot create a file in '", dir, "'");
  ::unlink(name.c_str());
  const std::size_t block = std::size_t{8} << 20;
  std::vector<char> buffer(block, 1);
  auto start = std::chrono::steady_clock::now();
  for (std::size_t at = 0; at < bytes; at += block)
    sk::check(::pwrite(fd, buffer.data(), std::min(block, bytes - at), static_cast<off_t>(at)) > 0,
              "nvme_offload: write failed");
  // (Written back as the spill writes the state: to the device, without fsync's cache flush.)
  ::sync_file_range(
      fd, 0, static_cast<off_t>(bytes),
      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  const double write = static_cast<double>(bytes) / seconds_since(start);
  ::posix_fadvise(fd, 0, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  start = std::chrono::steady_clock::now();
  for (std::size_t at = 0; at < bytes; at += block)
    sk::check(::pread(fd, buffer.data(), std::min(block, bytes - at), static_cast<off_t>(at)) > 0,
              "nvme_offload: read failed");
  const double read = static_cast<double>(bytes) / seconds_since(start);
  ::close(fd);
  return {write, read};
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  sk::Context ctx;
  const double params = static_cast<double>(sk::workloads::kResNet50Params);
  std::printf("ResNet-50 on one rank, f32, %d threads; state files in %s; medians of %d steps\n",
              ctx.cpu_threads(), dir.c_str(), rounds);
  std::printf(
      "| optimizer | host ms | disk ms | disk / host | floor ms | of floor | in RAM after a step "
      "|\n|---|---|---|---|---|---|---|\n");
  for (const auto kind : {sk::optim::OptimizerKind::adamw, sk::optim::OptimizerKind::larc_sgd}) {
    const bool larc = kind == sk::optim::OptimizerKind::larc_sgd;
    const double state_bytes = (larc ? 8.0 : 12.0) * params;
    const double read_bytes = state_bytes + (larc ? 4.0 * params : 0.0);
    double write_bw = 0, read_bw = 0;
    for (int r = 0; r < 3; ++r) {
      const auto [write, read] = disk_bandwidth(dir, static_cast<std::size_t>(state_bytes));
      write_bw = std::max(write_bw, write);
      read_bw = std::max(read_bw, read);
    }
    const double floor = std::max(read_bytes / read_bw, state_bytes / write_bw);
    os::Engine host(ctx, kind, sk::DType::f32, true);
    sk::parallel::OffloadOptions nvme;
    nvme.nvme_path = dir;
    os::Engine disk(ctx, kind, sk::DType::f32, nvme);
    host.step();
    disk.step();
    std::vector<double> host_s, disk_s;
    for (int r = 0; r < rounds; ++r) {
      auto start = std::chrono::steady_clock::now();
      host.step();
      host_s.push_back(seconds_since(start));
      start = std::chrono::steady_clock::now();
      disk.step();
      disk_s.push_back(seconds_since(start));
    }
    const auto& optimizer = *disk.dp->training_state().optimizer;
    const double resident = static_cast<double>(optimizer.state_spill()->resident_bytes());
    std::printf("| %s | %.0f | %.0f | %.2fx | %.0f | %.0f%% | %.1f MB of %.1f |\n",
                sk::optim::is_adam(kind) ? "AdamW" : "LARC-SGD", median(host_s) * 1e3,
                median(disk_s) * 1e3, median(disk_s) / median(host_s), floor * 1e3,
                100.0 * floor / median(disk_s), resident / 1e6, state_bytes / 1e6);
    std::printf("  (disk, best of 3: write %.0f MB/s, read %.0f MB/s)\n", write_bw / 1e6,
                read_bw / 1e6);
  }
  return 0;
}
