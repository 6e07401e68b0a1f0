// Element-wise and per-channel autograd kernels: pointwise ops (axpby, mul, relu, sigmoid and
// their backwards), per-channel sums, bias add and scale, and batch-norm's eval-mode backward.
#pragma once

#include "kernels/autograd/common.cuh"
#include "shardkit/autograd/pointwise_math.hpp"

namespace shardkit::autograd::cuda_kernels {

#define SK_GRID_LOOP(i, n)                                                            \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += std::int64_t{gridDim.x} * blockDim.x)

// 16 bytes of T: what one 128-bit load or store moves (4 f32, 8 f16 or bf16, 2 f64).
template <class T>
struct alignas(16) Pack16 {
  static constexpr int kCount = 16 / static_cast<int>(sizeof(T));
  T v[kCount];
};

// out = math(a, b, alpha, beta) element by element (b == nullptr: the op reads no b, and math
// gets 0). `Vector`: out, a and b start on 16-byte boundaries, and each thread moves whole
// Pack16s -- one 128-bit load per input and one store per Pack16, the form that reaches copy
// bandwidth (a 4-byte access per thread needs four times the memory transactions in flight) --
// with the n % kCount elements after the last whole Pack16 done one by one. The math is the same
// functor, element by element, either way: the same bits as the scalar form.
template <class T, class Math, bool Vector>
__global__ void pointwise_kernel(Math math, T* out, const T* a, const T* b, std::int64_t n,
                                 Acc<T> alpha, Acc<T> beta) {
  using A = Acc<T>;
  std::int64_t done = 0;
  if constexpr (Vector) {
    using P = Pack16<T>;
    const std::int64_t packs = n / P::kCount;
    const P* ap = reinterpret_cast<const P*>(a);
    const P* bp = reinterpret_cast<const P*>(b);
    P* op = reinterpret_cast<P*>(out);
    SK_GRID_LOOP(p, packs) {
      const P x = ap[p];
      P y{};
      if (bp != nullptr) y = bp[p];
      P r;
#pragma unroll
      for (int k = 0; k < P::kCount; ++k)
        store(r.v, k, math(load<A>(x.v, k), bp == nullptr ? A(0) : load<A>(y.v, k), alpha, beta));
      op[p] = r;
    }
    done = packs * P::kCount;
  }
  SK_GRID_LOOP(j, n - done) {
    const std::int64_t i = done + j;
    store(out, i, math(load<A>(a, i), b == nullptr ? A(0) : load<A>(b, i), alpha, beta));
  }
}

// Summed in double, as the host's channel sums: a bias gradient adds N x H x W values (3.2 M for
// a batch of 256 at 112 x 112), whose f32 running sums drifted by up to 1e-4.
template <class T, class O>
__global__ void channel_sum_kernel(const T* x, O* out, std::int64_t outer, std::int64_t channels,
                                   std::int64_t inner) {
  const std::int64_t c = blockIdx.x;
  double sum = 0;
  for (std::int64_t j = threadIdx.x; j < outer * inner; j += blockDim.x) {
    const std::int64_t o = j / inner, i = j % inner;
    sum += load<double>(x, (o * channels + c) * inner + i);
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) store(out, c, sum);
}

template <class T>
__global__ void channel_bias_add_kernel(T* y, const T* bias, std::int64_t n, std::int64_t channels,
                                        std::int64_t inner) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) { store(y, i, load<A>(y, i) + load<A>(bias, (i / inner) % channels)); }
}

// out = x * scale[channel], in the accumulator type as the CPU's (ScaleMath: the same bits).
template <class T>
__global__ void channel_scale_kernel(const T* x, const T* scale, T* out, std::int64_t n,
                                     std::int64_t channels, std::int64_t inner) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) {
    store(out, i, ScaleMath{}(load<A>(x, i), A(0), load<A>(scale, (i / inner) % channels), A(0)));
  }
}

template <class T, class S>
__global__ void batch_norm_eval_backward_kernel(const T* x, const T* gy, const S* weight,
                                                const S* mean, const S* var, Acc<T> eps, T* gx,
                                                T* gy_xhat, std::int64_t n, std::int64_t channels,
                                                std::int64_t inner) {
  using A = Acc<T>;
  SK_GRID_LOOP(i, n) {
    const std::int64_t c = (i / inner) % channels;
    const A invstd = A(1) / sqrt(load<A>(var, c) + eps);
    const A g = load<A>(gy, i);
    if (gx != nullptr) store(gx, i, g * load<A>(weight, c) * invstd);
    store(gy_xhat, i, g * (load<A>(x, i) - load<A>(mean, c)) * invstd);
  }
}

