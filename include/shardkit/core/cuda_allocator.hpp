// Stream-ordered CUDA device allocator (cudaMallocAsync on the context's stream), counted like
// every other allocation. The pool keeps freed memory for reuse, as a caching allocator does.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <cstdint>
#include <memory>

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/cuda_stream.hpp"

namespace shardkit {

class CudaAllocator final : public Allocator {
 public:
  // `stream` orders allocations and frees; the allocator keeps it alive for its last free.
  explicit CudaAllocator(std::shared_ptr<CudaStream> stream)
      : device_(stream->device()), stream_(std::move(stream)) {
    CudaDeviceGuard guard(device_);
    cudaMemPool_t pool;
    SK_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    // Keep freed blocks in the pool instead of returning them at every synchronisation.
    std::uint64_t keep_everything = UINT64_MAX;
    SK_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything));
  }

  Device device() const override { return Device::cuda(device_); }
  cudaStream_t stream() const { return stream_->get(); }

  void trim_device_pool() override {
    CudaDeviceGuard guard(device_);
    SK_CUDA_CHECK(cudaStreamSynchronize(stream_->get()));  // (its frees reached)
    cudaMemPool_t pool;
    SK_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
    SK_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  }

 protected:
  void* do_allocate(std::size_t bytes) override {
    CudaDeviceGuard guard(device_);
    void* pointer = nullptr;
    const cudaError_t status = cudaMallocAsync(&pointer, bytes, stream_->get());
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;  // reported as OutOfMemory with the context's usage by Allocator
    }
    SK_CUDA_CHECK(status);
    return pointer;
  }

  // A captured step's blocks (capture_pool.hpp): cudaMalloc, which is no operation of the
  // captured stream (cudaMallocAsync there would become an allocation node of the graph). The
  // capture runs in relaxed mode, which allows it. Freed when the graph is gone, outside any
  // capture (cudaFree synchronises the device).
  void* do_allocate_reserved(std::size_t bytes) override {
    CudaDeviceGuard guard(device_);
    void* pointer = nullptr;
    const cudaError_t status = cudaMalloc(&pointer, bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    SK_CUDA_CHECK(status);
    return pointer;
  }
  void do_deallocate_reserved(void* pointer, std::size_t) noexcept override {
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_)
      (void)cudaSetDevice(device_);
    if (cudaFree(pointer) != cudaSuccess) (void)cudaGetLastError();
    if (previous != device_) (void)cudaSetDevice(previous);
  }

  void do_deallocate(void* pointer, std::size_t) noexcept override {
    // Frees run from destructors: an error here cannot be thrown, and the pool reclaims the
    // block once the stream reaches this point.
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_)
      (void)cudaSetDevice(device_);
    if (cudaFreeAsync(pointer, stream_->get()) != cudaSuccess) (void)cudaGetLastError();
    if (previous != device_) (void)cudaSetDevice(previous);
  }

 private:
  int device_;
  std::shared_ptr<CudaStream> stream_;
};

// Page-locked host memory (fast, asynchronous host<->device copies), counted on the host side.
// Every size is cached when freed: cudaMallocHost costs a millisecond or more, and an offloaded
// optimizer step allocates the same small buffers each time.
class PinnedHostAllocator final : public CachingHostAllocator {
 public:
  explicit PinnedHostAllocator(std::size_t max_cached_bytes = std::size_t{1} << 30)
      : CachingHostAllocator(1, max_cached_bytes) {}
  ~PinnedHostAllocator() override { release_cached(); }

 protected:
  void* raw_allocate(std::size_t bytes) noexcept override {
    void* pointer = nullptr;
    if (cudaMallocHost(&pointer, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return pointer;
  }
  void raw_free(void* pointer) noexcept override {
    if (cudaFreeHost(pointer) != cudaSuccess) (void)cudaGetLastError();
  }
};

}  // namespace shardkit

#endif  // SK_WITH_CUDA
