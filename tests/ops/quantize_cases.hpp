// The block formats (ops/quantize.hpp: int8, E4M3 and int4 codes) as doctest cases over `Backend`,
// included by
// ops_test_list.hpp: the CPU and the CUDA executables run the same checks against a float64
// reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "ops_cases.hpp"
#include "shardkit/ops/quantize.hpp"

namespace ops_test {

// Values whose blocks differ in magnitude by up to 2^±12 (so every block has its own scale),
// each exact in `dtype`; the block of index 2 is all zeros.
inline std::vector<float> quant_values(std::int64_t n, std::int64_t block, sk::DType dtype,
                                       std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::vector<float> out(static_cast<std::size_t>(n));
  float magnitude = 1.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i % block == 0) magnitude = std::ldexp(1.0f, exponent(gen));
    float x = i / block == 2 ? 0.0f : unit(gen) * magnitude;
    if (dtype == sk::DType::f16) x = sk::half_bits_to_float(sk::float_to_half_bits(x));
    if (dtype == sk::DType::bf16) x = sk::bf16_bits_to_float(sk::float_to_bf16_bits(x));
    out[static_cast<std::size_t>(i)] = x;
  }
  return out;
}

// The payload's scales and codes (int8 and int4: the signed integer; E4M3: the byte), read on
// the host.
struct QuantPayload {
  std::vector<float> scales;
  std::vector<int> q;
  std::vector<std::uint8_t> bytes;
};
template <class B>
QuantPayload read_payload(B& b, const sk::Tensor& payload, std::int64_t n, std::int64_t block,
                          ops::QuantFormat format) {
  const sk::Tensor host = b.download(payload);
  QuantPayload out;
  out.bytes.assign(host.data<std::uint8_t>(), host.data<std::uint8_t>() + host.numel());
  const std::int64_t blocks = ops::quant_block_count(n, block);
  out.scales.resize(static_cast<std::size_t>(blocks));
  std::memcpy(out.scales.data(), out.bytes.data(), out.scales.size() * sizeof(float));
  const std::uint8_t* codes = out.bytes.data() + 4 * blocks;
  for (std::int64_t i = 0; i < n; ++i) {
    if (format == ops::QuantFormat::int4) {
      const int nibble = (codes[i / 2] >> (i % 2 * 4)) & 0xf;  // the even value low
      out.q.push_back(nibble >= 8 ? nibble - 16 : nibble);
    } else {
      out.q.push_back(format == ops::QuantFormat::int8 ? int(static_cast<std::int8_t>(codes[i]))
                                                       : int(codes[i]));
    }
  }
  return out;
}

