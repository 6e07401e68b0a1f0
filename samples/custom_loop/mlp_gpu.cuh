// The MLP of mlp_cpu.hpp on a CUDA GPU: the same parameters (mlp_param_specs, init_mlp), the
// same maths and the same interface, with cuBLAS for the matrix products and four small
// kernels of our own for the rest. Everything is queued on the rank's stream (the Context's),
// which is also the stream DataParallel's gradient buckets are ordered on: ready(i) right after
// queueing gradient i lets its bucket's communication follow it while the backward goes on.
// Needs nvcc (it defines kernels): custom_loop_gpu.cu includes it, and meson adds that file to
// the sample when CUDA is found.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include <shardkit/autograd/cuda_libraries.hpp>
#include <shardkit/comm/comm.hpp>
#include <shardkit/core/cublas_check.hpp>
#include <shardkit/cuda.hpp>

#include "mlp.hpp"

namespace custom_loop {

namespace kernels {

constexpr int kThreads = 256;

inline unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535));
}

// z[r, c] += b[c]; then ReLU on hidden layers. z is row-major [rows, cols].
__global__ void bias_relu(float* z, const float* b, std::int64_t rows, std::int64_t cols,
                          bool relu) {
  const std::int64_t n = rows * cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const float v = z[i] + b[i % cols];
    z[i] = relu && v <= 0.0f ? 0.0f : v;  // (a NaN stays, as Eigen's cwiseMax keeps it)
  }
}

// ReLU's derivative from its output: the gradient passes where the output was positive.
__global__ void relu_backward(float* delta, const float* out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x)
    if (!(out[i] > 0.0f)) delta[i] = 0.0f;
}

// db[c] += sum over rows of delta[r, c]: one thread per column, rows added in order, so the
// result does not depend on scheduling (neighbouring threads read neighbouring columns).
__global__ void add_column_sums(float* db, const float* delta, std::int64_t rows,
                                std::int64_t cols) {
  const std::int64_t c = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  float sum = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) sum += delta[r * cols + c];
  db[c] += sum;
}

// Softmax cross-entropy over rows of logits [rows, classes], in the CPU's stable form: one warp
// per row (lanes stride over classes), writes (softmax - onehot) / rows as the logits' gradient,
// and stats = {mean loss, correct predictions}. A single block with fixed reduction orders
// keeps the result reproducible; rows are a batch (≤ 4096) and classes few, so one block is enough.
__global__ void softmax_cross_entropy(const float* logits, const std::uint8_t* labels,
                                      std::int64_t rows, int classes, float* grad, float* stats) {
  constexpr int kWarps = kThreads / 32;
  __shared__ double warp_loss[kWarps];
  __shared__ int warp_hits[kWarps];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  double loss = 0;
  int hits = 0;
  for (std::int64_t r = warp; r < rows; r += kWarps) {
    const float* row = logits + r * classes;
    float best = -INFINITY;
    int best_at = classes;
    for (int c = lane; c < classes; c += 32)
      if (row[c] > best) best = row[c], best_at = c;
    for (int offset = 16; offset > 0; offset /= 2) {  // max, ties to the first class (as Eigen)
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_at = __shfl_xor_sync(0xffffffffu, best_at, offset);
      if (other > best || (other == best && other_at < best_at)) best = other, best_at = other_at;
    }
    float sum = 0.0f;
    for (int c = lane; c < classes; c += 32) sum += expf(row[c] - best);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float log_sum = logf(sum);
    const int label = labels[r];
    for (int c = lane; c < classes; c += 32)
      grad[r * classes + c] =
          (expf(row[c] - best - log_sum) - (c == label ? 1.0f : 0.0f)) / static_cast<float>(rows);
    if (lane == 0) {
      loss += static_cast<double>(log_sum - (row[label] - best));
      hits += best_at == label;
    }
  }
  if (lane == 0) warp_loss[warp] = loss, warp_hits[warp] = hits;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    int correct = 0;
    for (int w = 0; w < kWarps; ++w) total += warp_loss[w], correct += warp_hits[w];
    stats[0] = static_cast<float>(total / static_cast<double>(rows));
    stats[1] = static_cast<float>(correct);  // exact: far below 2^24
  }
}

}  // namespace kernels

