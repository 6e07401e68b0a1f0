// The split-invariant norm tree (ops/norm_tree.hpp): covers are the largest nodes inside a leaf
// range; the root has the same bits however the leaves are split among pieces (and with no
// split), is within rounding of the float64 sum, and a missing piece is named; the CPU
// backend's leaf sums (vectorised f32 lanes, chunks on any number of threads) are the scalar
// leaf_sum_of_squares bit for bit.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/ops/fused_ops.hpp"
#include "shardkit/ops/norm_tree.hpp"

namespace ops = shardkit::ops;
namespace sk = shardkit;

namespace {

// The cover of leaves [lo, hi) of `leaves` (leaf values from leaf 0), each node with its value
// formed along the tree, into `known`.
void add_cover(const std::vector<double>& leaves, std::int64_t lo, std::int64_t hi,
               std::map<ops::NormNode, double>& known) {
  std::vector<double> scratch;
  for (const auto& node : ops::norm_cover(lo, hi))
    known[node] = ops::norm_subtree(leaves.data() + (node.index << node.level),
                                    std::int64_t{1} << node.level, scratch);
}

// The root of `leaves` leaf values cut into pieces at `cuts` (leaf indices, ascending).
double root_of(const std::vector<double>& leaves, const std::vector<std::int64_t>& cuts) {
  std::map<ops::NormNode, double> known;
  std::int64_t lo = 0;
  std::vector<std::int64_t> ends = cuts;
  ends.push_back(static_cast<std::int64_t>(leaves.size()));
  for (auto hi : ends) {
    add_cover(leaves, lo, hi, known);
    lo = hi;
  }
  return ops::norm_root(static_cast<std::int64_t>(leaves.size()), known);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("a cover is the largest aligned nodes inside the range, left to right") {
  const auto nodes = ops::norm_cover(3, 13);
  const std::vector<ops::NormNode> expected = {{0, 3}, {2, 1}, {2, 2}, {0, 12}};
  CHECK(nodes == expected);
  CHECK(ops::norm_cover(0, 8) == std::vector<ops::NormNode>{{3, 0}});
  CHECK(ops::norm_cover(5, 5).empty());
}

TEST_CASE("the root has the same bits for every split, and is the sum of squares") {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  for (std::int64_t n : {1, 15, 16, 17, 255, 1000, 4099, 70001}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = value(gen) * (gen() % 7 == 0 ? 1e-3f : 1.0f);
    std::vector<double> leaves;
    for (std::int64_t lo = 0; lo < n; lo += ops::kNormLeaf)
      leaves.push_back(ops::leaf_sum_of_squares(
          x.data() + lo, static_cast<int>(std::min(ops::kNormLeaf, n - lo))));
    const auto count = static_cast<std::int64_t>(leaves.size());
    const double whole = root_of(leaves, {});
    double exact = 0;
    for (float v : x) exact += static_cast<double>(v) * v;
    CHECK(std::abs(whole - exact) <= 1e-13 * exact);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<std::int64_t> cuts;
      for (std::int64_t c = 1; c < count; ++c)
        if (gen() % static_cast<unsigned>(std::max<std::int64_t>(2, count / 3)) == 0)
          cuts.push_back(c);
      CAPTURE(n);
      CAPTURE(cuts.size());
      CHECK(same_bits(root_of(leaves, cuts), whole));
    }
    std::vector<std::int64_t> every;  // one leaf per piece
    for (std::int64_t c = 1; c < count; ++c) every.push_back(c);
    CHECK(same_bits(root_of(leaves, every), whole));
  }
}

TEST_CASE("a leaf that no piece covers is named") {
  std::map<ops::NormNode, double> known;
  const std::vector<double> leaves(10, 1.0);
  add_cover(leaves, 0, 6, known);
  CHECK_THROWS_WITH(ops::norm_root(10, known),
                    doctest::Contains("leaf 6 of 10 is covered by no piece"));
  CHECK(ops::norm_root(6, known) == 6.0);
  CHECK(ops::norm_root(0, {}) == 0.0);
}

TEST_CASE("the CPU backend's leaf sums are leaf_sum_of_squares bit for bit, on any threads") {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  const std::vector<std::int64_t> sizes = {1, 15, 16, 17, 8191, 8192, 8209, 70001};
  for (auto dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::f16}) {
    sk::Context host;
    std::vector<sk::Tensor> tensors;
    std::vector<double> expected;
    for (auto n : sizes) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (auto& v : x) v = value(gen) * (gen() % 5 == 0 ? 1e-4f : 1.0f);
      tensors.push_back(sk::cast(host, sk::from_vector(host, x, {n}), dtype));
      const auto rounded =
          sk::to_vector<float>(host, sk::cast(host, tensors.back(), sk::DType::f32));
      for (std::int64_t lo = 0; lo < n; lo += ops::kNormLeaf)
        expected.push_back(ops::leaf_sum_of_squares(
            rounded.data() + lo, static_cast<int>(std::min(ops::kNormLeaf, n - lo))));
    }
    for (int threads : {1, 2, 3}) {
      sk::Context ctx({.cpu_threads = threads});
      auto leaves = sk::empty(ctx, {static_cast<std::int64_t>(expected.size())}, sk::DType::f64);
      ops::leaf_sums_of_squares<ops::Cpu>(ctx, tensors, leaves);
      const auto got = sk::to_vector<double>(ctx, leaves);
      CAPTURE(threads);
      CAPTURE(sk::dtype_name(dtype));
      CHECK(std::memcmp(got.data(), expected.data(), got.size() * sizeof(double)) == 0);
    }
  }
}

