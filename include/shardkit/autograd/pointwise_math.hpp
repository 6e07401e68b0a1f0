// The element math of autograd's pointwise ops (device_table.hpp's Pointwise), written once for
// the CPU loops (cpu_kernels.hpp) and the CUDA kernel (kernels/autograd/elementwise.cuh). T is
// the type computed in: the data's on the CPU (f32 or f64), the accumulator on the GPU (f32 for
// f16/bf16 data). Each takes both operands as values, so a loop loads them unconditionally and
// the compiler selects instead of branching (see cpu_kernels.hpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/core/config.hpp"

namespace shardkit::autograd {

enum class Pointwise : std::uint8_t {
  axpby,             // out = alpha*a + beta*b (b may be undefined when beta == 0)
  mul,               // out = alpha*a*b
  relu,              // out = max(a, 0)
  relu_backward,     // out = b <= 0 ? 0 : a   (a: gradient, b: the relu's output)
  add_relu,          // out = max(alpha*a + beta*b, 0): a residual block's end in one pass
  sigmoid,           // out = 1 / (1 + exp(-a))
  sigmoid_backward,  // out = a * b * (1 - b)   (a: gradient, b: the sigmoid's output)
  silu,              // out = a / (1 + exp(-a))
  silu_backward,     // out = a * s * (1 + b * (1 - s)), s = sigmoid(b)   (b: the SiLU's input)
};

// Each functor says whether it reads b: a loop over a unary one passes 0 for b and never loads it.

// out = alpha * a + beta * b
struct AxpbyMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T alpha, T beta) const {
    return alpha * a + beta * b;
  }
};
// out = alpha * a (axpby with beta == 0: b is not read)
struct ScaleMath {
  static constexpr bool kReadsB = false;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T alpha, T) const {
    return alpha * a;
  }
};
// out = alpha * a * b
struct MulMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T alpha, T) const {
    return alpha * a * b;
  }
};
// out = max(a, 0), a NaN kept (PyTorch's relu: a NaN activation -- an f16 inf - inf -- reaches
// the loss and the loss scaler skips the step, instead of training on a zero); -0 gives +0.
struct ReluMath {
  static constexpr bool kReadsB = false;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T, T) const {
    return a <= T(0) ? T(0) : a;
  }
};
// out = 0 where b <= 0, else a (a: the gradient, b: the ReLU's output): PyTorch's
// threshold_backward, which passes the gradient where the output is NaN
struct ReluBackwardMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T, T) const {
    return b <= T(0) ? T(0) : a;
  }
};

// out = max(alpha * a + beta * b, 0): AxpbyMath, then ReluMath on its result. The same bits
// as the two ops one after the other: the sum is rounded once either way (to the stored type
// when not fused), and rounding keeps a value's sign, so the ReLU selects alike.
struct AddReluMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T alpha, T beta) const {
    return ReluMath{}(AxpbyMath{}(a, b, alpha, beta), T(0), alpha, beta);
  }
};

// out = 1 / (1 + exp(-a)): torch.sigmoid's formula (squeeze-and-excitation's gate). For a below
// about -88 (f32) exp overflows to inf and the result is 0, as PyTorch's.
struct SigmoidMath {
  static constexpr bool kReadsB = false;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T, T) const {
    using std::exp;  // (the host's; CUDA's overloads for float and double on the device)
    return T(1) / (T(1) + exp(-a));
  }
};
// out = a * b * (1 - b) (a: the gradient, b: the sigmoid's output), as PyTorch's
// sigmoid_backward.
struct SigmoidBackwardMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T, T) const {
    return a * (T(1) - b) * b;
  }
};

// out = a / (1 + exp(-a)): torch.nn.SiLU's formula (swish: EfficientNet's activation).
struct SiluMath {
  static constexpr bool kReadsB = false;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T, T, T) const {
    using std::exp;
    return a / (T(1) + exp(-a));
  }
};
// out = a * s * (1 + b * (1 - s)) with s = sigmoid(b) (a: the gradient, b: the SiLU's input),
// as PyTorch's silu_backward.
struct SiluBackwardMath {
  static constexpr bool kReadsB = true;
  template <class T>
  SK_HOST_DEVICE SK_INLINE T operator()(T a, T b, T, T) const {
    using std::exp;
    const T s = T(1) / (T(1) + exp(-b));
    return a * s * (T(1) + b * (T(1) - s));
  }
};

// Calls fn with op's functor, chosen once on the host (axpby without a b scales a alone), so a
// loop or kernel is instantiated per functor instead of switching per element.
template <class Fn>
void with_pointwise_math(Pointwise op, bool reads_b, Fn&& fn) {
  switch (op) {
    case Pointwise::axpby:
      if (reads_b)
        fn(AxpbyMath{});
      else
        fn(ScaleMath{});
      return;
    case Pointwise::mul:
      fn(MulMath{});
      return;
    case Pointwise::relu:
      fn(ReluMath{});
      return;
    case Pointwise::relu_backward:
      fn(ReluBackwardMath{});
      return;
    case Pointwise::add_relu:
      fn(AddReluMath{});
      return;
    case Pointwise::sigmoid:
      fn(SigmoidMath{});
      return;
    case Pointwise::sigmoid_backward:
      fn(SigmoidBackwardMath{});
      return;
    case Pointwise::silu:
      fn(SiluMath{});
      return;
    case Pointwise::silu_backward:
      fn(SiluBackwardMath{});
      return;
  }
}

}  // namespace shardkit::autograd
