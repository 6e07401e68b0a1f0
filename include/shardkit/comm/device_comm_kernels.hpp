// The table of device kernels the local backend needs for collectives over CUDA memory. Host
// headers compile with plain g++ and cannot launch kernels, so kernels/comm/reduce_kernels.cuh
// (compiled by nvcc) fills this table and the caller hands it to the local world, the way core
// hands DeviceKernels to a Context. Copies need no kernel: the host calls cudaMemcpyAsync.
// Inside a captured step the ranks meet on the device instead of the host (flag_barrier).
#pragma once

#include <cstddef>

#include "shardkit/comm/reduction.hpp"
#include "shardkit/core/dtype.hpp"

struct CUstream_st;  // cudaStream_t without CUDA's headers

namespace shardkit::comm {

// Up to this many ranks of one local world may reduce device memory in one kernel: the source
// and destination pointers travel by value in the kernel's parameters.
inline constexpr int kMaxLocalDeviceRanks = 32;

// Element i of every destination <- reduction over sources[0..source_count) of element i, in
// rank order (reduction.hpp's reduce_element). Built on the host, passed to the kernel by value.
struct DeviceReduceParams {
  const void* sources[kMaxLocalDeviceRanks] = {};
  void* destinations[kMaxLocalDeviceRanks] = {};
  int source_count = 0;
  int destination_count = 0;
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
};

// One rank's wait at a device-side rendezvous of a local world (comm/device_rendezvous.hpp):
// the rank counts its waits in `counter`, publishes the count in arrivals[rank] and waits until
// every rank's arrival has reached it. A rank that waits longer than `timeout_ns` -- or finds
// that another rank gave up -- writes the count it gave up at into `gave_up` (first time only),
// names itself in `failed` (rank + 1, first rank only) and from then on waits no more: the host
// reads the verdict at its next wait (Context::defer_check) instead of the GPU hanging.
struct DeviceBarrierParams {
  unsigned long long* arrivals = nullptr;  // [size]
  unsigned long long* counter = nullptr;   // this rank's
  unsigned long long* gave_up = nullptr;   // this rank's
  unsigned long long* failed = nullptr;    // the world's
  int rank = 0;
  int size = 0;
  unsigned long long timeout_ns = 0;
};

struct DeviceCommKernels {
  // Queues the reduction on `stream` (the current device must be the buffers' device).
  void (*reduce)(CUstream_st* stream, const DeviceReduceParams& params);
  // Queues one rank's wait at the world's rendezvous on `stream` (a single-thread kernel).
  void (*flag_barrier)(CUstream_st* stream, const DeviceBarrierParams& params);
};

}  // namespace shardkit::comm