// Params and grads in one pass (the two lists interleaved every 16 leaves inside each task):
// each row is its list's leaf sums, bit for bit, for mixed dtypes and any thread count.
TEST_CASE("the CPU backend's paired leaf sums equal each list's own, on any threads") {
  std::mt19937 gen(8);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  const std::vector<std::int64_t> sizes = {1, 15, 16, 17, 255, 256, 257, 8192, 8209, 70001};
  const std::pair<sk::DType, sk::DType> pairs[] = {{sk::DType::f32, sk::DType::f32},
                                                   {sk::DType::f32, sk::DType::bf16},
                                                   {sk::DType::f32, sk::DType::f16},
                                                   {sk::DType::bf16, sk::DType::f16}};
  for (const auto& [first_dtype, second_dtype] : pairs) {
    sk::Context host;
    std::vector<sk::Tensor> first, second;
    std::vector<double> expected_first, expected_second;
    auto add = [&](std::vector<sk::Tensor>& list, std::vector<double>& expected, sk::DType dtype,
                   std::int64_t n) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (auto& v : x) v = value(gen);
      list.push_back(sk::cast(host, sk::from_vector(host, x, {n}), dtype));
      const auto rounded = sk::to_vector<float>(host, sk::cast(host, list.back(), sk::DType::f32));
      for (std::int64_t lo = 0; lo < n; lo += ops::kNormLeaf)
        expected.push_back(ops::leaf_sum_of_squares(
            rounded.data() + lo, static_cast<int>(std::min(ops::kNormLeaf, n - lo))));
    };
    for (auto n : sizes) {
      add(first, expected_first, first_dtype, n);
      add(second, expected_second, second_dtype, n);
    }
    const auto total = static_cast<std::int64_t>(expected_first.size());
    for (int threads : {1, 2, 3}) {
      sk::Context ctx({.cpu_threads = threads});
      auto leaves = sk::full(ctx, {2, total}, sk::DType::f64, -1.0);
      ops::leaf_sums_of_squares<ops::Cpu>(ctx, first, second, leaves);
      const auto got = sk::to_vector<double>(ctx, leaves);
      CAPTURE(threads);
      CAPTURE(sk::dtype_name(first_dtype));
      CAPTURE(sk::dtype_name(second_dtype));
      CHECK(std::memcmp(got.data(), expected_first.data(), expected_first.size() * 8) == 0);
      CHECK(std::memcmp(got.data() + total, expected_second.data(), expected_second.size() * 8) ==
            0);
    }
  }
}

