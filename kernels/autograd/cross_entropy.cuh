// Cross-entropy with hard (i64 class index) or soft (probability) targets: per-row log-softmax
// and loss, their mean in a fixed order, and the backward.
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/tape.hpp"

namespace shardkit::autograd::cuda_kernels {

// One block per row: log-softmax of the row and the row's loss. A hard label outside [0, cols)
// must not index the row, so its loss becomes NaN and *bad_label keeps max(rows - row) over the
// bad rows: 0 when every label is valid, else the first bad row whatever order blocks run in.
template <class T>
__global__ void cross_entropy_rows_kernel(const T* x, const void* target, bool hard, T* log_probs,
                                          Acc<T>* row_loss, std::int64_t cols,
                                          unsigned long long* bad_label) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  A max = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A v = load<A>(x, at + c);
    max = v > max ? v : max;
  }
  max = block_max(max);
  A sum = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    sum += exp(load<A>(x, at + c) - max);
  const A log_sum = ::log(block_sum(sum));
  A loss = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A lp = load<A>(x, at + c) - max - log_sum;
    store(log_probs, at + c, lp);
    if (!hard) loss -= load<A>(static_cast<const T*>(target), at + c) * lp;
  }
  loss = block_sum(loss);
  if (threadIdx.x == 0) {
    if (hard) {
      const std::int64_t label = static_cast<const std::int64_t*>(target)[blockIdx.x];
      if (label >= 0 && label < cols) {
        loss = -(load<A>(x, at + label) - max - log_sum);
      } else {
        loss = A(NAN);
        atomicMax(bad_label, static_cast<unsigned long long>(gridDim.x - blockIdx.x));
      }
    }
    row_loss[blockIdx.x] = loss;
  }
}

// One block: the mean of the row losses, in a fixed order.
template <class A>
__global__ void mean_kernel(const A* values, A* out, std::int64_t n) {
  A sum = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out = sum / A(n);
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* log_probs, const void* target, bool hard,
                                              const Acc<T>* grad_loss, T* gx, std::int64_t rows,
                                              std::int64_t cols) {
  using A = Acc<T>;
  const std::int64_t at = blockIdx.x * cols;
  const A scale = *grad_loss / A(rows);
  A mass = 1;
  if (!hard) {
    A m = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      m += load<A>(static_cast<const T*>(target), at + c);
    mass = block_sum(m);
  }
  const std::int64_t label = hard ? static_cast<const std::int64_t*>(target)[blockIdx.x] : -1;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const A p = exp(load<A>(log_probs, at + c));
    const A t = hard ? A(c == label ? 1 : 0) : load<A>(static_cast<const T*>(target), at + c);
    store(gx, at + c, scale * (p * mass - t));
  }
}

// The context's record of the first bad hard label since the host last waited on it
// (i64 [4] on the device: found, row, label, classes), written by a one-thread kernel after each
// forward that found one and no earlier one did.
struct BadLabelRecord {
  Tensor values;
};

template <int = 0>
__global__ void record_bad_label_kernel(const unsigned long long* bad_label,
                                        const std::int64_t* target, std::int64_t rows,
                                        std::int64_t cols, std::int64_t* record) {
  if (*bad_label == 0 || record[0] != 0) return;
  const std::int64_t row = rows - static_cast<std::int64_t>(*bad_label);
  record[0] = 1;
  record[1] = row;
  record[2] = target[row];
  record[3] = cols;
}