// Quantise to `format`, check the payload against float64, dequantise into `dtype`, check the
// format's bound.
template <class B>
void round_trip_case(B& b, ops::QuantFormat format, std::int64_t n, std::int64_t block,
                     sk::DType dtype) {
  CAPTURE(ops::quant_format_name(format));
  CAPTURE(n);
  CAPTURE(block);
  CAPTURE(sk::dtype_name(dtype));
  const auto x = quant_values(n, block, dtype, static_cast<std::uint32_t>(n * 31 + block));
  sk::Context host;
  const sk::Tensor values = b.upload(sk::cast(host, sk::from_vector(host, x, {n}), dtype));
  const bool int4 = format == ops::QuantFormat::int4;
  const std::int64_t bytes = ops::quant_payload_bytes(n, block, format);
  const std::int64_t used = 4 * ops::quant_block_count(n, block) + (int4 ? (n + 1) / 2 : n);
  CHECK(bytes % 16 == 0);
  CHECK(bytes >= used);
  CHECK(bytes < used + 16);
  const sk::Tensor payload = b.zeros({bytes}, sk::DType::u8);
  b.fill(payload, 255.0);  // the padding must be written, not left over
  ops::quantize_blocks(b.ctx, format, values, block, payload);
  const QuantPayload p = read_payload(b, payload, n, block, format);
  for (std::int64_t k = used; k < bytes; ++k) REQUIRE(p.bytes[static_cast<std::size_t>(k)] == 0);
  if (int4 && n % 2 == 1)  // the last byte's unused high nibble
    REQUIRE((p.bytes[static_cast<std::size_t>(used - 1)] >> 4) == 0);

  const sk::Tensor back = b.zeros({n}, dtype);
  ops::dequantize_blocks(b.ctx, format, payload, block, back);
  const auto y = sk::to_vector<float>(host, sk::cast(host, b.download(back), sk::DType::f32));
  const bool f8 = format == ops::QuantFormat::f8_e4m3;
  // f16 / bf16 destinations round x' once more: half a unit in their last place (f16's
  // subnormals: half their spacing, 2^-25).
  const double dtype_eps = dtype == sk::DType::f16    ? std::ldexp(1.0, -11)
                           : dtype == sk::DType::bf16 ? std::ldexp(1.0, -8)
                                                      : 0.0;
  for (std::int64_t blk = 0; blk < ops::quant_block_count(n, block); ++blk) {
    const std::int64_t lo = blk * block, hi = std::min(n, lo + block);
    double amax = 0;
    for (std::int64_t i = lo; i < hi; ++i)
      amax = std::max(amax, std::fabs(double(x[static_cast<std::size_t>(i)])));
    const int code_max = int4 ? 7 : 127;
    const double scale = amax / (f8 ? 448.0 : code_max);
    const float kept = p.scales[static_cast<std::size_t>(blk)];
    REQUIRE(std::fabs(kept - scale) <= scale * std::ldexp(1.0, -24));  // f32 of amax / max
    for (std::int64_t i = lo; i < hi; ++i) {
      const auto at = static_cast<std::size_t>(i);
      const int q = p.q[at];
      const auto code = static_cast<std::uint8_t>(q);
      if (f8) {
        REQUIRE((code & 0x7f) != 0x7f);  // finite values never become NaN
        if (amax > 0 && std::fabs(double(x[at])) == amax) REQUIRE((code & 0x7f) == 0x7e);
      } else {
        REQUIRE(q >= -code_max);
        REQUIRE(q <= code_max);
        // q is x / scale to the nearest integer (a tie may go either way through f32 rounding).
        if (amax > 0) REQUIRE(std::fabs(double(x[at]) / scale - q) <= 0.5 + 1e-5);
        if (amax > 0 && std::fabs(double(x[at])) == amax) REQUIRE(std::abs(q) == code_max);
      }
      // int8 and int4: x' within half a step of x; E4M3: within 1/16 of x for normal codes, 2^-10
      // of the scale below them (to f32 rounding); then the destination's own rounding.
      const double step =
          f8 ? std::max(std::fabs(double(x[at])) / 16.0, scale / 1024.0) : 0.5 * scale;
      const double subnormal = dtype == sk::DType::f16 ? std::ldexp(1.0, -25) : 0.0;
      const double bound = step * (1 + 1e-5) + std::fabs(double(y[at])) * dtype_eps + subnormal;
      REQUIRE(std::fabs(double(y[at]) - double(x[at])) <= bound);
      if (amax == 0) REQUIRE(y[at] == 0.0f);
    }
  }
}

TEST_CASE("int8 blocks: payload and round trip against float64, every dtype and block size") {
  Backend b;
  for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16})
    for (std::int64_t block : {256, 64, 7, 1})
      for (std::int64_t n : {1, 255, 256, 257, 1000, 4099})
        round_trip_case(b, ops::QuantFormat::int8, n, block, dtype);
}

TEST_CASE("int4 blocks: payload and round trip against float64, every dtype, even blocks") {
  Backend b;
  for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16})
    for (std::int64_t block : {1000, 256, 64, 6, 2})  // 1000: a block of several CPU runs
      for (std::int64_t n : {1, 255, 256, 257, 1000, 4099})
        round_trip_case(b, ops::QuantFormat::int4, n, block, dtype);
}

