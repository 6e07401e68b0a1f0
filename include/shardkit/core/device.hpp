// Devices (CPU or a CUDA GPU by index) and run-time detection of CUDA GPUs.
#pragma once

#include <ostream>
#include <string>

#include "shardkit/core/config.hpp"
#include "shardkit/core/error.hpp"

#if SK_WITH_CUDA
#include "shardkit/core/cuda_check.hpp"
#endif

namespace shardkit {

enum class DeviceType { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  static constexpr Device cpu() { return Device{DeviceType::cpu, 0}; }
  static constexpr Device cuda(int index = 0) { return Device{DeviceType::cuda, index}; }

  constexpr bool is_cpu() const { return type == DeviceType::cpu; }
  constexpr bool is_cuda() const { return type == DeviceType::cuda; }
  friend constexpr bool operator==(const Device&, const Device&) = default;

  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  // As str() prints it; a message part that costs nothing until a check fails.
  friend std::ostream& operator<<(std::ostream& out, const Device& device) {
    return device.is_cpu() ? out << "cpu" : out << "cuda:" << device.index;
  }
};

// Number of usable CUDA GPUs: 0 (never an exception) when the build has no CUDA, or the machine
// has no GPU or no driver.
inline int cuda_device_count() noexcept {
#if SK_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // "no driver" must not leak into later checks
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

inline bool cuda_available() noexcept { return cuda_device_count() > 0; }

// Throws a clear error if `device` cannot be used by this build on this machine.
inline void check_device_usable(Device device) {
  if (device.is_cpu()) return;
  check<NotAvailable>(kWithCuda, "device ", device,
                      " requested, but shardkit was built without CUDA; build with -Dcuda=enabled "
                      "or use Device::cpu()");
  const int count = cuda_device_count();
  check<NotAvailable>(device.index >= 0 && device.index < count, "device ", device,
                      " requested, but this machine has ", count,
                      " usable CUDA GPU(s); pick an index below that or use Device::cpu()");
}

#if SK_WITH_CUDA
// Makes `device` current for the scope and restores the previous device after (each thread has
// its own current device, and a rank thread may share a process with others).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    SK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) SK_CUDA_CHECK(cudaSetDevice(device));
  }
  ~CudaDeviceGuard() { (void)cudaSetDevice(previous_); }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};
#endif

}  // namespace shardkit
