// A float's or a double's bits and back, the same on the host (memcpy, which compilers turn into
// a register move) and in device code (CUDA's reinterpreting intrinsics): what the exact
// conversions (float16.hpp) and Box-Muller's reductions (box_muller.hpp) work on.
#pragma once

#include <cstdint>
#include <cstring>

#include "shardkit/core/config.hpp"

namespace shardkit {

SK_HOST_DEVICE SK_INLINE std::uint32_t float_to_bits(float value) {
#if SK_DEVICE_CODE
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

SK_HOST_DEVICE SK_INLINE float bits_to_float(std::uint32_t bits) {
#if SK_DEVICE_CODE
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

SK_HOST_DEVICE SK_INLINE std::uint64_t double_to_bits(double value) {
#if SK_DEVICE_CODE
  return static_cast<std::uint64_t>(__double_as_longlong(value));
#else
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

SK_HOST_DEVICE SK_INLINE double bits_to_double(std::uint64_t bits) {
#if SK_DEVICE_CODE
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

}  // namespace shardkit