// Row-major C [m, n] = alpha · op(A) · op(B) + beta · C with op(A) [m, k] and op(B) [k, n].
// cuBLAS is column-major, and a row-major matrix read column-major is its transpose, so we ask
// for Cᵀ = op(B)ᵀ · op(A)ᵀ: the operands swap places and nothing is copied or transposed.
inline void gemm_row_major(cublasHandle_t blas, bool transpose_a, bool transpose_b, int m, int n,
                           int k, float alpha, const float* a, const float* b, float beta,
                           float* c) {
  SK_CUBLAS_CHECK(cublasSgemm(blas, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                              transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b,
                              transpose_b ? k : n, a, transpose_a ? m : k, &beta, c, n));
}

class MlpGpu {
 public:
  MlpGpu(sk::Context& ctx, std::vector<std::int64_t> widths)
      : ctx_(&ctx), widths_(std::move(widths)) {
    sk::check(ctx.device().is_cuda(), "MlpGpu needs a CUDA context, got ", ctx.device(),
              "; use MlpCpu on the CPU");
    for (auto w : widths_)
      sk::check(w > 0 && w <= (1 << 20), "layer width ", w, " is outside [1, 2^20]");
    // The context's cuBLAS handle (autograd's per-context resource, bound to ctx's stream).
    blas_ = sk::autograd::cuda::libraries(ctx).blas();
    stats_ =
        sk::zeros(ctx, {2}, sk::DType::f32, sk::MemoryCategory::activations);  // no forward yet
  }

  // Copies a batch [B, widths[0]] (normalised on the host) into the device buffers the next
  // forward(params) reads: the same buffers at every step of one batch size, so a captured
  // step (--graph) reads each step's batch staged before it runs.
  void stage(const Batch& batch) {
    check_batch(widths_, batch);
    sk::CudaDeviceGuard guard(ctx_->device().index);
    const auto rows = batch.rows;
    sk::check(rows <= (1 << 20), "a batch of ", rows, " images; MlpGpu takes at most 2^20 at once");
    reserve(rows);
    // Pageable sources are staged by the runtime before these return, so the host buffers may
    // be reused at once.
    SK_CUDA_CHECK(cudaMemcpyAsync(activations_[0].data_ptr(), batch.pixels.data(),
                                  sizeof(float) * batch.pixels.size(), cudaMemcpyHostToDevice,
                                  ctx_->stream()));
    SK_CUDA_CHECK(cudaMemcpyAsync(labels_.data_ptr(), batch.labels.data(), batch.labels.size(),
                                  cudaMemcpyHostToDevice, ctx_->stream()));
  }

  // Forward on the staged batch; keeps the activations for backward. Loss and hits stay on the
  // device until loss() / correct().
  template <MlpParams Params>
  void forward(Params& params) {
    sk::check<sk::StateError>(rows_ > 0, "MlpGpu::forward: no batch staged");
    sk::CudaDeviceGuard guard(ctx_->device().index);
    const auto rows = rows_;
    const auto layers = widths_.size() - 1;
    for (std::size_t l = 0; l < layers; ++l) {
      const auto in = widths_[l], out = widths_[l + 1];
      float* z = activations_[l + 1].data<float>();
      params.enter(l, Pass::forward);
      // (Held until the kernels are queued: under mixed precision they are f32 copies, freed
      // in stream order after them.)
      const sk::Tensor weight = params.param(2 * l), bias = params.param(2 * l + 1);
      gemm_row_major(blas_, false, true, int(rows), int(out), int(in), 1.0f,  // z = a · wᵀ
                     activations_[l].data<float>(), weight.template data<float>(), 0.0f, z);
      kernels::bias_relu<<<kernels::blocks_for(rows * out), kernels::kThreads, 0, ctx_->stream()>>>(
          z, bias.template data<float>(), rows, out, l + 1 < layers);
      SK_CUDA_CHECK_LAUNCH("bias_relu");
      params.leave(l, Pass::forward);  // stream-ordered: frees after the kernels that read it
    }
    kernels::softmax_cross_entropy<<<1, kernels::kThreads, 0, ctx_->stream()>>>(
        activations_[layers].data<float>(), labels_.data<std::uint8_t>(), rows, int(widths_.back()),
        deltas_[layers].data<float>(), stats_.data<float>());
    SK_CUDA_CHECK_LAUNCH("softmax_cross_entropy");
  }

  template <MlpParams Params>
  void forward(Params& params, const Batch& batch) {
    stage(batch);
    forward(params);
  }

  // Mean loss and correct predictions of the last forward; each waits for it to finish.
  float loss() const { return sk::to_vector<float>(*ctx_, stats_)[0]; }
  int correct() const { return static_cast<int>(sk::to_vector<float>(*ctx_, stats_)[1]); }