TEST_CASE(
    "int8 and int4 blocks: a block with an inf or a NaN comes back all NaN, the others "
    "intact") {
  Backend b;
  sk::Context host;
  const std::int64_t n = 1024, block = 256;
  auto x = quant_values(n, block, sk::DType::f32, 7);
  x[300] = std::numeric_limits<float>::infinity();
  x[700] = sk::bits_to_float(0xffc12345u);  // a NaN with a sign and a payload of its own
  const sk::Tensor values = b.upload(sk::from_vector(host, x, {n}));
  for (auto format : {ops::QuantFormat::int8, ops::QuantFormat::int4}) {
    CAPTURE(ops::quant_format_name(format));
    const sk::Tensor payload = b.zeros({ops::quant_payload_bytes(n, block, format)}, sk::DType::u8);
    ops::quantize_blocks(b.ctx, format, values, block, payload);
    // The NaN block's scale is the one quiet NaN on every device (x86 passed the payload on
    // through the division, the GPU its own NaN: the wire's bytes differed between them).
    const sk::Tensor bytes = b.download(payload);
    std::uint32_t scale_bits[4];
    std::memcpy(scale_bits, bytes.data_ptr(), sizeof scale_bits);
    CHECK(scale_bits[2] == 0x7fc00000u);
    CHECK(sk::bits_to_float(scale_bits[1]) == std::numeric_limits<float>::infinity());
    const sk::Tensor back = b.zeros({n}, sk::DType::f32);
    ops::dequantize_blocks(b.ctx, format, payload, block, back);
    const auto y = sk::to_vector<float>(host, b.download(back));
    for (std::int64_t i = 0; i < n; ++i) {
      CAPTURE(i);
      const bool poisoned = i / block == 1 || i / block == 2;
      if (poisoned)
        REQUIRE(std::isnan(y[static_cast<std::size_t>(i)]));
      else
        REQUIRE(std::isfinite(y[static_cast<std::size_t>(i)]));
    }
  }
}

// Every finite E4M3 value, from its fields (OCP FP8: bias 7, subnormals below 2^-6), ascending.
inline std::vector<double> e4m3_positive_values() {
  std::vector<double> out;
  for (int e = 0; e < 16; ++e)
    for (int m = 0; m < 8; ++m) {
      if (e == 15 && m == 7) continue;  // NaN
      out.push_back(e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7));
    }
  return out;
}

// y rounded to the nearest E4M3 value, ties to the even code, saturating at 448 (float64).
inline double e4m3_reference(double y) {
  static const std::vector<double> values = e4m3_positive_values();
  const double a = std::min(std::fabs(y), 448.0);
  const auto above = std::lower_bound(values.begin(), values.end(), a);
  double nearest = *above;
  if (above != values.begin()) {
    const double below = *(above - 1);
    const auto below_code = (above - 1) - values.begin();
    if (a - below < nearest - a || (a - below == nearest - a && below_code % 2 == 0))
      nearest = below;
  }
  return y < 0 ? -nearest : nearest;
}

TEST_CASE("E4M3 codes: every code's value, and rounding against float64, on the host") {
  const auto values = e4m3_positive_values();
  REQUIRE(values.size() == 127);
  CHECK(values.back() == 448.0);
  for (int code = 0; code < 256; ++code) {
    CAPTURE(code);
    const float v = ops::e4m3_value(static_cast<std::uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      CHECK(std::isnan(v));
      continue;
    }
    const double want = (code & 0x80 ? -1.0 : 1.0) * values[static_cast<std::size_t>(code & 0x7f)];
    CHECK(double(v) == want);
    if (code != 0x80) CHECK(ops::e4m3_encode(v) == code);  // (-0 encodes as 0x80 too)
  }
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    const float y = std::ldexp(unit(gen), exponent(gen));
    const std::uint8_t code = ops::e4m3_encode(y);
    CAPTURE(y);
    REQUIRE(double(ops::e4m3_value(code)) == e4m3_reference(y));
  }
  // The rounding's edges: every tie between neighbouring values (exact in f32) and the floats
  // just below and above it, either sign -- the subnormal steps, each binade's carry into the
  // next exponent, and the last step below 448.
  for (std::size_t k = 0; k + 1 < values.size(); ++k) {
    const auto mid = static_cast<float>((values[k] + values[k + 1]) / 2);
    for (const float y : {std::nextafter(mid, 0.0f), mid, std::nextafter(mid, 1000.0f)})
      for (const float s : {1.0f, -1.0f}) {
        CAPTURE(s * y);
        REQUIRE(double(ops::e4m3_value(ops::e4m3_encode(s * y))) == e4m3_reference(s * y));
      }
  }
  CHECK(ops::e4m3_encode(-0.0f) == 0x00);
  CHECK(ops::e4m3_encode(-0x1p-11f) == 0x80);  // rounds to 0, keeps y < 0's sign
  CHECK(ops::e4m3_encode(-std::numeric_limits<float>::infinity()) == 0xfe);
  // Ties to even: 1 + 1/16 lies between 1 (code 0x38) and 1 + 1/8 (0x39).
  CHECK(ops::e4m3_encode(1.0625f) == 0x38);
  CHECK(ops::e4m3_encode(1.1875f) == 0x3a);
  CHECK(ops::e4m3_encode(460.0f) == 0x7e);  // saturates
  CHECK(ops::e4m3_encode(std::numeric_limits<float>::quiet_NaN()) == ops::kE4m3Nan);
}

