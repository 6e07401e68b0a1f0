// The device side of a local world's rendezvous inside captured steps (DeviceBarrierParams,
// comm/device_comm_kernels.hpp): one thread per rank publishes its arrival and spins on the
// others' in device memory, so the ranks' CUDA graphs meet with no host involved. One thread is
// enough and leaves the GPU's other SMs to the ranks still on their way.
#pragma once

#include "shardkit/comm/device_comm_kernels.hpp"
#include "shardkit/core/cuda_check.hpp"

namespace shardkit::comm::cuda {

__device__ inline unsigned long long global_time_ns() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// A template so that every unit including this header shares one definition.
template <int = 0>
__global__ void flag_barrier_kernel(DeviceBarrierParams p) {
  const unsigned long long number = *p.counter + 1;
  *p.counter = number;
  volatile unsigned long long* arrivals = p.arrivals;
  volatile unsigned long long* failed = p.failed;
  // The work this rank queued before the call finished with the kernels before this one, so
  // its writes are visible device-wide; the fence orders the arrival after anything else.
  __threadfence();
  arrivals[p.rank] = number;
  if (*p.gave_up != 0) return;  // this rank already gave up: its count no longer meets theirs
  const unsigned long long start = global_time_ns();
  for (int r = 0; r < p.size; ++r) {
    while (arrivals[r] < number) {
      if (*failed != 0 || global_time_ns() - start > p.timeout_ns) {
        *p.gave_up = number;
        atomicCAS(p.failed, 0ull, static_cast<unsigned long long>(p.rank) + 1);
        return;
      }
      __nanosleep(256);
    }
  }
  __threadfence();  // the kernels after this one read what the others wrote before arriving
}

inline void flag_barrier(CUstream_st* stream, const DeviceBarrierParams& params) {
  flag_barrier_kernel<><<<1, 1, 0, stream>>>(params);
  SK_CUDA_CHECK_LAUNCH("comm flag_barrier_kernel");
}

}  // namespace shardkit::comm::cuda