TEST_CASE("a cover formed as the leaves arrive is norm_cover's, with norm_subtree's values") {
  std::mt19937 gen(13);
  std::uniform_real_distribution<double> value(0.0, 2.0);
  std::vector<double> leaves(3000);
  for (auto& v : leaves) v = value(gen) * (gen() % 7 == 0 ? 1e-9 : 1.0);
  std::vector<double> scratch;
  for (int trial = 0; trial < 200; ++trial) {
    const auto lo = static_cast<std::int64_t>(gen() % 1500);
    const auto hi = lo + static_cast<std::int64_t>(gen() % 1500);
    CAPTURE(lo);
    CAPTURE(hi);
    ops::NormCoverStack<64> stack(lo);
    for (std::int64_t i = lo; i < hi; ++i) stack.push(0, leaves[static_cast<std::size_t>(i)]);
    const auto cover = ops::norm_cover(lo, hi);
    REQUIRE(stack.size() == static_cast<int>(cover.size()));
    for (int j = 0; j < stack.size(); ++j) {
      const auto& node = cover[static_cast<std::size_t>(j)];
      CHECK(stack.node(j) == node);
      CHECK(same_bits(stack.value(j), ops::norm_subtree(leaves.data() + (node.index << node.level),
                                                        std::int64_t{1} << node.level, scratch)));
    }
  }
  ops::NormCoverStack<2> small(1);  // leaves 1, 2, 3 need two nodes; a third does not fit
  small.push(0, 1.0);
  small.push(1, 2.0);
  CHECK(small.size() == 2);
  CHECK_THROWS_WITH(small.push(0, 1.0), doctest::Contains("more than 2 nodes"));
}

// The pipelined LARC-SGD step's tree norms (cpu::TreeSums, read a piece at a time between the
// update's blocks) must be the roots the sharded optimizer forms, bit for bit: a last-bit
// difference in a norm rarely shows in the f32 update, so the norms are compared themselves.
TEST_CASE("the pipelined step's tree norms are each tensor's root bit for bit, read in pieces") {
  std::mt19937 gen(17);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  const std::vector<std::int64_t> sizes = {1, 17, 255, 256, 8192, 8209, 70001, 300'000};
  for (auto grad_dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::f16}) {
    CAPTURE(sk::dtype_name(grad_dtype));
    sk::Context host;
    std::vector<sk::Tensor> params, grads, momentum;
    std::vector<std::array<double, 2>> expected;
    auto values = [&](std::int64_t n) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (auto& v : x) v = value(gen) * (gen() % 7 == 0 ? 1e-3f : 1.0f);
      return x;
    };
    auto root = [&](const sk::Tensor& t) {
      const auto rounded = sk::to_vector<float>(host, sk::cast(host, t, sk::DType::f32));
      std::vector<double> leaves;
      for (std::int64_t lo = 0; lo < t.numel(); lo += ops::kNormLeaf)
        leaves.push_back(ops::leaf_sum_of_squares(
            rounded.data() + lo, static_cast<int>(std::min(ops::kNormLeaf, t.numel() - lo))));
      return root_of(leaves, {});
    };
    for (auto n : sizes) {
      params.push_back(sk::from_vector(host, values(n), {n}));
      grads.push_back(sk::cast(host, sk::from_vector(host, values(n), {n}), grad_dtype));
      momentum.push_back(sk::zeros(host, {n}, sk::DType::f32));
      expected.push_back({root(params.back()), root(grads.back())});
    }
    ops::SgdOptions o;
    o.momentum = 0.9f;
    const auto spans = ops::sgd_spans(host, o, {params, grads, momentum, {}});
    std::vector<ops::cpu::Chunk> chunks;
    ops::cpu::cut_into_chunks(spans, 0, spans.size(), chunks);
    auto check_tree = [&]<class Grad>() {
      using Tree = ops::cpu::TreeSums<Grad>;
      std::vector<typename Tree::Partial> partials(chunks.size());
      ops::cpu::ChunkRunSquares<Tree> reader(spans, chunks, partials.data());
      for (std::int64_t done = 0; done < reader.elements();)  // uneven pieces
        reader.advance_to(done += static_cast<std::int64_t>(1 + gen() % 3000));
      std::vector<std::array<double, 2>> sums(spans.size(), {0.0, 0.0});
      Tree::finish(spans, chunks, partials, 0, sums);
      for (std::size_t s = 0; s < sizes.size(); ++s) {
        CAPTURE(sizes[s]);
        CHECK(same_bits(sums[s][0], expected[s][0]));
        CHECK(same_bits(sums[s][1], expected[s][1]));
      }
    };
    if (grad_dtype == sk::DType::f32) check_tree.template operator()<float>();
    if (grad_dtype == sk::DType::bf16) check_tree.template operator()<sk::BFloat16>();
    if (grad_dtype == sk::DType::f16) check_tree.template operator()<sk::Half>();
  }
}
