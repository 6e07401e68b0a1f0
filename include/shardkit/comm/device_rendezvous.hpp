// DeviceRendezvous: where the ranks of a local world meet inside captured steps. An eager
// device collective meets on the host (LocalWorld::post) and runs on the world's stream, joined
// to the ranks' streams by events -- which one rank's CUDA graph cannot hold. Inside a capture
// each rank's graph instead carries its own share of the call (comm/rank_share.hpp) between two
// waits on flags in device memory (DeviceBarrierParams):
//
//   rank's stream:  ... | wait: all arrived | write own receive buffer | wait: all read | ...
//
// so a replay runs with no host on any side. The host still meets once, at the capture, to
// check the calls against each other and learn the other ranks' buffers; a replay reads the
// captured addresses, which the step graphs keep fixed.
//
// A rank's waits are counted on the device, so the ranks' counts stay in step as long as every
// rank replays the same graphs in the same order -- the collective contract. A rank that waits
// past the world's timeout gives up (and so, at once, do the others): its kernels stop waiting,
// and check() raises the TimeoutError at the host's next wait on the context instead of the GPU
// hanging. The memory is one block of 64-bit words: arrivals[size], counters[size],
// gave_up[size], failed.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

class DeviceRendezvous {
 public:
  // Allocates and zeroes the flags on `device`; `stream` (not under capture) orders the zeroing.
  DeviceRendezvous(int size, int device, cudaStream_t stream) : size_(size), device_(device) {
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(cudaMalloc(&words_, bytes()));
    SK_CUDA_CHECK(cudaMemsetAsync(words_, 0, bytes(), stream));
    SK_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  ~DeviceRendezvous() {
    CudaDeviceGuard guard(device_);
    (void)cudaFree(words_);
  }
  DeviceRendezvous(const DeviceRendezvous&) = delete;
  DeviceRendezvous& operator=(const DeviceRendezvous&) = delete;

  int device() const { return device_; }

  DeviceBarrierParams barrier(int rank, std::chrono::milliseconds timeout) const {
    DeviceBarrierParams p;
    p.arrivals = words_;
    p.counter = words_ + size_ + rank;
    p.gave_up = words_ + 2 * size_ + rank;
    p.failed = words_ + 3 * size_;
    p.rank = rank;
    p.size = size_;
    p.timeout_ns = static_cast<unsigned long long>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count());
    return p;
  }

  // Throws TimeoutError when this world's ranks stopped meeting: `rank` gave up, or another did.
  // Runs on the host after the rank's stream finished (Context::defer_check).
  void check(int rank, std::chrono::milliseconds timeout) const {
    unsigned long long gave_up = 0, failed = 0;
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(
        cudaMemcpy(&gave_up, words_ + 2 * size_ + rank, sizeof gave_up, cudaMemcpyDeviceToHost));
    SK_CUDA_CHECK(cudaMemcpy(&failed, words_ + 3 * size_, sizeof failed, cudaMemcpyDeviceToHost));
    if (failed == 0) return;
    fail<TimeoutError>(
        "a local collective inside a captured step on rank ", rank, " (world of ", size_,
        "): rank ", failed - 1, " waited more than ", timeout.count(),
        " ms for the others on the device",
        gave_up != 0 ? shardkit::detail::concat(" (this rank gave up at its wait #", gave_up, ")")
                     : std::string(),
        "; every rank of a local world must replay its captured steps the same number of times "
        "and in the same order (found by the GPU, raised at the host's next wait on it)");
  }

 private:
  std::size_t bytes() const { return (3 * static_cast<std::size_t>(size_) + 1) * 8; }

  int size_;
  int device_;
  unsigned long long* words_ = nullptr;
};

}  // namespace shardkit::comm

#endif  // SK_WITH_CUDA
