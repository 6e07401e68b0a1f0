// Which device the sample trains on, and the one place that knows whether this build has a GPU
// path. The CPU path (train<CpuDevice>) is compiled here, by the host compiler; the GPU path
// (train<GpuDevice>) is compiled by nvcc in custom_loop_gpu.cu, which meson adds when shardkit
// is built with CUDA (SK_WITH_CUDA). Two translation units, because nvcc compiles Eigen without
// SIMD: the CPU MLP built by nvcc would be ~3x slower (and round differently).
#pragma once

#include <string>

#include "mlp_cpu.hpp"
#include "train.hpp"

namespace custom_loop {

inline constexpr bool kGpuPathBuilt = SK_WITH_CUDA != 0;

enum class DeviceChoice { cpu, gpu, skip };

// --device auto|cpu|gpu: auto takes the GPU when this build has the GPU path and the machine a
// GPU. An explicit gpu that cannot run is an error naming the fix -- unless the caller is a test
// harness (skip_without_gpu), which wants "skipped" rather than a failure on GPU-less machines.
inline DeviceChoice choose_device(const std::string& flag, bool skip_without_gpu) {
  const bool present = sk::cuda_device_count() > 0;
  if (flag == "cpu") return DeviceChoice::cpu;
  if (flag == "auto") return kGpuPathBuilt && present ? DeviceChoice::gpu : DeviceChoice::cpu;
  sk::check(flag == "gpu", "--device ", flag, " is not a device; use auto, cpu or gpu");
  if (kGpuPathBuilt && present) return DeviceChoice::gpu;
  if (skip_without_gpu) return DeviceChoice::skip;
  sk::check<sk::NotAvailable>(kGpuPathBuilt,
                              "--device gpu, but this custom_loop was built without CUDA; install "
                              "the CUDA toolkit (nvcc, cuBLAS, NCCL) and reconfigure with meson "
                              "setup --reconfigure -Dcuda=enabled, or use --device cpu");
  sk::fail<sk::NotAvailable>(
      "--device gpu, but this machine has no usable CUDA GPU (no device "
      "or no driver: see nvidia-smi); use --device cpu or --device auto");
}

inline Results train_on(DeviceChoice choice, const Setup& setup) {
#if SK_WITH_CUDA
  if (choice == DeviceChoice::gpu) return train_gpu(setup);
#endif
  sk::check(choice == DeviceChoice::cpu, "train_on: this build has no GPU path");
  return train<CpuDevice>(setup);
}

}  // namespace custom_loop
