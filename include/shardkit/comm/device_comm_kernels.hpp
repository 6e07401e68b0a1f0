// The table of device kernels the local backend needs for collectives over CUDA memory. Host
// headers compile with plain g++ and cannot launch kernels, so kernels/comm/reduce_kernels.cuh
// (compiled by nvcc) fills this table and the caller hands it to the local world, the way core
// hands DeviceKernels to a Context. Copies need no kernel: the host calls cudaMemcpyAsync.
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

struct DeviceCommKernels {
  // Queues the reduction on `stream` (the current device must be the buffers' device).
  void (*reduce)(CUstream_st* stream, const DeviceReduceParams& params);
};

}  // namespace shardkit::comm
