// CudaEvent: an owned CUDA event without timing (RAII), for stream ordering between ranks.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/device.hpp"

namespace shardkit::comm {

class CudaEvent {
 public:
  explicit CudaEvent(int device) : device_(device) {
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() { (void)cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }
  void record(cudaStream_t stream) {
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  // True once the work recorded before the event has finished; throws that work's error.
  bool query() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    SK_CUDA_CHECK(status);
    return true;
  }
  void synchronize() const { SK_CUDA_CHECK(cudaEventSynchronize(event_)); }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace shardkit::comm

#endif  // SK_WITH_CUDA
