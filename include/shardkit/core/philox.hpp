// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011) and the element rules that
// turn them into uniform and normal values. Element i of a fill depends only on (seed, counter
// base, i), never on the device or the tensor's strides, so CPU and GPU initialise alike.
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/core/box_muller.hpp"
#include "shardkit/core/config.hpp"
#include "shardkit/core/dtype.hpp"

namespace shardkit {

struct PhiloxBlock {
  std::uint32_t v[4];
};

namespace detail {

SK_HOST_DEVICE SK_INLINE void mul_hi_lo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi,
                                        std::uint32_t& lo) {
  const std::uint64_t product = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(product >> 32);
  lo = static_cast<std::uint32_t>(product);
}

}  // namespace detail

// Ten rounds of Philox4x32 on `counter` with the 64-bit key (key0, key1).
SK_HOST_DEVICE SK_INLINE PhiloxBlock philox4x32_10(PhiloxBlock counter, std::uint32_t key0,
                                                   std::uint32_t key1) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  SK_UNROLL
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    detail::mul_hi_lo(kMul0, counter.v[0], hi0, lo0);
    detail::mul_hi_lo(kMul1, counter.v[2], hi1, lo1);
    counter = PhiloxBlock{{hi1 ^ counter.v[1] ^ key0, lo1, hi0 ^ counter.v[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// The 128-bit block number `block` of the stream keyed by `seed`.
SK_HOST_DEVICE SK_INLINE PhiloxBlock philox_block(std::uint64_t seed, std::uint64_t block) {
  return philox4x32_10(PhiloxBlock{{static_cast<std::uint32_t>(block),
                                    static_cast<std::uint32_t>(block >> 32), 0u, 0u}},
                       static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

// A 32-bit word as a double strictly inside (0, 1): exact, so no log(0) in Box-Muller.
SK_HOST_DEVICE SK_INLINE double word_to_unit(std::uint32_t word) {
  return (static_cast<double>(word) + 0.5) * (1.0 / 4294967296.0);
}

enum class RandomKind : std::uint8_t { uniform, normal, keep_mask };

// What a random fill draws: uniform on [a, b), normal with mean a and standard deviation b, or a
// keep mask (dropout's: b where the word's unit value is at least a, else 0 -- each element kept
// with probability 1 - a), from the stream `seed`, starting at 128-bit block
// `counter_base` (after its first `skip` elements: a fill of the part of a larger one from an
// element inside a block, from_element).
struct RandomSpec {
  RandomKind kind = RandomKind::uniform;
  double a = 0.0;
  double b = 1.0;
  std::uint64_t seed = 0;
  std::uint64_t counter_base = 0;
  std::uint64_t skip = 0;  // below elements_per_block()

  // Elements one 128-bit block gives: 4 uniforms or mask values (a word each), or 2 normals.
  SK_HOST_DEVICE std::uint64_t elements_per_block() const {
    return kind == RandomKind::normal ? 2 : 4;
  }

  // Blocks a fill of `count` elements consumes.
  SK_HOST_DEVICE std::uint64_t blocks_for(std::uint64_t count) const {
    return (count + elements_per_block() - 1) / elements_per_block();
  }

  // The value of element `index` (row-major position in the tensor), in double.
  // Uniform: a + (b - a)·u with one correctly rounded fma. Normal: Box-Muller in double, with
  // box_muller.hpp's log and cos. Either way CPU and GPU agree bit for bit.
  SK_HOST_DEVICE double value_at(std::uint64_t index) const {
    const std::uint64_t per_block = elements_per_block();
    index += skip;
    return value_in_block(philox_block(seed, counter_base + index / per_block),
                          static_cast<unsigned>(index % per_block));
  }

  // The same fill from its element `first` on: element i of the result is element first + i of
  // this one, so a range of a tensor is made without the rest (core/deferred_init.hpp).
  SK_HOST_DEVICE RandomSpec from_element(std::uint64_t first) const {
    const std::uint64_t per_block = elements_per_block();
    RandomSpec rest = *this;
    rest.counter_base += (skip + first) / per_block;
    rest.skip = (skip + first) % per_block;
    return rest;
  }

  // Element `position` (below elements_per_block()) of the elements `block` gives: a loop over
  // consecutive elements draws each block once this way instead of once per element.
  SK_HOST_DEVICE double value_in_block(const PhiloxBlock& block, unsigned position) const {
    if (kind == RandomKind::uniform) return uniform_value(block.v[position]);
    if (kind == RandomKind::keep_mask) return mask_value(block.v[position]);
    return normal_value(block.v[2u * position], block.v[2u * position + 1u]);
  }

  // Element value `value` (value_at's, value_in_block's) stored as T. A uniform value is below
  // b in double, but rounding it to a narrower T can reach b (bf16 on [0, 1): about 0.2% of
  // the elements; f32: one in 2^25): those take `ceiling`, T's largest value below b
  // (uniform_ceiling), so a fill keeps to [a, b) in every dtype, on every device alike.
  template <class T>
  SK_HOST_DEVICE T stored_as(double value, T ceiling) const {
    const T out = convert_value<T>(value);
    if (kind != RandomKind::uniform || !(a < b)) return out;
    return convert_value<double>(out) < b ? out : ceiling;
  }
  template <class T>
  SK_HOST_DEVICE T uniform_ceiling() const {
    const T rounded = convert_value<T>(b);
    if (convert_value<double>(rounded) < b) return rounded;
    if constexpr (std::is_same_v<T, double>) {
      return nextafter(rounded, -HUGE_VAL);
    } else if constexpr (std::is_same_v<T, float>) {
      return nextafterf(rounded, -HUGE_VALF);
    } else {  // Half, BFloat16: one step down in sign-magnitude bits (+0: the smallest negative)
      const std::uint16_t raw = rounded.bits;
      return T::from_bits(static_cast<std::uint16_t>(
          (raw & 0x8000u) != 0 ? raw + 1u : (raw == 0 ? 0x8001u : raw - 1u)));
    }
  }

  // The uniform value one word gives.
  SK_HOST_DEVICE double uniform_value(std::uint32_t word) const {
    return fma(b - a, word_to_unit(word), a);
  }

  // The keep mask's value one word gives: b (kept) or 0 (dropped).
  SK_HOST_DEVICE double mask_value(std::uint32_t word) const {
    return word_to_unit(word) >= a ? b : 0.0;
  }

  // The normal value a pair of words gives (Box-Muller's cosine branch).
  SK_HOST_DEVICE double normal_value(std::uint32_t first, std::uint32_t second) const {
    const double radius = sqrt(-2.0 * detail::log_of_positive(word_to_unit(first)));
    return fma(b, radius * detail::cos_two_pi(word_to_unit(second)), a);
  }
};

}  // namespace shardkit
