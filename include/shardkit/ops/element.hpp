// Element access for fused ops: every operand is loaded as float and stored from float,
// whatever its storage type (f32, f16, bf16). Stores to f16/bf16 round to nearest even and give
// exactly the bits of core/float16.hpp, on the host and in device code.
#pragma once

#include <cstdint>
#include <type_traits>

#include "shardkit/core/config.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/float16.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace shardkit::ops {

// a * b + c, rounded once wherever the target has a fused multiply-add (CUDA; a host compiler
// with a fast fma, __FP_FAST_FMAF: x86 with FMA as -march=x86-64-v3 builds, aarch64), else
// twice. The element functors spell every multiply-add this
// way: left to contract a * b + c * d itself, GCC may fuse either product, and it chose
// differently for a loop's vector body and its scalar tail, so an element's bits depended on
// where its chunk started. Written out, there is one rounding per call on every path.
SK_HOST_DEVICE SK_INLINE float mul_add(float a, float b, float c) {
#if SK_DEVICE_CODE
  return fmaf(a, b, c);
#elif defined(__FP_FAST_FMAF)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;  // no FMA instruction: nothing for the compiler to contract
#endif
}

// a * b rounded on its own, never fused into a neighbouring add: nvcc contracts a * b + c into
// an fma by default, and so does GCC on a host with FMA (-ffp-contract=fast, in ISO C++ modes
// too, whether or not the product is stored in a variable first). On the device __fmul_rn; on
// such a host (__FP_FAST_FMA: x86 with FMA, aarch64) an fma with a -0 addend, which is the
// product rounded once (-0 leaves every product, +0 and -0 included, as it is) and which the
// compiler does not contract further (it still vectorises). Without a fast fma the compiler
// does not contract either.
SK_HOST_DEVICE SK_INLINE float mul_rn(float a, float b) {
#if SK_DEVICE_CODE
  return __fmul_rn(a, b);
#elif defined(__FP_FAST_FMAF)
  return __builtin_fmaf(a, b, -0.0f);
#else
  return a * b;
#endif
}
SK_HOST_DEVICE SK_INLINE double mul_rn(double a, double b) {
#if SK_DEVICE_CODE
  return __dmul_rn(a, b);
#elif defined(__FP_FAST_FMA)
  return __builtin_fma(a, b, -0.0);
#else
  return a * b;
#endif
}

// Operand storage types fused ops accept.
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

SK_HOST_DEVICE SK_INLINE std::uint16_t to_half_bits(float value) {
#if SK_DEVICE_CODE
  // The hardware conversion rounds exactly like ours (tests/core proves it on all patterns);
  // only NaN payloads may differ, so NaNs take ours (core/float16.hpp).
  if (value != value) return float_to_half_bits(value);
  return __half_as_ushort(__float2half_rn(value));
#else
  return float_to_half_bits(value);
#endif
}

SK_HOST_DEVICE SK_INLINE float from_half_bits(std::uint16_t bits) {
#if SK_DEVICE_CODE
  // The hardware widening is exact; NaNs keep their payload through ours.
  if ((bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0) return half_bits_to_float(bits);
  return __half2float(__ushort_as_half(bits));
#else
  return half_bits_to_float(bits);
#endif
}

template <class T>
SK_HOST_DEVICE SK_INLINE float load_element(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return *p;
  else if constexpr (std::is_same_v<T, Half>)
    return from_half_bits(p->bits);
  else
    return bf16_bits_to_float(p->bits);
}

template <class T>
SK_HOST_DEVICE SK_INLINE void store_element(T* p, float value) {
  if constexpr (std::is_same_v<T, float>)
    *p = value;
  else if constexpr (std::is_same_v<T, Half>)
    p->bits = to_half_bits(value);
  else
    p->bits = float_to_bf16_bits(value);
}

// Storage types of a functor's operands, by position.
template <class... Ts>
struct TypeList {
  static constexpr int size = sizeof...(Ts);
};

template <int I, class List>
struct TypeAt;
template <class T, class... Ts>
struct TypeAt<0, TypeList<T, Ts...>> {
  using type = T;
};
template <int I, class T, class... Ts>
struct TypeAt<I, TypeList<T, Ts...>> {
  using type = typename TypeAt<I - 1, TypeList<Ts...>>::type;
};

template <int I, class List>
using type_at = typename TypeAt<I, List>::type;

// Calls fn.template operator()<T>() with T the storage type of `dtype`: f16, bf16, else f32
// (callers check the dtype first).
template <class Fn>
decltype(auto) visit_element_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::f16) return fn.template operator()<Half>();
  if (dtype == DType::bf16) return fn.template operator()<BFloat16>();
  return fn.template operator()<float>();
}

// Low-precision copy option of the optimizer functors: `void` for none.
template <class Low>
using low_storage_t = std::conditional_t<std::is_void_v<Low>, float, Low>;

// The optimizer functors' (gradient storage, low-precision copy) pairs: f32 gradients with or
// without a copy, or -- under mixed precision -- gradients in the copy's dtype. Calls
// fn.template operator()<Grad, Low>() for the pair the dtypes name.
template <class Fn>
decltype(auto) visit_grad_and_low(DType grad, DType low, const char* op, Fn&& fn) {
  if (grad == DType::f32) {
    if (low == DType::f16) return fn.template operator()<float, Half>();
    if (low == DType::bf16) return fn.template operator()<float, BFloat16>();
    check(low == DType::f32, op, ": low-precision parameter copies must be f16 or bf16, got ",
          dtype_name(low));
    return fn.template operator()<float, void>();
  }
  check((grad == DType::f16 || grad == DType::bf16) && low == grad, op, ": gradients in ",
        dtype_name(grad),
        " go with low-precision copies of the same dtype (mixed precision: "
        "the compute copy and its gradients share a dtype), got copies in ",
        dtype_name(low));
  if (grad == DType::f16) return fn.template operator()<Half, Half>();
  return fn.template operator()<BFloat16, BFloat16>();
}

}  // namespace shardkit::ops
