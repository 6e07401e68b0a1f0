// Fused ops on the CPU against float64 references (the cases are shared with test_ops_gpu.cu).
#include "cpu_backend.hpp"

namespace ops_test {
using Backend = CpuBackend;
}  // namespace ops_test

#include <cmath>
#include <string>

#include "contraction_probe.hpp"
#include "ops_test_list.hpp"

// The CPU backend spreads chunks over the context's threads; which thread sums a chunk never
// enters the arithmetic, so every op gives the same bits on any thread count.
namespace {

namespace sk = shardkit;
namespace ops = shardkit::ops;

struct ThreadedOpsRun {
  std::vector<std::vector<float>> w, buf, m, v;
  std::vector<double> sums, unscale_sums;
};

ThreadedOpsRun run_ops_on_threads(int threads, const std::vector<std::int64_t>& sizes) {
  sk::Context ctx(sk::ContextOptions{.cpu_threads = threads});
  std::mt19937 gen(42);
  std::uniform_real_distribution<float> dist(0.5f, 1.5f);
  auto make = [&](std::int64_t n) {
    auto t = sk::empty(ctx, {n}, sk::DType::f32);
    for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = dist(gen);
    return t;
  };
  std::vector<sk::Tensor> w, g, buf, m, v;
  for (const auto n : sizes) {
    w.push_back(make(n));
    g.push_back(make(n));
    buf.push_back(make(n));
    m.push_back(make(n));
    v.push_back(make(n));
  }
  const auto count = static_cast<std::int64_t>(sizes.size());
  ops::SgdOptions o;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  ops::LarcOptions larc;
  larc.weight_decay = 1e-4f;
  ops::larc_sgd_step(ctx, o, larc, {w, g, buf, {}});  // fused, first step
  o.first_step = false;
  auto sums = sk::zeros(ctx, {2, count}, sk::DType::f64);
  auto coefficients = sk::zeros(ctx, {count, 2}, sk::DType::f32);
  ops::segment_sums_of_squares<ops::Cpu>(ctx, w, g, sums);  // composed, running momentum
  ops::larc_coefficients<ops::Cpu>(ctx, larc, o.lr, 1.0f, sums, coefficients);
  ops::sgd_step<ops::Cpu>(ctx, o, {w, g, buf, {}}, coefficients);
  ops::larc_sgd_step(ctx, o, larc, {w, g, buf, {}});  // fused again
  ops::AdamOptions adam;
  adam.step = 3;
  adam.weight_decay = 0.01f;
  ops::adam_step<ops::Cpu>(ctx, adam, {w, g, m, v, {}});
  auto found = sk::zeros(ctx, {1}, sk::DType::f32);
  auto unscale_sums = sk::zeros(ctx, {1, count}, sk::DType::f64);
  ops::unscale_and_check<ops::Cpu>(ctx, 0.5f, g, found, unscale_sums);

  ThreadedOpsRun run;
  auto values = [](const sk::Tensor& t) {
    return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
  };
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    run.w.push_back(values(w[i]));
    run.buf.push_back(values(buf[i]));
    run.m.push_back(values(m[i]));
    run.v.push_back(values(v[i]));
  }
  run.sums.assign(sums.data<double>(), sums.data<double>() + 2 * count);
  run.unscale_sums.assign(unscale_sums.data<double>(), unscale_sums.data<double>() + count);
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// n values drawn uniformly from [-1, 1).
std::vector<float> uniform_values(std::mt19937& gen, std::int64_t n) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

}  // namespace

TEST_CASE("CPU ops (LARC fused and composed, SGD, Adam, sums, unscale): same bits on 1-5 threads") {
  // Short spans, spans around the chunk size and the 8 sum lanes, and spans of many chunks.
  const std::vector<std::int64_t> sizes = {1, 7, 8, 9, 100, 8191, 8192, 8193, 3, 50001, 70000, 5};
  const auto one = run_ops_on_threads(1, sizes);
  for (int threads : {2, 3, 5}) {
    CAPTURE(threads);
    const auto many = run_ops_on_threads(threads, sizes);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(many.w[i], one.w[i]));
      CHECK(same_bits(many.buf[i], one.buf[i]));
      CHECK(same_bits(many.m[i], one.m[i]));
      CHECK(same_bits(many.v[i], one.v[i]));
    }
    CHECK(std::memcmp(many.sums.data(), one.sums.data(), one.sums.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(many.unscale_sums.data(), one.unscale_sums.data(),
                      one.unscale_sums.size() * sizeof(double)) == 0);
  }
}