// Hard labels are on the device here (cross_entropy wants the target beside the logits), out of
// reach of the host-side range check the CPU path does. The rows kernel flags the first bad row,
// a second kernel keeps the first bad call's row and label in the context's record, and the
// check reads the record when the host next waits on the context (Context::defer_check): an
// InvalidArgument at the next read, as CUDA reports a faulting kernel, instead of a stream
// synchronisation at every forward (which kept the host from running ahead of the GPU).
inline void check_hard_labels(Context& ctx, const Tensor& bad_label, const Tensor& target,
                              std::int64_t rows, std::int64_t cols) {
  BadLabelRecord& record = ctx.resource<BadLabelRecord>([&] {
    auto made = std::make_shared<BadLabelRecord>();
    made->values = zeros(ctx, {4}, DType::i64);
    return made;
  });
  record_bad_label_kernel<>
      <<<1, 1, 0, ctx.stream()>>>(static_cast<const unsigned long long*>(bad_label.data_ptr()),
                                  static_cast<const std::int64_t*>(target.data_ptr()), rows, cols,
                                  record.values.data<std::int64_t>());
  SK_CUDA_CHECK_LAUNCH("record_bad_label_kernel");
  ctx.defer_check("cross_entropy labels", [values = record.values, stream = ctx.stream(),
                                           device = ctx.device().index] {
    CudaDeviceGuard guard(device);
    std::int64_t seen[4];
    SK_CUDA_CHECK(cudaMemcpy(seen, values.data_ptr(), sizeof seen, cudaMemcpyDeviceToHost));
    if (seen[0] == 0) return;
    // Re-armed on the context's stream: the legacy stream's memset would not be ordered
    // before the next record_bad_label_kernel (the context's stream does not block on it).
    SK_CUDA_CHECK(cudaMemsetAsync(values.data_ptr(), 0, sizeof seen, stream));
    fail<InvalidArgument>("cross_entropy: target class ", seen[2], " at row ", seen[1],
                          " is outside [0, ", seen[3],
                          ") (found by the GPU, raised at the host's next wait on it)");
  });
}

inline void cross_entropy_forward(Context& ctx, const Tensor& x, const Tensor& target,
                                  const Tensor& log_probs, const Tensor& loss, std::int64_t rows,
                                  std::int64_t cols) {
  CudaDeviceGuard guard(ctx.device().index);
  const bool hard = target.dtype() == DType::i64;
  Tensor bad_label;
  if (hard) {
    bad_label = empty(ctx, {1}, DType::i64, MemoryCategory::activations);
    SK_CUDA_CHECK(cudaMemsetAsync(bad_label.data_ptr(), 0, sizeof(std::int64_t), ctx.stream()));
  }
  visit_floating(x.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    Tensor row_loss = empty(ctx, {rows}, dtype_of<A>, MemoryCategory::activations);
    cross_entropy_rows_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), target.data_ptr(), hard,
        static_cast<T*>(log_probs.data_ptr()), static_cast<A*>(row_loss.data_ptr()), cols,
        hard ? static_cast<unsigned long long*>(bad_label.data_ptr()) : nullptr);
    SK_CUDA_CHECK_LAUNCH("cross_entropy_rows_kernel");
    mean_kernel<A><<<1, kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const A*>(row_loss.data_ptr()), static_cast<A*>(loss.data_ptr()), rows);
    SK_CUDA_CHECK_LAUNCH("mean_kernel");
  });
  if (hard) check_hard_labels(ctx, bad_label, target, rows, cols);
}

inline void cross_entropy_backward(Context& ctx, const Tensor& log_probs, const Tensor& target,
                                   const Tensor& grad_loss, const Tensor& grad_x, std::int64_t rows,
                                   std::int64_t cols) {
  if (rows == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  const bool hard = target.dtype() == DType::i64;
  visit_floating(log_probs.dtype(), "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const Tensor g =
        grad_loss.dtype() == dtype_of<A> ? grad_loss : cast(ctx, grad_loss, dtype_of<A>);
    cross_entropy_backward_kernel<T><<<row_grid(rows), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(log_probs.data_ptr()), target.data_ptr(), hard,
        static_cast<const A*>(g.data_ptr()), static_cast<T*>(grad_x.data_ptr()), rows, cols);
    SK_CUDA_CHECK_LAUNCH("cross_entropy_backward_kernel");
  });
}

}  // namespace shardkit::autograd::cuda_kernels
