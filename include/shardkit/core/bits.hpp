// A float's or a double's bits and back, the same on the host and in device code (the
// compilers' bit_cast builtin, which std::bit_cast is made of and which nvcc's device compiler
// knows too; a register move): what the exact conversions (float16.hpp) and Box-Muller's
// reductions (box_muller.hpp) work on.
#pragma once

#include <cstdint>

#include "shardkit/core/config.hpp"

namespace shardkit {

// `from`'s bits read as a To of the same size.
template <class To, class From>
SK_HOST_DEVICE SK_INLINE To bit_copy(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_copy: the two types must have the same size");
  return __builtin_bit_cast(To, from);
}

SK_HOST_DEVICE SK_INLINE std::uint32_t float_to_bits(float value) {
  return bit_copy<std::uint32_t>(value);
}
SK_HOST_DEVICE SK_INLINE float bits_to_float(std::uint32_t bits) { return bit_copy<float>(bits); }
SK_HOST_DEVICE SK_INLINE std::uint64_t double_to_bits(double value) {
  return bit_copy<std::uint64_t>(value);
}
SK_HOST_DEVICE SK_INLINE double bits_to_double(std::uint64_t bits) {
  return bit_copy<double>(bits);
}

// `when ? a : b` written with a mask: element loops of such choices vectorise (GCC does not
// if-convert a ternary whose condition or arms may trap, e.g. float comparisons, and keeps the
// loop scalar), and device code gets a select either way.
SK_HOST_DEVICE SK_INLINE std::uint32_t pick_bits(bool when, std::uint32_t a, std::uint32_t b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(when);
  return (a & mask) | (b & ~mask);
}

}  // namespace shardkit