  // Backward from the last forward, as MlpCpu's: adds each gradient into grad_of(i) (beta = 1
  // in cuBLAS, += in our kernel) and calls ready(i) once it is queued -- last layer first.
  template <MlpParams Params>
  void backward(Params& params, const std::function<sk::Tensor(std::size_t)>& grad_of,
                const std::function<void(std::size_t)>& ready) {
    sk::CudaDeviceGuard guard(ctx_->device().index);
    const auto rows = rows_;
    const auto layers = widths_.size() - 1;
    for (std::size_t l = layers; l-- > 0;) {
      const auto in = widths_[l], out = widths_[l + 1];
      const float* delta = deltas_[l + 1].data<float>();
      params.enter(l, Pass::backward);
      gemm_row_major(blas_, true, false, int(out), int(in), int(rows), 1.0f,  // dw += δᵀ · a
                     delta, activations_[l].data<float>(), 1.0f, grad_of(2 * l).data<float>());
      ready(2 * l);
      kernels::add_column_sums<<<kernels::blocks_for(out), kernels::kThreads, 0, ctx_->stream()>>>(
          grad_of(2 * l + 1).data<float>(), delta, rows, out);
      SK_CUDA_CHECK_LAUNCH("add_column_sums");
      ready(2 * l + 1);
      if (l == 0) {
        params.leave(l, Pass::backward);
        break;
      }
      float* previous = deltas_[l].data<float>();
      const sk::Tensor weight = params.param(2 * l);
      gemm_row_major(blas_, false, false, int(rows), int(in), int(out), 1.0f,  // δ' = δ · w
                     delta, weight.template data<float>(), 0.0f, previous);
      params.leave(l, Pass::backward);
      kernels::
          relu_backward<<<kernels::blocks_for(rows * in), kernels::kThreads, 0, ctx_->stream()>>>(
              previous, activations_[l].data<float>(), rows * in);
      SK_CUDA_CHECK_LAUNCH("relu_backward");
    }
  }

 private:
  // Device buffers for a batch of `rows`: made again only when the batch size changes
  // (training batches, then the larger evaluation batches). Stream-ordered, so the old ones
  // are freed after the work that uses them.
  void reserve(std::int64_t rows) {
    if (rows == rows_) return;
    const auto layers = widths_.size() - 1;
    activations_.assign(layers + 1, sk::Tensor());
    deltas_.assign(layers + 1, sk::Tensor());
    for (std::size_t l = 0; l <= layers; ++l) {
      activations_[l] =
          sk::empty(*ctx_, {rows, widths_[l]}, sk::DType::f32, sk::MemoryCategory::activations);
      if (l > 0)  // the gradient of layer l's output, before its ReLU
        deltas_[l] =
            sk::empty(*ctx_, {rows, widths_[l]}, sk::DType::f32, sk::MemoryCategory::activations);
    }
    labels_ = sk::empty(*ctx_, {rows}, sk::DType::u8, sk::MemoryCategory::activations);
    rows_ = rows;
  }

  sk::Context* ctx_;
  std::vector<std::int64_t> widths_;
  cublasHandle_t blas_ = nullptr;
  std::int64_t rows_ = 0;
  std::vector<sk::Tensor> activations_;  // [0]: the images; [l]: layer l's output
  std::vector<sk::Tensor> deltas_;       // [layers]: the logits' gradient
  sk::Tensor labels_, stats_;            // stats_: {mean loss, correct predictions}
};

// The GPU for the training loop (train.hpp): MlpGpu and CUDA
// contexts -- local ranks share GPU 0 (the in-process communicator over device memory); under
// mpirun each process takes the GPU of its local rank and make_communicator gives it NCCL.
struct GpuDevice {
  static constexpr const char* name = "gpu";
  using Mlp = MlpGpu;
  static sk::comm::RunRanksOptions run_options() { return sk::comm::cuda_run_options(0); }
  static sk::ContextOptions mpi_context(const sk::comm::LaunchInfo& launch, std::uint64_t seed) {
    const int gpus = sk::cuda_device_count();
    sk::check<sk::NotAvailable>(launch.local_rank < gpus, "local rank ", launch.local_rank,
                                " needs a GPU of its own (NCCL puts one rank on one GPU) but this "
                                "machine has ",
                                gpus, "; start at most ", gpus,
                                " processes per machine, or use --device cpu");
    return sk::cuda_context_options(launch.local_rank, launch.rank, seed);
  }
};

}  // namespace custom_loop
