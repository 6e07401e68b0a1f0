// The element math of autograd's pointwise ops (device_table.hpp's Pointwise), written once for
// the CPU loops (cpu_kernels.hpp) and the CUDA kernel (kernels/autograd/elementwise.cuh). T is
// the type computed in: the data's on the CPU (f32 or f64), the accumulator on the GPU (f32 for
// f16/bf16 data). Each takes both operands as values, so a loop loads them unconditionally and
// the compiler selects instead of branching (see cpu_kernels.hpp).
#pragma once

#include "shardkit/core/config.hpp"

namespace shardkit::autograd {

// out = alpha * a + beta * b
struct AxpbyMath {
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T alpha, T beta) const {
    return alpha * a + beta * b;
  }
};
// out = alpha * a (axpby with beta == 0: b is not read)
struct ScaleMath {
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T alpha, T) const {
    return alpha * a;
  }
};
// out = alpha * a * b
struct MulMath {
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T alpha, T) const {
    return alpha * a * b;
  }
};
// out = max(a, 0)
struct ReluMath {
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T, T) const {
    return a > T(0) ? a : T(0);
  }
};
// out = a where b > 0, else 0 (a: the gradient, b: the ReLU's output)
struct ReluBackwardMath {
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T, T) const {
    return b > T(0) ? a : T(0);
  }
};

}  // namespace shardkit::autograd
