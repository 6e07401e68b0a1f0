// The CPU's DeviceKernels (device_kernels.hpp): the loops of cpu_tensor_kernels.hpp behind the
// same five entries a CUDA Context's table has, so tensor_ops.hpp calls either by the tensor's
// device. Where the CPU's tables are compiled once, this one in
// kernels/shardkit_cpu.cpp (core/config.hpp, SK_CPU_TABLES_ELSEWHERE), the table is only
// declared here and the loops' header is not read.
#pragma once

#include "shardkit/core/config.hpp"
#include "shardkit/core/device_kernels.hpp"

#if SK_CPU_TABLES_ELSEWHERE
namespace shardkit {
inline namespace SK_CPU_KERNELS_ABI {  // (core/config.hpp)
const DeviceKernels& cpu_tensor_kernels();
}
}  // namespace shardkit
#else
#include "shardkit/core/cpu_tensor_kernels.hpp"

namespace shardkit {
inline namespace SK_CPU_KERNELS_ABI {

SK_CPU_KERNELS_LINKAGE const DeviceKernels& cpu_tensor_kernels() {
  static constexpr DeviceKernels kTable{.fill = &detail::fill_on_host,
                                        .copy = &detail::copy_on_host,
                                        .add = &detail::add_on_host,
                                        .divide = &detail::divide_on_host,
                                        .random = &detail::random_on_host};
  return kTable;
}

}  // namespace SK_CPU_KERNELS_ABI
}  // namespace shardkit
#endif