TEST_CASE("E4M3 blocks: payload and round trip against float64, every dtype and block size") {
  Backend b;
  for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16})
    for (std::int64_t block : {256, 7, 1})
      for (std::int64_t n : {1, 257, 4099})
        round_trip_case(b, ops::QuantFormat::f8_e4m3, n, block, dtype);
}

// A block whose largest value is so small that kMax / amax overflows f32 (amax below about
// 3.8e-37 for int8, 1.3e-36 for E4M3): its zeros must come back zeros, not NaN (0 x inf), and
// its other values finite with their signs, within the block's largest -- such a block keeps
// no more than that (docs/semantics.md).
TEST_CASE("int8, E4M3 and int4 blocks: a block of tiny values comes back finite, its zeros zero") {
  Backend b;
  sk::Context host;
  const std::vector<float> x = {1e-37f, 0.0f, -5e-38f, 0.0f, 2e-38f, 0.0f, 0.0f, -1e-37f};
  const auto n = static_cast<std::int64_t>(x.size());
  for (auto format : {ops::QuantFormat::int8, ops::QuantFormat::f8_e4m3, ops::QuantFormat::int4}) {
    CAPTURE(ops::quant_format_name(format));
    const sk::Tensor payload = b.zeros({ops::quant_payload_bytes(n, n, format)}, sk::DType::u8);
    ops::quantize_blocks(b.ctx, format, b.upload(sk::from_vector(host, x, {n})), n, payload);
    const sk::Tensor back = b.zeros({n}, sk::DType::f32);
    ops::dequantize_blocks(b.ctx, format, payload, n, back);
    const auto y = sk::to_vector<float>(host, b.download(back));
    for (std::size_t i = 0; i < x.size(); ++i) {
      CAPTURE(i);
      REQUIRE(std::isfinite(y[i]));
      if (x[i] == 0.0f) REQUIRE(y[i] == 0.0f);
      REQUIRE(std::fabs(double(y[i])) <= 1e-37 * (1 + 1e-6));  // (scale x 127: f32 rounding)
      REQUIRE(std::signbit(y[i]) == std::signbit(x[i]));
    }
  }
}

