// CudaStream: an owned, non-blocking CUDA stream on one device (RAII).
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/device.hpp"

namespace shardkit {

class CudaStream {
 public:
  explicit CudaStream(int device) : device_(device) {
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(cudaStreamCreateWithFlags(&handle_, cudaStreamNonBlocking));
  }
  ~CudaStream() {
    // Work still queued (e.g. stream-ordered frees) must finish before the stream goes.
    (void)cudaStreamSynchronize(handle_);
    (void)cudaStreamDestroy(handle_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return handle_; }
  int device() const { return device_; }
  void synchronize() const { SK_CUDA_CHECK(cudaStreamSynchronize(handle_)); }

 private:
  int device_;
  cudaStream_t handle_ = nullptr;
};

}  // namespace shardkit

#endif  // SK_WITH_CUDA