// The fused step reads the next batch's norms between the blocks of this batch's update
// (cpu_larc.hpp); tensors of 7 M elements make several batches on each thread count. It must
// give the composed step's bits (norms pass, coefficients, then the update), with the params'
// squares kept and without.
TEST_CASE("the pipelined fused LARC-SGD equals the composed step bit for bit, over many batches") {
  const std::vector<std::int64_t> sizes = {3000,      2'500'000, 64,      700'000,   700'000,
                                           1'100'001, 17,        400'000, 1'300'000, 9};
  std::mt19937 gen(8);
  auto random = [&](std::int64_t n) { return uniform_values(gen, n); };
  std::vector<std::vector<float>> w0, g0, buf0;
  for (const auto n : sizes) {
    w0.push_back(random(n));
    g0.push_back(random(n));
    buf0.push_back(random(n));
  }
  for (const int threads : {1, 2, 3}) {
    CAPTURE(threads);
    sk::Context ctx(sk::ContextOptions{.cpu_threads = threads});
    auto tensors = [&](const std::vector<std::vector<float>>& values) {
      std::vector<sk::Tensor> out;
      for (const auto& v : values) {
        out.push_back(sk::empty(ctx, {static_cast<std::int64_t>(v.size())}, sk::DType::f32));
        std::memcpy(out.back().data_ptr(), v.data(), v.size() * sizeof(float));
      }
      return out;
    };
    const auto g = tensors(g0);
    auto w_fused = tensors(w0), buf_fused = tensors(buf0);
    auto w_kept = tensors(w0), buf_kept = tensors(buf0);
    auto w_composed = tensors(w0), buf_composed = tensors(buf0);
    const ops::SgdOptions o{.lr = 0.1f, .momentum = 0.9f, .first_step = false};
    const ops::LarcOptions larc{.trust_coefficient = 0.02f, .weight_decay = 1e-3f};
    const auto count = static_cast<std::int64_t>(sizes.size());
    auto sums = sk::zeros(ctx, {2, count}, sk::DType::f64);
    auto coefficients = sk::zeros(ctx, {count, 2}, sk::DType::f32);
    ops::LarcParamSquares squares;
    for (int step = 0; step < 2; ++step) {  // the second kept step reads the grads alone
      ops::larc_sgd_step(ctx, o, larc, {w_fused, g, buf_fused, {}});
      ops::larc_sgd_step(ctx, o, larc, {w_kept, g, buf_kept, {}}, &squares);
      ops::segment_sums_of_squares<ops::Cpu>(ctx, w_composed, g, sums);
      ops::larc_coefficients<ops::Cpu>(ctx, larc, o.lr, 1.0f, sums, coefficients);
      ops::sgd_step<ops::Cpu>(ctx, o, {w_composed, g, buf_composed, {}}, coefficients);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      CAPTURE(i);
      const auto bytes = static_cast<std::size_t>(sizes[i]) * sizeof(float);
      CHECK(std::memcmp(w_fused[i].data_ptr(), w_composed[i].data_ptr(), bytes) == 0);
      CHECK(std::memcmp(buf_fused[i].data_ptr(), buf_composed[i].data_ptr(), bytes) == 0);
      CHECK(std::memcmp(w_kept[i].data_ptr(), w_composed[i].data_ptr(), bytes) == 0);
      CHECK(std::memcmp(buf_kept[i].data_ptr(), buf_composed[i].data_ptr(), bytes) == 0);
    }
  }
}

TEST_CASE(
    "LARC-SGD with the norm tree's norms, pipelined, equals the tree's composed step bit for bit "
    "(f32, bf16 and f16 gradients with their copies, per-tensor decays, many batches)") {
  // The composed step forms each tensor's norms as the sharded optimizer does for any split:
  // the leaf sums, padded with zeros to a power of two and added pairwise, give the root.
  const std::vector<std::int64_t> sizes = {3000,      2'500'000, 64, 8192,    8193, 700'000,
                                           1'100'001, 17,        1,  400'000, 9};
  const auto count = static_cast<std::int64_t>(sizes.size());
  std::mt19937 gen(11);
  auto random = [&](std::int64_t n) { return uniform_values(gen, n); };
  std::vector<std::vector<float>> w0, g0, buf0;
  std::vector<double> decays;
  for (const auto n : sizes) {
    w0.push_back(random(n));
    g0.push_back(random(n));
    buf0.push_back(random(n));
    decays.push_back(decays.size() % 3 == 1 ? 0.0 : 1e-3 * static_cast<double>(decays.size()));
  }
  auto root = [](const std::vector<double>& leaves) {
    std::size_t width = 1;
    while (width < leaves.size()) width *= 2;
    std::vector<double> level(leaves);
    level.resize(width, 0.0);
    for (; width > 1; width /= 2)
      for (std::size_t i = 0; i < width / 2; ++i) level[i] = level[2 * i] + level[2 * i + 1];
    return level[0];
  };
  for (const auto grad_dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::f16}) {
    for (const int threads : {1, 2, 3}) {
      CAPTURE(sk::dtype_name(grad_dtype));
      CAPTURE(threads);
      sk::Context ctx(sk::ContextOptions{.cpu_threads = threads});
      auto tensors = [&](const std::vector<std::vector<float>>& values, sk::DType dtype) {
        std::vector<sk::Tensor> out;
        for (const auto& v : values) {
          const auto n = static_cast<std::int64_t>(v.size());
          auto wide = sk::empty(ctx, {n}, sk::DType::f32);
          std::memcpy(wide.data_ptr(), v.data(), v.size() * sizeof(float));
          out.push_back(sk::empty(ctx, {n}, dtype));
          sk::copy(ctx, out.back(), wide);
        }
        return out;
      };
      const bool mixed = grad_dtype != sk::DType::f32;
      const auto g = tensors(g0, grad_dtype);
      auto w_tree = tensors(w0, sk::DType::f32), buf_tree = tensors(buf0, sk::DType::f32);
      auto w_composed = tensors(w0, sk::DType::f32), buf_composed = tensors(buf0, sk::DType::f32);
      const std::vector<sk::Tensor> none;
      const auto low_tree = mixed ? tensors(w0, grad_dtype) : none;
      const auto low_composed = mixed ? tensors(w0, grad_dtype) : none;
      ops::SgdOptions o;
      o.lr = 0.1f;
      o.momentum = 0.9f;
      ops::LarcOptions larc;
      larc.trust_coefficient = 0.02f;
      const float inv_grad_scale = 0.5f;
      std::vector<double> sums(static_cast<std::size_t>(3 * count));
      auto coefficients = sk::zeros(ctx, {count, 2}, sk::DType::f32);
      for (int step = 0; step < 2; ++step) {
        o.first_step = step == 0;
        ops::SgdOptions scaled = o;
        scaled.inv_grad_scale = inv_grad_scale;
        ops::larc_sgd_step_tree<ops::Cpu>(ctx, scaled, larc, {w_tree, g, buf_tree, low_tree},
                                          decays);
        for (std::int64_t i = 0; i < count; ++i) {
          const auto k = static_cast<std::size_t>(i);
          for (std::size_t list = 0; list < 2; ++list) {
            const sk::Tensor& t = list == 0 ? w_composed[k] : g[k];
            auto leaves = sk::empty(ctx, {ops::norm_leaves(t.numel())}, sk::DType::f64);
            ops::leaf_sums_of_squares<ops::Cpu>(ctx, std::span<const sk::Tensor>(&t, 1), leaves);
            sums[list * static_cast<std::size_t>(count) + k] =
                root(sk::to_vector<double>(ctx, leaves));
          }
          sums[2 * static_cast<std::size_t>(count) + k] = decays[k];
        }
        ops::larc_coefficients<ops::Cpu>(ctx, larc, o.lr, inv_grad_scale,
                                         sk::from_vector(ctx, sums, {3, count}), coefficients);
        ops::sgd_step<ops::Cpu>(ctx, o, {w_composed, g, buf_composed, low_composed}, coefficients);
      }
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        CAPTURE(i);
        const auto n = static_cast<std::size_t>(sizes[i]);
        CHECK(std::memcmp(w_tree[i].data_ptr(), w_composed[i].data_ptr(), n * 4) == 0);
        CHECK(std::memcmp(buf_tree[i].data_ptr(), buf_composed[i].data_ptr(), n * 4) == 0);
        if (mixed)
          CHECK(std::memcmp(low_tree[i].data_ptr(), low_composed[i].data_ptr(), n * 2) == 0);
      }
    }
  }
}