// qgZ's owner sums the ranks' runs with dequantize_add_blocks: one pass, the bits of
// dequantize_blocks into a temporary then add_ (the product and the sum rounded apart, on the
// GPU too: no fused multiply-add), for every format, an inf in a block and a sum with a NaN
// included. Only f32 sums.
TEST_CASE("dequantize_add_blocks equals dequantize_blocks then add_, bit for bit") {
  Backend b;
  sk::Context host;
  constexpr std::int64_t kBlock = 64;
  for (auto format : {ops::QuantFormat::int8, ops::QuantFormat::f8_e4m3, ops::QuantFormat::int4}) {
    for (std::int64_t n : {1, 257, 4099}) {
      CAPTURE(ops::quant_format_name(format));
      CAPTURE(n);
      auto x = quant_values(n, kBlock, sk::DType::f32, static_cast<std::uint32_t>(n + 5));
      auto sum = quant_values(n, kBlock, sk::DType::f32, static_cast<std::uint32_t>(n + 77));
      if (n > 200) {
        x[130] = std::numeric_limits<float>::infinity();  // its block comes back non-finite
        sum[7] = std::numeric_limits<float>::quiet_NaN();
      }
      const sk::Tensor payload =
          b.zeros({ops::quant_payload_bytes(n, kBlock, format)}, sk::DType::u8);
      ops::quantize_blocks(b.ctx, format, b.upload(sk::from_vector(host, x, {n})), kBlock, payload);
      const sk::Tensor fused = b.upload(sk::from_vector(host, sum, {n}));
      ops::dequantize_add_blocks(b.ctx, format, payload, kBlock, fused);
      const sk::Tensor two_pass = b.upload(sk::from_vector(host, sum, {n}));
      const sk::Tensor run = b.zeros({n}, sk::DType::f32);
      ops::dequantize_blocks(b.ctx, format, payload, kBlock, run);
      sk::add_(b.ctx, two_pass, run);
      const auto got = sk::to_vector<float>(host, b.download(fused));
      const auto want = sk::to_vector<float>(host, b.download(two_pass));
      REQUIRE(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
    }
  }
  const sk::Tensor half = b.zeros({8}, sk::DType::f16);
  const sk::Tensor payload = b.zeros({ops::quant_payload_bytes(8, 8)}, sk::DType::u8);
  CHECK_THROWS_WITH(ops::dequantize_add_blocks(b.ctx, ops::QuantFormat::int8, payload, 8, half),
                    doctest::Contains("dequantize_add_blocks: values must be f32"));
}

TEST_CASE("int8 blocks: bad arguments are refused by name") {
  Backend b;
  const sk::Tensor values = b.zeros({100}, sk::DType::f32);
  const sk::Tensor payload = b.zeros({ops::quant_payload_bytes(100, 32) + 16}, sk::DType::u8);
  CHECK_THROWS_WITH(ops::quantize_int8_blocks(b.ctx, values, 0, payload),
                    doctest::Contains("a block of 0 values"));
  CHECK_THROWS_WITH(
      ops::quantize_int8_blocks(b.ctx, values, 32, payload.slice(0, 0, 100)),
      doctest::Contains("payload must be a contiguous u8 tensor of at least 128 bytes"));
  CHECK_THROWS_WITH(ops::quantize_int8_blocks(b.ctx, values, 32, payload.slice(0, 1, 129)),
                    doctest::Contains("not a multiple of 4"));
  CHECK_THROWS_WITH(ops::quantize_int8_blocks(b.ctx, b.zeros({100}, sk::DType::f64), 32, payload),
                    doctest::Contains("values must be a contiguous f32, f16 or bf16 tensor"));
  CHECK_THROWS_WITH(ops::dequantize_int8_blocks(b.ctx, b.zeros({100}, sk::DType::f32), 32, values),
                    doctest::Contains("payload must be a contiguous u8 tensor"));
  // int4 packs two codes to a byte: an odd block would start mid-byte; its payload is smaller.
  CHECK_THROWS_WITH(ops::quantize_blocks(b.ctx, ops::QuantFormat::int4, values, 33, payload),
                    doctest::Contains("an int4 block of 33 values"));
  CHECK(ops::quant_payload_bytes(100, 32, ops::QuantFormat::int4) == 80);  // 16 + 50, to 16
  ops::quantize_blocks(b.ctx, ops::QuantFormat::int4, values, 32, payload.slice(0, 0, 80));
}

// Per-tensor scales (ops/quantize.hpp's slot chunks; FSDP2's float8 gather): a run that starts
// and ends inside slots, slots longer than a chunk, padding between them (a slot of its own).
// The maxima are the slots' exact |x| maxima; every code is the host's encode of the value with
// its slot's scale (the same functions the block format uses: a slot as one block gives
// quantize_blocks' codes); the values come back within E4M3's bound of float64, a NaN makes
// its slot NaN and no other.
TEST_CASE(
    "per-tensor scales: slot maxima, codes and round trip against float64; one slot is "
    "one block") {
  Backend b;
  sk::Context host;
  // Slots of 1, 300, 9000 (two chunks), 7 and 20000 values with 5 values of padding before each
  // (slot 5); the run covers [150, end - 5000).
  const std::vector<std::int64_t> sizes = {1, 300, 9000, 7, 20000};
  const std::int64_t padding_slot = static_cast<std::int64_t>(sizes.size());
  std::vector<ops::SlotRange> ranges;
  std::int64_t at = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    ranges.push_back({at, at + 5, padding_slot});
    ranges.push_back({at + 5, at + 5 + sizes[t], static_cast<std::int64_t>(t)});
    at += 5 + sizes[t];
  }
  const std::int64_t total = at, begin = 150, end = total - 5000, n = end - begin;
  const auto rows = ops::slot_chunks(ranges, begin, end);
  REQUIRE(rows.size() % 3 == 0);
  for (std::size_t r = 0; r < rows.size(); r += 3) CHECK(rows[r + 1] <= ops::kSlotChunk);
  const sk::Tensor chunks =
      b.upload(sk::from_vector(host, rows, {static_cast<std::int64_t>(rows.size() / 3), 3}));
  for (auto format : {ops::QuantFormat::f8_e4m3, ops::QuantFormat::int8})
    for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16})
      for (bool with_nan : {false, true}) {
        CAPTURE(ops::quant_format_name(format));
        CAPTURE(sk::dtype_name(dtype));
        CAPTURE(with_nan);
        // Each slot its own magnitude (2^-12 .. 2^12), the padding zeros, exact in dtype.
        std::vector<float> whole(static_cast<std::size_t>(total), 0.0f);
        std::vector<int> slot_of(static_cast<std::size_t>(total), static_cast<int>(padding_slot));
        std::mt19937 gen(static_cast<std::uint32_t>(7 + static_cast<int>(dtype)));
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        for (const auto& r : ranges) {
          if (r.slot == padding_slot) continue;
          const float magnitude = std::ldexp(1.0f, static_cast<int>(r.slot) * 6 - 12);
          for (std::int64_t i = r.begin; i < r.end; ++i) {
            float x = unit(gen) * magnitude;
            if (dtype == sk::DType::f16) x = sk::half_bits_to_float(sk::float_to_half_bits(x));
            if (dtype == sk::DType::bf16) x = sk::bf16_bits_to_float(sk::float_to_bf16_bits(x));
            whole[static_cast<std::size_t>(i)] = x;
            slot_of[static_cast<std::size_t>(i)] = static_cast<int>(r.slot);
          }
        }
        if (with_nan) whole[static_cast<std::size_t>(ranges[5].begin + 17)] = NAN;  // slot 2
        const std::vector<float> x(whole.begin() + begin, whole.begin() + end);
        const sk::Tensor values = b.upload(sk::cast(host, sk::from_vector(host, x, {n}), dtype));
        // The run's maxima, then the whole slots' (what the all-reduce makes of every rank's).
        std::vector<float> run_max(sizes.size() + 1, 0.0f), slot_max(sizes.size() + 1, 0.0f);
        for (std::int64_t i = 0; i < total; ++i) {
          const auto s = static_cast<std::size_t>(slot_of[static_cast<std::size_t>(i)]);
          slot_max[s] = ops::abs_max(slot_max[s], whole[static_cast<std::size_t>(i)]);
          if (i >= begin && i < end)
            run_max[s] = ops::abs_max(run_max[s], whole[static_cast<std::size_t>(i)]);
        }
        // A NaN's maximum is +inf (an all-reduce of maxima by NCCL's fmaxf may drop a NaN,
        // never an inf).
        for (auto* maxima : {&run_max, &slot_max})
          for (float& m : *maxima)
            if (std::isnan(m)) m = INFINITY;
        const sk::Tensor amax = b.zeros({padding_slot + 1}, sk::DType::f32);
        ops::slot_abs_max(b.ctx, values, chunks, amax);
        const auto got = sk::to_vector<float>(host, b.download(amax));
        for (std::size_t s = 0; s < got.size(); ++s) {
          CAPTURE(s);
          CHECK(got[s] == run_max[s]);
        }
        const sk::Tensor scales = b.upload(sk::from_vector(host, slot_max, {padding_slot + 1}));
        const sk::Tensor codes = b.zeros({n}, sk::DType::u8);
        ops::quantize_by_slots(b.ctx, format, values, chunks, scales, codes);
        const sk::Tensor back = b.zeros({n}, dtype);
        ops::dequantize_by_slots(b.ctx, format, codes, chunks, scales, back);
        const sk::Tensor code_host = b.download(codes);
        const auto y = sk::to_vector<float>(host, sk::cast(host, b.download(back), sk::DType::f32));
        const bool f8 = format == ops::QuantFormat::f8_e4m3;
        const double dtype_eps = dtype == sk::DType::f16    ? std::ldexp(1.0, -11)
                                 : dtype == sk::DType::bf16 ? std::ldexp(1.0, -8)
                                                            : 0.0;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto at_run = static_cast<std::size_t>(i);
          const auto s = static_cast<std::size_t>(slot_of[static_cast<std::size_t>(i + begin)]);
          const float m = slot_max[s];
          const std::uint8_t want =
              f8 ? ops::E4m3Code::encode(x[at_run], ops::inverse_step<ops::E4m3Code>(m))
                 : ops::Int8Code::encode(x[at_run], ops::inverse_step<ops::Int8Code>(m));
          REQUIRE(code_host.data<std::uint8_t>()[i] == want);
          if (std::isinf(m)) {  // the NaN's slot comes back NaN, every value of it
            REQUIRE(std::isnan(y[at_run]));
            continue;
          }
          const double scale = double(m) / (f8 ? 448.0 : 127.0);
          const double step =
              f8 ? std::max(std::fabs(double(x[at_run])) / 16.0, scale / 1024.0) : 0.5 * scale;
          const double subnormal = dtype == sk::DType::f16 ? std::ldexp(1.0, -25) : 0.0;
          REQUIRE(std::fabs(double(y[at_run]) - double(x[at_run])) <=
                  step * (1 + 1e-5) + std::fabs(double(y[at_run])) * dtype_eps + subnormal);
          if (m == 0) REQUIRE(y[at_run] == 0.0f);
        }
      }
  // One slot of 300 values as one block of 300: quantize_blocks' codes.
  const auto x = quant_values(300, 300, sk::DType::f32, 3);
  const sk::Tensor values = b.upload(sk::from_vector(host, x, {300}));
  const sk::Tensor one =
      b.upload(sk::from_vector(host, ops::slot_chunks({{0, 300, 0}}, 0, 300), {1, 3}));
  for (auto format : {ops::QuantFormat::f8_e4m3, ops::QuantFormat::int8}) {
    const sk::Tensor amax = b.zeros({1}, sk::DType::f32);
    ops::slot_abs_max(b.ctx, values, one, amax);
    const sk::Tensor codes = b.zeros({300}, sk::DType::u8);
    ops::quantize_by_slots(b.ctx, format, values, one, amax, codes);
    const sk::Tensor payload = b.zeros({ops::quant_payload_bytes(300, 300)}, sk::DType::u8);
    ops::quantize_blocks(b.ctx, format, values, 300, payload);
    const sk::Tensor a = b.download(codes), p = b.download(payload);
    CHECK(std::memcmp(a.data<std::uint8_t>(), p.data<std::uint8_t>() + 4, 300) == 0);
  }
}

