// Element types: the DType enum, its sizes and names, the C++ type of each, and dispatch on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/float16.hpp"

namespace shardkit {

enum class DType : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::u8};

constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::u8:
      return 1;
  }
  return 0;
}

inline constexpr EnumName<DType> kDTypeNames[] = {
    {DType::f32, "f32"}, {DType::f64, "f64"}, {DType::f16, "f16"}, {DType::bf16, "bf16"},
    {DType::i32, "i32"}, {DType::i64, "i64"}, {DType::u8, "u8"}};

constexpr std::string_view dtype_name(DType dtype) { return name_of(dtype, kDTypeNames); }

constexpr bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}

// Accepts our short names and the PyTorch / VISSL spellings ("float32", "float16", "bfloat16"...).
inline DType parse_dtype(std::string_view name) {
  // Ours first, then the PyTorch / VISSL spellings.
  static constexpr EnumName<DType> kAliases[] = {{DType::f32, "float32"},   {DType::f32, "float"},
                                                 {DType::f64, "float64"},   {DType::f64, "double"},
                                                 {DType::f16, "float16"},   {DType::f16, "half"},
                                                 {DType::bf16, "bfloat16"}, {DType::i32, "int32"},
                                                 {DType::i64, "int64"},     {DType::u8, "uint8"}};
  if (const auto dtype = find_name(name, kDTypeNames)) return *dtype;
  return parse_name(
      name, kAliases, "dtype",
      "one of f32, f64, f16, bf16, i32, i64, u8 (or float32, float16, bfloat16, ...)");
}

// The C++ storage type of each DType, and back.
// clang-format off
template <DType D> struct DTypeTraits;
template <> struct DTypeTraits<DType::f32> { using type = float; };
template <> struct DTypeTraits<DType::f64> { using type = double; };
template <> struct DTypeTraits<DType::f16> { using type = Half; };
template <> struct DTypeTraits<DType::bf16> { using type = BFloat16; };
template <> struct DTypeTraits<DType::i32> { using type = std::int32_t; };
template <> struct DTypeTraits<DType::i64> { using type = std::int64_t; };
template <> struct DTypeTraits<DType::u8> { using type = std::uint8_t; };
// clang-format on

template <DType D>
using dtype_type = typename DTypeTraits<D>::type;

template <class T>
struct DTypeOf {
  static_assert(sizeof(T) == 0,
                "no shardkit DType for this C++ type: use float, double, sk::Half, sk::BFloat16, "
                "int32_t, int64_t or uint8_t");
};
// clang-format off
template <> struct DTypeOf<float> { static constexpr DType value = DType::f32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::f64; };
template <> struct DTypeOf<Half> { static constexpr DType value = DType::f16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct DTypeOf<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct DTypeOf<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct DTypeOf<std::uint8_t> { static constexpr DType value = DType::u8; };
// clang-format on

template <class T>
inline constexpr DType dtype_of = DTypeOf<std::remove_cv_t<T>>::value;

// Calls fn(T{}) -- a value of the storage type, used only for its type -- for a run-time dtype:
//   visit_dtype(t.dtype(), [&](auto tag) { using T = decltype(tag); ... });
template <class Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    // clang-format off
    case DType::f32: return fn(float{});
    case DType::f64: return fn(double{});
    case DType::f16: return fn(Half{});
    case DType::bf16: return fn(BFloat16{});
    case DType::i32: return fn(std::int32_t{});
    case DType::i64: return fn(std::int64_t{});
    case DType::u8: return fn(std::uint8_t{});
      // clang-format on
  }
  fail<InvalidArgument>("invalid dtype value ", static_cast<int>(dtype));
}

// Converts between any storage type through double (exact for every value but i64 beyond 2^53;
// integer -> integer converts directly).
// f64 -> f16/bf16 rounds through f32 first, as PyTorch's c10::Half(double) does.
// Floating -> integer: C++ leaves a value outside the target's range undefined, and the two
// machines disagree (x86 wraps through a 32-bit truncation, CUDA saturates: -3.7 -> u8 gave 253
// on the CPU and 0 on an H100). One defined rule for both, PyTorch's for u8: truncate toward
// zero into int64, then wrap to the target's width (-3.7 -> 253, 300.5 -> 44); NaN gives 0 and
// values beyond int64 saturate there first.
template <class To, class From>
SK_HOST_DEVICE SK_INLINE To convert_value(From value) {
  double wide;
  if constexpr (std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>)
    wide = static_cast<double>(value.to_float());
  else
    wide = static_cast<double>(value);
  if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>) {
    return To(static_cast<float>(wide));
  } else if constexpr (std::is_integral_v<To>) {
    if constexpr (std::is_integral_v<From>) {
      return static_cast<To>(value);  // exact, then wrapped to the width (defined since C++20)
    } else {
      std::int64_t whole = 0;  // NaN
      if (wide >= 0x1p63)
        whole = INT64_MAX;
      else if (wide < -0x1p63)
        whole = INT64_MIN;
      else if (wide == wide)
        whole = static_cast<std::int64_t>(wide);
      return static_cast<To>(whole);
    }
  } else {
    return static_cast<To>(wide);
  }
}

// a + b as add_ forms it into a destination of type D, on the host and on the device alike:
// floating types in f32 (f64 for f64) and rounded once; integers exactly, wrapped to the width
// as PyTorch's integer add is (so a counter such as batch-norm's num_batches_tracked counts
// past 2^24).
template <class D>
SK_HOST_DEVICE SK_INLINE D add_value(D a, D b) {
  if constexpr (std::is_integral_v<D>) {
    return static_cast<D>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
  } else {
    using Acc = std::conditional_t<std::is_same_v<D, double>, double, float>;
    return convert_value<D>(convert_value<Acc>(a) + convert_value<Acc>(b));
  }
}

}  // namespace shardkit