// An update's vectorised groups and its scalar tail must round alike (GCC could contract a
// multiply-add into an FMA in one and not the other): the ops' bits would then depend on where
// the chunks and blocks start.
template <class F>
void check_update_is_elementwise(const std::string& functor, const F& op,
                                 const typename F::Segment& segment) {
  CAPTURE(functor);
  constexpr int n = 300;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<std::vector<float>> whole(F::kDepth, std::vector<float>(n));
  for (auto& operand : whole)
    for (auto& x : operand) x = dist(gen);
  for (auto& x : whole[3 % F::kDepth]) x = std::abs(x);  // Adam's second moment is not negative
  auto single = whole;
  std::vector<void*> grouped_data, single_data;
  for (int k = 0; k < F::kDepth; ++k) {
    grouped_data.push_back(whole[static_cast<std::size_t>(k)].data());
    single_data.push_back(single[static_cast<std::size_t>(k)].data());
  }
  ops::cpu::apply_range(op, segment, grouped_data.data(), 0, n, n);
  for (std::int64_t i = 0; i < n; ++i)
    ops::cpu::apply_range(op, segment, single_data.data(), i, i + 1, n);
  for (int k = 0; k < F::kDepth; ++k) {
    CAPTURE(k);
    CHECK(std::memcmp(whole[static_cast<std::size_t>(k)].data(),
                      single[static_cast<std::size_t>(k)].data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE("an update loop's groups and tail round alike (SGD with momentum, AdamW)") {
  const ops::SgdOptions sgd{.lr = 0.1f, .momentum = 0.9f, .nesterov = true, .first_step = false};
  const auto sgd_op = ops::make_sgd_functor<ops::MomentumMode::running, void, float>(sgd, nullptr);
  check_update_is_elementwise("SGD", sgd_op, sgd_op.segment_of(ops::SgdCoefficients{0.7f, 1e-3f}));
  const ops::AdamOptions adam{
      .lr = 1e-2f, .weight_decay = 0.1f, .decoupled_weight_decay = true, .step = 3};
  const auto adam_op = ops::make_adam_functor<void, float>(adam);
  check_update_is_elementwise("AdamW", adam_op, adam_op.segment(0));
}

TEST_CASE("the vectorised sums of squares have apply_range's bits, from any start") {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  std::vector<float> a(300), b(300);
  for (auto& x : a) x = dist(gen);
  for (auto& x : b) x = dist(gen) * 1e-3f;
  void* const data[2] = {a.data(), b.data()};
  for (std::int64_t lo : {0, 1, 5, 8}) {
    for (std::int64_t hi = lo; hi <= 300; hi += 13) {
      CAPTURE(lo);
      CAPTURE(hi);
      const auto generic =
          ops::cpu::apply_range(ops::SumOfSquaresFunctor<2>{}, {}, data, lo, hi, 300);
      const auto paired = ops::cpu::sums_of_squares_pair(a.data(), b.data(), lo, hi, 300);
      CHECK(std::memcmp(generic.data(), paired.data(), sizeof paired) == 0);
      // One operand alone (the grads, when the params' squares are kept) and the squares an
      // update takes of what it wrote: the same lanes, the same bits.
      const auto single = ops::cpu::sums_of_squares<1>({b.data()}, lo, hi, 300);
      CHECK(std::memcmp(&single[0], &generic[1], sizeof(double)) == 0);
      // An SGD update (params a, grads b) squares the params it writes as a norms pass over
      // them would.
      std::vector<float> updated = a;
      void* const operands[4] = {updated.data(), b.data(), nullptr, nullptr};
      const auto sgd = ops::make_sgd_functor<ops::MomentumMode::none, void, float>(
          ops::SgdOptions{.lr = 0.5f}, nullptr);
      const double squared = ops::cpu::update_in_blocks<true>(sgd, sgd.segment(0), operands, lo, hi,
                                                              300, [](std::int64_t) {});
      const auto after = ops::cpu::sums_of_squares<1>({updated.data()}, lo, hi, 300);
      CHECK(std::memcmp(&squared, &after[0], sizeof(double)) == 0);
      if (hi > lo) CHECK(squared != generic[0]);  // the params it squared are the new ones
    }
  }
}

// mul_rn is the product rounded on its own: GCC contracts a product into the add it feeds (an
// FMA, one rounding) from -O2 on wherever the host has FMA, as nvcc does on the device unless
// told apart (__fmul_rn). Operands whose exact product needs more bits than the format keeps
// tell them apart: rounded, the product equals -c and the sum is 0; fused, the sum is what
// rounding dropped. (The sums in contraction_probe.cpp, compiled at -O2 as the kernels are.)
TEST_CASE("mul_rn rounds the product on its own, never fused into the add it feeds") {
  const double a = 1.0 + 0x1p-27, c = -(1.0 + 0x1p-26);
  CHECK(ops::mul_rn(a, a) == 1.0 + 0x1p-26);
  CHECK(ops_test::mul_rn_then_add(a, a, c) == 0.0);  // fused: 2^-54
  const float fa = 1.0f + 0x1p-12f, fc = -(1.0f + 0x1p-11f);
  CHECK(ops::mul_rn(fa, fa) == 1.0f + 0x1p-11f);
  CHECK(ops_test::mul_rn_then_add(fa, fa, fc) == 0.0f);  // fused: 2^-24
  // Signed zeros and an underflow keep the product's sign.
  volatile double tiny = 1e-200;
  CHECK(std::signbit(ops::mul_rn(-tiny, tiny)));
  CHECK_FALSE(std::signbit(ops::mul_rn(tiny, tiny)));
  CHECK(std::signbit(ops::mul_rn(-0.0f, fa)));
}