TEST_CASE("per-tensor scales: int4, a malformed chunk table and a short code buffer are refused") {
  Backend b;
  sk::Context host;
  const sk::Tensor values = b.zeros({100}, sk::DType::f32);
  const sk::Tensor chunks =
      b.upload(sk::from_vector(host, ops::slot_chunks({{0, 100, 0}}, 0, 100), {1, 3}));
  const sk::Tensor amax = b.zeros({1}, sk::DType::f32);
  const sk::Tensor codes = b.zeros({100}, sk::DType::u8);
  CHECK_THROWS_WITH(
      ops::quantize_by_slots(b.ctx, ops::QuantFormat::int4, values, chunks, amax, codes),
      doctest::Contains("int4 codes with a per-tensor scale; those take one-byte codes"));
  CHECK_THROWS_WITH(ops::quantize_by_slots(b.ctx, ops::QuantFormat::f8_e4m3, values,
                                           chunks.view({3}), amax, codes),
                    doctest::Contains("chunks must be slot_chunks' table"));
  CHECK_THROWS_WITH(ops::quantize_by_slots(b.ctx, ops::QuantFormat::f8_e4m3, values, chunks, amax,
                                           codes.slice(0, 0, 99)),
                    doctest::Contains("codes must be a contiguous u8 tensor of at least 100"));
  CHECK_THROWS_WITH(ops::slot_abs_max(b.ctx, values, chunks, b.zeros({1}, sk::DType::f64)),
                    doctest::Contains("amax must be a contiguous f32 tensor"));
  CHECK_THROWS_WITH(ops::slot_chunks({{10, 5, 0}}, 0, 100), doctest::Contains("is not a range"));
}

}  // namespace ops_test