#undef SK_GRID_LOOP

inline bool starts_on_16_bytes(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

inline void pointwise(Context& ctx, Pointwise op, const Tensor& out, const Tensor& a,
                      const Tensor& b, double alpha, double beta) {
  const std::int64_t n = out.numel();
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(out.dtype(), "pointwise op", [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    const T* ap = static_cast<const T*>(a.data_ptr());
    const T* bp = b.defined() && !(op == Pointwise::axpby && beta == 0)
                      ? static_cast<const T*>(b.data_ptr())
                      : nullptr;
    const bool vector = starts_on_16_bytes(o) && starts_on_16_bytes(ap) &&
                        (bp == nullptr || starts_on_16_bytes(bp));
    // A thread per Pack16 when vectorised (the tail's few elements ride along), else per element.
    const std::int64_t work = vector ? n / Pack16<T>::kCount + n % Pack16<T>::kCount : n;
    with_pointwise_math(op, bp != nullptr, [&](auto math) {
      using Math = decltype(math);
      if (vector)
        pointwise_kernel<T, Math, true><<<grid_for(work), kThreadsPerBlock, 0, ctx.stream()>>>(
            math, o, ap, bp, n, Acc<T>(alpha), Acc<T>(beta));
      else
        pointwise_kernel<T, Math, false><<<grid_for(work), kThreadsPerBlock, 0, ctx.stream()>>>(
            math, o, ap, bp, n, Acc<T>(alpha), Acc<T>(beta));
      SK_CUDA_CHECK_LAUNCH("pointwise_kernel");
    });
  });
}

inline void channel_sum(Context& ctx, const Tensor& x, const Tensor& out, std::int64_t outer,
                        std::int64_t channels, std::int64_t inner) {
  if (channels == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "channel_sum", [&](auto tag) {
    using T = decltype(tag);
    visit_floating(out.dtype(), "channel_sum", [&](auto out_tag) {
      using O = decltype(out_tag);
      channel_sum_kernel<T, O><<<row_grid(channels), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<O*>(out.data_ptr()), outer, channels,
          inner);
      SK_CUDA_CHECK_LAUNCH("channel_sum_kernel");
    });
  });
}

inline void channel_bias_add(Context& ctx, const Tensor& y, const Tensor& bias, std::int64_t outer,
                             std::int64_t channels, std::int64_t inner) {
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(y.dtype(), "bias add", [&](auto tag) {
    using T = decltype(tag);
    channel_bias_add_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<T*>(y.data_ptr()), static_cast<const T*>(bias.data_ptr()), n, channels, inner);
    SK_CUDA_CHECK_LAUNCH("channel_bias_add_kernel");
  });
}

inline void channel_scale(Context& ctx, const Tensor& x, const Tensor& scale, const Tensor& out,
                          std::int64_t outer, std::int64_t channels, std::int64_t inner) {
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "channel_scale", [&](auto tag) {
    using T = decltype(tag);
    channel_scale_kernel<T><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
        static_cast<const T*>(x.data_ptr()), static_cast<const T*>(scale.data_ptr()),
        static_cast<T*>(out.data_ptr()), n, channels, inner);
    SK_CUDA_CHECK_LAUNCH("channel_scale_kernel");
  });
}

inline void batch_norm_eval_backward(Context& ctx, const Tensor& x, const Tensor& grad_y,
                                     const Tensor& weight, const Tensor& mean, const Tensor& var,
                                     double eps, const Tensor& grad_x, const Tensor& grad_y_xhat,
                                     std::int64_t outer, std::int64_t channels,
                                     std::int64_t inner) {
  const std::int64_t n = outer * channels * inner;
  if (n == 0) return;
  CudaDeviceGuard guard(ctx.device().index);
  visit_floating(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    visit_floating(weight.dtype(), "batch_norm backward", [&](auto stat_tag) {
      using S = decltype(stat_tag);
      batch_norm_eval_backward_kernel<T, S><<<grid_for(n), kThreadsPerBlock, 0, ctx.stream()>>>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(grad_y.data_ptr()),
          static_cast<const S*>(weight.data_ptr()), static_cast<const S*>(mean.data_ptr()),
          static_cast<const S*>(var.data_ptr()), Acc<T>(eps),
          grad_x.defined() ? static_cast<T*>(grad_x.data_ptr()) : nullptr,
          static_cast<T*>(grad_y_xhat.data_ptr()), n, channels, inner);
      SK_CUDA_CHECK_LAUNCH("batch_norm_eval_backward_kernel");
    });
  });
}

}  // namespace shardkit::autograd::cuda_kernels
