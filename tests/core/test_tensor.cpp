// Tensors: views and slices share storage, flat views, contiguous copies, fills, casting copies,
// bad views rejected with clear messages.
#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/cpu_tensor_kernels.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;

namespace {

std::vector<float> iota(int n, float start = 0.5f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

}  // namespace

TEST_CASE("empty tensors: shape, strides, bytes and category accounting") {
  sk::Context ctx;
  auto t = sk::empty(ctx, {2, 3, 4}, sk::DType::f32, sk::MemoryCategory::parameters);
  CHECK(t.numel() == 24);
  CHECK(t.nbytes() == 96);
  CHECK(t.strides() == sk::Shape{12, 4, 1});
  CHECK(t.is_contiguous());
  CHECK(t.device() == sk::Device::cpu());
  CHECK(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 96);
  t = sk::Tensor();
  CHECK(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 0);
}

TEST_CASE("views share storage and see each other's writes") {
  sk::Context ctx;
  auto base = sk::from_vector(ctx, iota(12), {3, 4});
  auto flat = base.view({-1});
  CHECK(flat.shape() == sk::Shape{12});
  CHECK(flat.shares_storage(base));
  sk::fill(ctx, flat.slice(0, 4, 8), 9.0);  // the whole second row of base
  auto values = sk::to_vector<float>(ctx, base);
  for (int i = 0; i < 12; ++i) CHECK(values[i] == ((i >= 4 && i < 8) ? 9.0f : i + 0.5f));
  CHECK(ctx.memory_stats().snapshot().allocations == 1);  // no view allocated anything
}

TEST_CASE("slices, select and transpose give strided views with the right elements") {
  sk::Context ctx;
  auto base = sk::from_vector(ctx, iota(24, 0.0f), {2, 3, 4});
  auto column = base.select(2, 1);  // [2, 3], elements 1, 5, 9, 13, 17, 21
  CHECK(column.shape() == sk::Shape{2, 3});
  CHECK_FALSE(column.is_contiguous());
  CHECK(sk::to_vector<float>(ctx, column) == std::vector<float>{1, 5, 9, 13, 17, 21});
  auto stepped = base.slice(2, 0, 4, 2);  // every other element of the last dim
  CHECK(sk::to_vector<float>(ctx, stepped.select(0, 1)) ==
        std::vector<float>{12, 14, 16, 18, 20, 22});
  auto transposed = base.select(0, 0).transpose(0, 1);  // [4, 3]
  CHECK(sk::to_vector<float>(ctx, transposed) ==
        std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  auto packed = sk::contiguous(ctx, transposed);
  CHECK(packed.is_contiguous());
  CHECK_FALSE(packed.shares_storage(base));
  CHECK(sk::to_vector<float>(ctx, packed) == sk::to_vector<float>(ctx, transposed));
}

TEST_CASE("flat views hand out parameters of one buffer") {
  sk::Context ctx;
  auto flat = sk::empty(ctx, {10 + 6 + 4}, sk::DType::f32, sk::MemoryCategory::parameters);
  auto weight = flat.flat_view(0, {2, 5});
  auto bias = flat.flat_view(10, {6});
  auto scale = flat.flat_view(16, {2, 2});
  sk::fill(ctx, weight, 1.0);
  sk::fill(ctx, bias, 2.0);
  sk::fill(ctx, scale, 3.0);
  auto all = sk::to_vector<float>(ctx, flat);
  for (int i = 0; i < 20; ++i) CHECK(all[i] == (i < 10 ? 1.0f : i < 16 ? 2.0f : 3.0f));
  CHECK(weight.shares_storage(scale));
  CHECK(scale.data<float>() == flat.data<float>() + 16);
  CHECK_THROWS_AS(flat.flat_view(18, {3}), sk::InvalidArgument);
}

TEST_CASE("copy converts dtypes on the host and accepts any strides") {
  sk::Context ctx;
  auto source =
      sk::from_vector(ctx, std::vector<double>{1.5, -2.25, 3.0, 65504.0, 1e-8, -0.0}, {2, 3});
  auto halves = sk::cast(ctx, source, sk::DType::f16);
  auto bits = sk::to_vector<sk::Half>(ctx, halves);
  CHECK(bits[0].bits == 0x3e00);
  CHECK(bits[3].bits == 0x7bff);
  CHECK(bits[4].bits == sk::float_to_half_bits(1e-8f));
  CHECK(bits[5].bits == 0x8000);
  auto back = sk::cast(ctx, sk::cast(ctx, source, sk::DType::f32).transpose(0, 1), sk::DType::f64);
  CHECK(sk::to_vector<double>(ctx, back) ==
        std::vector<double>{1.5, 65504.0, -2.25, static_cast<float>(1e-8), 3.0, -0.0});
  auto ints = sk::cast(ctx, source, sk::DType::i64);
  CHECK(sk::to_vector<std::int64_t>(ctx, ints) == std::vector<std::int64_t>{1, -2, 3, 65504, 0, 0});
}

TEST_CASE("add_ adds in place: any strides, the source converted to the destination's dtype") {
  sk::Context ctx;
  auto dst = sk::from_vector(ctx, iota(6), {2, 3});
  const std::vector<float> src_values{0.25f, -1.0f, 2.0f, 1e-3f, 3.5f, -0.5f};
  auto src = sk::cast(ctx, sk::from_vector(ctx, src_values, {3, 2}), sk::DType::f16);
  sk::add_(ctx, dst, src.transpose(0, 1));
  const auto got = sk::to_vector<float>(ctx, dst);
  const float h_1e3 = sk::half_bits_to_float(sk::float_to_half_bits(1e-3f));
  // dst[i][j] += src[j][i]
  CHECK(got == std::vector<float>{0.5f + 0.25f, 1.5f + 2.0f, 2.5f + 3.5f, 3.5f - 1.0f, 4.5f + h_1e3,
                                  5.5f - 0.5f});
  CHECK_THROWS_WITH_AS(sk::add_(ctx, dst, src), doctest::Contains("differs from source shape"),
                       sk::InvalidArgument);
}

TEST_CASE("divide_ rounds once, as the collectives' average does (any strides, 16-bit in f32)") {
  sk::Context ctx({.seed = 11});
  auto values = sk::empty(ctx, {7, 5}, sk::DType::f32);
  sk::normal_(ctx, values, 0.0, 3.0);
  const auto before = sk::to_vector<float>(ctx, values);
  sk::divide_(ctx, values.transpose(0, 1), 6.0);
  const auto after = sk::to_vector<float>(ctx, values);
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(after[i] == before[i] / 6.0f);
  auto half = sk::cast(ctx, sk::from_vector(ctx, before, {7, 5}), sk::DType::bf16);
  const auto wide = sk::to_vector<float>(ctx, sk::cast(ctx, half, sk::DType::f32));
  sk::divide_(ctx, half, 3.0);
  const auto got = sk::to_vector<float>(ctx, sk::cast(ctx, half, sk::DType::f32));
  for (std::size_t i = 0; i < wide.size(); ++i)
    CHECK(got[i] == sk::BFloat16(wide[i] / 3.0f).to_float());
  CHECK_THROWS_WITH_AS(sk::divide_(ctx, values, 0.0), doctest::Contains("the divisor is 0"),
                       sk::InvalidArgument);
}

// Big enough for parallel_for_each_element to cut (2^16 elements per task), with rows of an odd
// length so that tasks start and end inside rows.
TEST_CASE("host element-wise loops on several threads give the elements one thread gives") {
  const sk::Shape shape{5, 3, 20011};
  sk::Context one({.seed = 21, .cpu_threads = 1}), three({.seed = 21, .cpu_threads = 3});
  auto run = [&](sk::Context& ctx) {
    std::vector<std::vector<float>> out;
    auto keep = [&](const sk::Tensor& t) {
      out.push_back(sk::to_vector<float>(ctx, sk::cast(ctx, t, sk::DType::f32)));
    };
    auto x = sk::empty(ctx, shape, sk::DType::f32);
    sk::uniform_(ctx, x, -3, 3);
    keep(x);
    auto y = sk::empty(ctx, shape, sk::DType::bf16);
    sk::normal_(ctx, y, 1.0, 2.0);
    keep(y);
    // A strided, converting copy: x with its first and last dimensions swapped, into f16.
    auto swapped = sk::empty(ctx, {20011, 3, 5}, sk::DType::f16);
    sk::copy(ctx, swapped, x.transpose(0, 2));
    keep(swapped);
    auto same = sk::empty(ctx, shape, sk::DType::f32);
    sk::copy(ctx, same, x);  // the contiguous byte copy
    keep(same);
    sk::add_(ctx, same, swapped.transpose(0, 2));
    keep(same);
    sk::divide_(ctx, same, 7.0);
    keep(same);
    sk::fill(ctx, y, -1.25);
    keep(y);
    keep(sk::cast(ctx, x, sk::DType::f16));  // the contiguous narrowing casts (half_runs.hpp)
    keep(sk::cast(ctx, x, sk::DType::bf16));
    return std::pair{out, sk::to_vector<float>(ctx, x)};
  };
  const auto [serial, x] = run(one);
  const auto [parallel, x3] = run(three);
  REQUIRE(serial.size() == parallel.size());
  for (std::size_t k = 0; k < serial.size(); ++k) {
    CAPTURE(k);
    CHECK(serial[k] == parallel[k]);
  }
  // The narrowing casts put each element's own conversion at its own index.
  std::int64_t miscast = 0;
  for (std::size_t i = 0; i < x3.size(); ++i) {
    miscast += parallel[7][i] != sk::half_bits_to_float(sk::float_to_half_bits(x3[i]));
    miscast += parallel[8][i] != sk::bf16_bits_to_float(sk::float_to_bf16_bits(x3[i]));
  }
  CHECK(miscast == 0);
  // And the strided copy is the transpose, element by element (3-thread result).
  const auto& swapped = parallel[2];
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < 5; ++i)
    for (std::int64_t j = 0; j < 3; ++j)
      for (std::int64_t k = 0; k < 20011; ++k)
        wrong += swapped[static_cast<std::size_t>((k * 3 + j) * 5 + i)] !=
                 sk::Half(x3[static_cast<std::size_t>((i * 3 + j) * 20011 + k)]).to_float();
  CHECK(wrong == 0);
}

// A loop that reads across the written tensor's rows walks 32 x 32 tiles (sizes here not
// multiples of 32, and a third dimension between the two tiled ones; 180 tiles, so 3 tasks of
// 64 tiles on 3 threads): every element is still visited once, with its own row-major index
// and both offsets.
TEST_CASE("transposing element loops visit every element once, with the right offsets") {
  const sk::Shape shape{70, 30, 37}, strides_a{1110, 37, 1}, strides_b{1, 70, 2100};
  REQUIRE(sk::detail::transposed_dimension(shape, strides_b) == 0);
  for (const int threads : {1, 3}) {
    CAPTURE(threads);
    sk::ThreadPool pool(threads);
    std::vector<std::int64_t> index(70 * 30 * 37, -1), offset_b(index.size(), -1);
    std::vector<int> visits(index.size(), 0);
    sk::detail::parallel_for_each_element(pool, shape, strides_a, strides_b,
                                          [&](std::int64_t i, std::int64_t a, std::int64_t b) {
                                            const auto at = static_cast<std::size_t>(a);
                                            index[at] = i;
                                            offset_b[at] = b;
                                            ++visits[at];
                                          });
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < 70; ++i)
      for (std::int64_t j = 0; j < 30; ++j)
        for (std::int64_t k = 0; k < 37; ++k) {
          const auto at = static_cast<std::size_t>(i * 1110 + j * 37 + k);
          wrong += visits[at] != 1 || index[at] != i * 1110 + j * 37 + k ||
                   offset_b[at] != i + j * 70 + k * 2100;
        }
    CHECK(wrong == 0);
  }
  // And through sk::copy, converting on the way: a [37, 3, 70] tensor into its transpose.
  sk::Context ctx({.seed = 3, .cpu_threads = 2});
  auto x = sk::empty(ctx, {37, 3, 70}, sk::DType::f32);
  sk::uniform_(ctx, x, -1, 1);
  auto y = sk::empty(ctx, {70, 3, 37}, sk::DType::bf16);
  sk::copy(ctx, y, x.transpose(0, 2));
  const auto xs = sk::to_vector<float>(ctx, x);
  const auto ys = sk::to_vector<sk::BFloat16>(ctx, y);
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < 70; ++i)
    for (std::size_t j = 0; j < 3; ++j)
      for (std::size_t k = 0; k < 37; ++k)
        wrong += ys[(i * 3 + j) * 37 + k].bits != sk::BFloat16(xs[(k * 3 + j) * 70 + i]).bits;
  CHECK(wrong == 0);
}

