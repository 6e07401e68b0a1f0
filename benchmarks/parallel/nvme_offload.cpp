// Offload to NVMe (parallel/offload.hpp's nvme_path): what a step costs when the optimizer's f32
// master and state live in files instead of host memory. ResNet-50 on one rank (25.6 M
// parameters, f32, gradients already reduced: offload_step.hpp), AdamW and LARC-SGD; per
// optimizer, medians of R steps, alternating the two placements:
//
//   host ms     the step with the master and state in host memory (offload.optimizer)
//   disk ms     the same step with them in files in DIR, streamed through RAM in chunks
//   read MB     what a step must read from disk: the state but what of it is in RAM when
//               the step starts (the chunk the step before ended with, kept there)
//   floor ms    the disk's own time for the bytes that step must move: those reads, and the
//               state written once (AdamW: master, m, v = 12 bytes a parameter; LARC-SGD:
//               master and momentum, 8: on one rank its norms are formed chunk by chunk in
//               the update's pass), measured in the same run as one thread reading
//               that many bytes of a file in DIR (not in the page cache) while another writes
//               as many to a second file and writes them back as the spill does -- reads and
//               writes at once, as in the step: a disk that shares its bandwidth between them
//               takes their sum, one that does not the longer; measured once a round, after
//               the round's steps (this VM's disk rate drifts within a minute), the best
//               of the rounds; the line under each row times the reads alone and the writes
//               alone, once
//   of floor    floor / disk: the fraction of the disk's pace the step reaches
//   in RAM      the state's bytes left in RAM after a step (mincore)
//
// Usage: nvme_offload [DIR, default .] [rounds, default 3] [chunk_numel, default OffloadOptions's]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "offload_step.hpp"
#include "timing.hpp"

namespace sk = shardkit;
namespace os = shardkit::bench::offload_step;

namespace {

constexpr std::size_t kBlock = std::size_t{8} << 20;

using shardkit::bench::median;
using shardkit::bench::seconds_since;

// A file of `bytes` in `dir`, unnamed, written and on the device, not in the page cache.
int file_on_disk(const std::string& dir, std::size_t bytes) {
  const int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  sk::check(fd >= 0, "nvme_offload: cannot create a file in '", dir, "'");
  std::vector<char> buffer(kBlock, 1);
  for (std::size_t at = 0; at < bytes; at += kBlock)
    sk::check(::pwrite(fd, buffer.data(), std::min(kBlock, bytes - at), static_cast<off_t>(at)) > 0,
              "nvme_offload: write failed");
  ::fsync(fd);
  ::posix_fadvise(fd, 0, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  return fd;
}

// Seconds the disk takes to read `read_bytes` of one file and write `write_bytes` to another at
// once (each on a thread of its own, in 8-MiB requests; the writes to the device as the spill
// writes them, without fsync's cache flush). Either may be 0.
double disk_time(const std::string& dir, std::size_t read_bytes, std::size_t write_bytes) {
  const int source = file_on_disk(dir, read_bytes);
  const int target = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  sk::check(target >= 0, "nvme_offload: cannot create a file in '", dir, "'");
  const auto start = std::chrono::steady_clock::now();
  bool read_ok = true, write_ok = true;
  std::thread reader([&] {
    std::vector<char> buffer(kBlock);
    for (std::size_t at = 0; at < read_bytes && read_ok; at += kBlock)
      read_ok = ::pread(source, buffer.data(), std::min(kBlock, read_bytes - at),
                        static_cast<off_t>(at)) > 0;
  });
  std::vector<char> buffer(kBlock, 2);
  for (std::size_t at = 0; at < write_bytes && write_ok; at += kBlock)
    write_ok = ::pwrite(target, buffer.data(), std::min(kBlock, write_bytes - at),
                        static_cast<off_t>(at)) > 0;
  ::sync_file_range(
      target, 0, static_cast<off_t>(write_bytes),
      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
  reader.join();  // (before any check throws: a joinable thread would terminate the program)
  sk::check(read_ok && write_ok, "nvme_offload: ", read_ok ? "a write" : "a read", " in '", dir,
            "' failed");
  const double seconds = seconds_since(start);
  ::close(source);
  ::close(target);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  const std::int64_t chunk_numel = argc > 3 ? std::max<std::int64_t>(1, std::atoll(argv[3]))
                                            : sk::parallel::OffloadOptions{}.chunk_numel;
  sk::Context ctx;
  const double params = static_cast<double>(sk::workloads::kResNet50Params);
  std::printf(
      "ResNet-50 on one rank, f32, %d threads; state files in %s, chunks of %lld elements; "
      "medians of %d steps\n",
      ctx.cpu_threads(), dir.c_str(), static_cast<long long>(chunk_numel), rounds);
  std::printf(
      "| optimizer | host ms | disk ms | disk / host | read MB | floor ms | of floor | in RAM "
      "after a "
      "step |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto kind : {sk::optim::OptimizerKind::adamw, sk::optim::OptimizerKind::larc_sgd}) {
    const bool larc = kind == sk::optim::OptimizerKind::larc_sgd;
    const double state_bytes = (larc ? 8.0 : 12.0) * params;
    const auto bytes = static_cast<std::size_t>(state_bytes);
    os::Engine host(ctx, kind, sk::DType::f32, true);
    sk::parallel::OffloadOptions nvme;
    nvme.nvme_path = dir;
    nvme.chunk_numel = chunk_numel;
    os::Engine disk(ctx, kind, sk::DType::f32, nvme);
    host.step();
    disk.step();
    const auto& spill = *disk.dp->training_state().optimizer->state_spill();
    std::vector<double> host_s, disk_s, floor_s;
    std::vector<std::size_t> step_reads;
    for (int r = 0; r < rounds; ++r) {
      auto start = std::chrono::steady_clock::now();
      host.step();
      host_s.push_back(seconds_since(start));
      // (Not the spill's bytes_read: the kernel's own read-ahead brings part of each chunk in
      // with the one before, uncounted.)
      step_reads.push_back(bytes - std::min(bytes, spill.resident_bytes()));
      start = std::chrono::steady_clock::now();
      disk.step();
      disk_s.push_back(seconds_since(start));
      floor_s.push_back(disk_time(dir, step_reads.back(), bytes));
    }
    // (The best round's disk time, for that round's reads.)
    const auto best = static_cast<std::size_t>(std::min_element(floor_s.begin(), floor_s.end()) -
                                               floor_s.begin());
    const double floor = floor_s[best];
    const double resident = static_cast<double>(spill.resident_bytes());
    std::printf("| %s | %.0f | %.0f | %.2fx | %.1f | %.0f | %.0f%% | %.1f MB of %.1f |\n",
                sk::optim::is_adam(kind) ? "AdamW" : "LARC-SGD", median(host_s) * 1e3,
                median(disk_s) * 1e3, median(disk_s) / median(host_s),
                static_cast<double>(step_reads[best]) / 1e6, floor * 1e3,
                100.0 * floor / median(disk_s), resident / 1e6, state_bytes / 1e6);
    std::printf("  (the same bytes one after the other, once: read %.0f ms, then write %.0f ms)\n",
                disk_time(dir, step_reads[best], 0) * 1e3, disk_time(dir, 0, bytes) * 1e3);
  }
  return 0;
}
