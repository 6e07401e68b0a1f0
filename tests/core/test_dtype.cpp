// DTypes: sizes, names, parsing, the type mapping and dispatch.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "shardkit/core/dtype.hpp"

namespace sk = shardkit;

TEST_CASE("dtype sizes and names") {
  CHECK(sk::dtype_size(sk::DType::f32) == 4);
  CHECK(sk::dtype_size(sk::DType::f64) == 8);
  CHECK(sk::dtype_size(sk::DType::f16) == 2);
  CHECK(sk::dtype_size(sk::DType::bf16) == 2);
  CHECK(sk::dtype_size(sk::DType::i32) == 4);
  CHECK(sk::dtype_size(sk::DType::i64) == 8);
  CHECK(sk::dtype_size(sk::DType::u8) == 1);
  for (auto dtype : sk::kAllDTypes) {
    CHECK(sk::parse_dtype(sk::dtype_name(dtype)) == dtype);
    // The C++ storage type has the dtype's size.
    sk::visit_dtype(dtype, [&](auto tag) {
      CHECK(sizeof(tag) == sk::dtype_size(dtype));
      CHECK(sk::dtype_of<decltype(tag)> == dtype);
    });
  }
}

TEST_CASE("parse_dtype accepts PyTorch/VISSL spellings and names the bad value") {
  CHECK(sk::parse_dtype("float32") == sk::DType::f32);
  CHECK(sk::parse_dtype("float16") == sk::DType::f16);
  CHECK(sk::parse_dtype("bfloat16") == sk::DType::bf16);
  CHECK(sk::parse_dtype("double") == sk::DType::f64);
  try {
    sk::parse_dtype("fp8");
    FAIL("no throw");
  } catch (const sk::InvalidArgument& e) {
    CHECK(std::string(e.what()).find("'fp8'") != std::string::npos);
  }
}

TEST_CASE("is_floating") {
  CHECK(sk::is_floating(sk::DType::bf16));
  CHECK(sk::is_floating(sk::DType::f64));
  CHECK_FALSE(sk::is_floating(sk::DType::i64));
  CHECK_FALSE(sk::is_floating(sk::DType::u8));
}

TEST_CASE("convert_value goes through double and rounds to the target") {
  CHECK(sk::convert_value<float>(sk::Half(1.5f)) == 1.5f);
  CHECK(sk::convert_value<sk::Half>(65504.0).bits == 0x7bff);
  CHECK(sk::convert_value<sk::BFloat16>(1.0f).bits == 0x3f80);
  CHECK(sk::convert_value<std::int32_t>(-3.75) == -3);
  CHECK(sk::convert_value<double>(std::int64_t{1} << 40) == 1099511627776.0);
}

TEST_CASE("floating -> integer: truncate into int64, wrap to the width (one rule on CPU and GPU)") {
  // PyTorch's rule for u8; C++ leaves these undefined, and x86 and CUDA disagreed.
  CHECK(sk::convert_value<std::uint8_t>(-3.7) == 253);
  CHECK(sk::convert_value<std::uint8_t>(300.5f) == 44);
  CHECK(sk::convert_value<std::uint8_t>(sk::Half(-1.0f)) == 255);
  CHECK(sk::convert_value<std::int32_t>(0x1p32 + 5.9) == 5);
  CHECK(sk::convert_value<std::int32_t>(-2.5) == -2);
  CHECK(sk::convert_value<std::int64_t>(1e30) == INT64_MAX);
  CHECK(sk::convert_value<std::int64_t>(-1e30) == INT64_MIN);
  CHECK(sk::convert_value<std::int32_t>(std::nan("")) == 0);
  // Integer -> integer is exact, then wrapped (no trip through double).
  CHECK(sk::convert_value<std::int64_t>(std::int64_t{(1LL << 60) + 1}) == (1LL << 60) + 1);
  CHECK(sk::convert_value<std::uint8_t>(std::int64_t{-1}) == 255);
}