// A same-dtype copy that reads across the destination's rows goes through SIMD-transposed
// blocks (core/transpose_blocks.hpp): sizes that leave edges on both sides of every block and
// tile, dimensions before, between and after the transposed two, 4- and 2-byte elements, 1 and
// 3 threads: every element lands where the element loop puts it, bit for bit.
TEST_CASE("transposing copies of one dtype move every element to its transposed place") {
  struct Case {
    sk::Shape shape;
    std::int64_t a, b;  // the dimensions swapped
  };
  const Case cases[] = {{{133, 70}, 0, 1},
                        {{67, 5, 301}, 0, 2},
                        {{64, 64}, 0, 1},
                        {{3, 40, 50}, 1, 2},
                        {{2, 45, 3, 33}, 1, 3}};
  for (const int threads : {1, 3}) {
    sk::Context ctx({.seed = 17, .cpu_threads = threads});
    for (const sk::DType dtype :
         {sk::DType::f32, sk::DType::i32, sk::DType::bf16, sk::DType::f16}) {
      for (const auto& c : cases) {
        CAPTURE(threads);
        CAPTURE(sk::dtype_name(dtype));
        CAPTURE(sk::shape_str(c.shape));
        const auto numel = sk::shape_numel(c.shape);
        // Source values: a multiplicative hash of each index (distinct in 4 bytes; in 2 bytes
        // the low half of it, which repeats only past 65 536 elements), as raw bytes.
        auto x = sk::empty(ctx, c.shape, dtype);
        std::vector<std::uint8_t> bytes(static_cast<std::size_t>(x.nbytes()));
        const std::size_t size = sk::dtype_size(dtype);
        for (std::int64_t i = 0; i < numel; ++i) {
          const auto v = static_cast<std::uint32_t>(i * 2654435761u);
          std::memcpy(bytes.data() + static_cast<std::size_t>(i) * size, &v, size);
        }
        std::memcpy(x.data_ptr(), bytes.data(), bytes.size());
        const auto view = x.transpose(c.a, c.b);
        auto y = sk::empty(ctx, view.shape(), dtype);
        // The SIMD path takes it (the element loop would give the same bytes, so say so).
        REQUIRE(sk::detail::transposing_copy(ctx, y, view) ==
                sk::detail::has_transpose_kernel(size));
        sk::fill(ctx, y, 0.0);
        sk::copy(ctx, y, view);
        const auto* got = static_cast<const std::uint8_t*>(y.data_ptr());
        std::int64_t wrong = 0;
        sk::detail::for_each_element(
            view.shape(), y.strides(), view.strides(),
            [&](std::int64_t, std::int64_t at_y, std::int64_t at_x) {
              wrong += std::memcmp(got + static_cast<std::size_t>(at_y) * size,
                                   bytes.data() + static_cast<std::size_t>(at_x) * size, size) != 0;
            });
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("copies into a tensor stored in another order of its dimensions (channels-last)") {
  // NCHW into channels-last and back: the destination is dense in another dimension order, so
  // the copy runs over both put in its memory order (the transposing path where C and H*W are
  // a tile or more, the strided loop elsewhere); every element lands in its place.
  for (const int threads : {1, 3}) {
    sk::Context ctx({.seed = 19, .cpu_threads = threads});
    for (const sk::DType dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::i32}) {
      for (const sk::Shape& shape :
           {sk::Shape{2, 48, 9, 7}, sk::Shape{3, 5, 6, 4}, sk::Shape{1, 64, 33, 35}}) {
        CAPTURE(threads);
        CAPTURE(sk::dtype_name(dtype));
        CAPTURE(sk::shape_str(shape));
        auto x = sk::empty(ctx, shape, sk::DType::f32);
        sk::uniform_(ctx, x, -100, 100);
        x = sk::cast(ctx, x, dtype);
        const auto last = sk::to_channels_last(ctx, x);
        REQUIRE(sk::is_channels_last(last));
        REQUIRE_FALSE(last.is_contiguous());
        const auto back = sk::contiguous(ctx, last);
        const auto as_f64 = [&](const sk::Tensor& t) {
          return sk::to_vector<double>(ctx, sk::cast(ctx, t, sk::DType::f64));
        };
        CHECK(as_f64(back) == as_f64(x));
        // The channels-last memory itself: element (n, c, h, w) at ((n * H + h) * W + w) * C + c.
        const auto memory = as_f64(sk::Tensor(last.storage(), {sk::shape_numel(shape)}, dtype, 0));
        const auto values = as_f64(x);
        const std::int64_t C = shape[1], H = shape[2], W = shape[3];
        std::int64_t wrong = 0;
        for (std::int64_t n = 0; n < shape[0]; ++n)
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t h = 0; h < H; ++h)
              for (std::int64_t w = 0; w < W; ++w)
                wrong += memory[static_cast<std::size_t>(((n * H + h) * W + w) * C + c)] !=
                         values[static_cast<std::size_t>(((n * C + c) * H + h) * W + w)];
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("a copy between overlapping views of one buffer moves the bytes as memmove does") {
  sk::Context ctx({.seed = 5, .cpu_threads = 2});
  const std::int64_t n = 1 << 20;
  auto buffer = sk::empty(ctx, {n + 1000}, sk::DType::f32);
  sk::uniform_(ctx, buffer, 0, 1);
  auto expected = sk::to_vector<float>(ctx, buffer);
  std::memmove(expected.data() + 1000, expected.data(), n * sizeof(float));
  sk::copy(ctx, buffer.slice(0, 1000, n + 1000), buffer.slice(0, 0, n));
  CHECK(sk::to_vector<float>(ctx, buffer) == expected);
}

TEST_CASE("copy and add_ between overlapping strided views read the source as it was") {
  sk::Context ctx({.seed = 6, .cpu_threads = 2});
  const std::int64_t n = 4096;
  // Rows of two; column 0 of rows [1, n] from column 0 of rows [0, n): the destination runs one
  // row ahead of its source, through the same bytes (an in-order loop would smear row 0 down).
  auto table = sk::empty(ctx, {n + 1, 2}, sk::DType::f32);
  sk::uniform_(ctx, table, -1, 1);
  const auto before = sk::to_vector<float>(ctx, table);
  auto ahead = table.slice(0, 1, n + 1).select(1, 0);
  auto behind = table.slice(0, 0, n).select(1, 0);
  REQUIRE_FALSE(ahead.is_contiguous());
  sk::copy(ctx, ahead, behind);
  auto expected = before;
  for (std::int64_t r = 1; r <= n; ++r)
    expected[static_cast<std::size_t>(2 * r)] = before[static_cast<std::size_t>(2 * (r - 1))];
  CHECK(sk::to_vector<float>(ctx, table) == expected);
  // add_ likewise: each row adds the row before it as it was, not as the call left it.
  auto flat = sk::empty(ctx, {n + 1}, sk::DType::f32);
  sk::uniform_(ctx, flat, -1, 1);
  const auto values = sk::to_vector<float>(ctx, flat);
  sk::add_(ctx, flat.slice(0, 1, n + 1), flat.slice(0, 0, n));
  auto sums = values;
  for (std::size_t i = 1; i < sums.size(); ++i) sums[i] = values[i] + values[i - 1];
  CHECK(sk::to_vector<float>(ctx, flat) == sums);
  // The very same view is no overlap to stage: x += x doubles, x = x keeps.
  sk::add_(ctx, flat, flat);
  for (auto& v : sums) v += v;
  CHECK(sk::to_vector<float>(ctx, flat) == sums);
  sk::copy(ctx, flat, flat);
  CHECK(sk::to_vector<float>(ctx, flat) == sums);
}

TEST_CASE("bad tensor use gets errors that name the shapes and the fix") {
  sk::Context ctx;
  auto t = sk::empty(ctx, {4, 6}, sk::DType::f32);
  auto check_message = [](auto&& fn, const std::string& part) {
    try {
      fn();
      FAIL("no throw");
    } catch (const sk::InvalidArgument& e) {
      CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
    }
  };
  check_message([&] { (void)t.view({5, 5}); }, "has 25 elements but the tensor [4, 6] has 24");
  // A count that overflows (it wrapped to 0: a tensor of 2^64 elements without memory), bytes
  // that do, and a negative size (it became a huge allocation, refused as out of memory).
  const std::int64_t big = std::int64_t{1} << 32;
  check_message(
      [&] {
        (void)sk::empty(ctx, {big, big}, sk::DType::f32);
      },
      "Tensor shape [4294967296, 4294967296] of f32 holds more bytes than a size_t counts");
  check_message([&] { (void)sk::empty(ctx, {std::int64_t{1} << 62}, sk::DType::f32); },
                "holds more bytes than a size_t counts");
  check_message(
      [&] {
        (void)sk::empty(ctx, {3, -2}, sk::DType::f32);
      },
      "Tensor shape [3, -2] has a negative size at dim 1");
  check_message(
      [&] {
        (void)sk::empty_on(ctx, sk::Device::cpu(), {big, big}, sk::DType::f32);
      },
      "holds more bytes than a size_t counts");
  check_message([&] { (void)t.transpose(0, 1).view({24}); }, "make it contiguous first");
  check_message([&] { (void)t.slice(1, 2, 7); }, "slice [2, 7) of dim 1 is outside the size 6");
  check_message([&] { (void)t.select(3, 0); }, "dimension 3 out of range for a tensor of rank 2");
  check_message([&] { (void)t.data<double>(); }, "data<f64>() on a f32 tensor");
  check_message(
      [&] {
        sk::copy(ctx, t, sk::empty(ctx, {6, 4}, sk::DType::f32));
      },
      "destination shape [4, 6] differs from source shape [6, 4]");
  check_message([&] { (void)sk::to_vector<double>(ctx, t); }, "to_vector<f64> of a f32 tensor");
  check_message(
      [&] {
        (void)sk::Tensor(t.storage(), {5, 5}, sk::DType::f32);
      },
      "its storage holds 24 f32 elements");
  check_message(
      [&] {
        (void)sk::from_vector(ctx, std::vector<float>(5), {2, 3});
      },
      "5 values do not fill shape [2, 3]");
}

TEST_CASE("zero-element and zero-dimensional tensors") {
  sk::Context ctx;
  auto none = sk::zeros(ctx, {0, 5}, sk::DType::f32);
  CHECK(none.numel() == 0);
  CHECK(sk::to_vector<float>(ctx, none).empty());
  auto scalar = sk::full(ctx, {}, sk::DType::f64, 2.5);
  CHECK(scalar.numel() == 1);
  CHECK(sk::to_vector<double>(ctx, scalar) == std::vector<double>{2.5});
}

TEST_CASE("message parts: shapes, devices and tensors print in a failed check as str() does") {
  sk::Context ctx;
  const sk::Shape shape{2, 3};
  const sk::Tensor t = sk::zeros(ctx, shape, sk::DType::f32);
  CHECK(sk::detail::concat(sk::shape_text(shape)) == "[2, 3]");
  CHECK(sk::shape_str(shape) == "[2, 3]");
  CHECK(sk::shape_str({}) == "[]");
  CHECK(sk::detail::concat(sk::ShapeText::undefined()) == "undefined");
  CHECK(sk::detail::concat(sk::Device::cuda(1)) == sk::Device::cuda(1).str());
  CHECK(sk::detail::concat(sk::Device::cpu()) == "cpu");
  CHECK(t.str() == "Tensor(f32, [2, 3], cpu)");
  CHECK(sk::detail::concat(sk::tensor_text(t)) == t.str());
  CHECK(sk::detail::concat(sk::tensor_text(sk::Tensor())) == "an undefined tensor");
  CHECK(sk::detail::concat(sk::TensorText(nullptr, "none")) == "none");
  // Formatted when the check fails, from the values of that moment.
  CHECK_THROWS_WITH_AS(sk::check(false, "x is ", sk::shape_text(t.shape()), " on ", t.device()),
                       "x is [2, 3] on cpu", sk::InvalidArgument);
}
