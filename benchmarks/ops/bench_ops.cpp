// Fused optimizer steps, casts and the unscale pass on the CPU (one thread), over ResNet-50's
// 161 tensors and a flat buffer of 2^26 elements (2^28 would need 4 GiB per operand here), next
// to the unfused LARC-SGD users run today. GBps = minimum bytes / time; pct_of_copy against a
// memcpy of the same bytes in this run.
#include "bench_common.hpp"
#include "bench_ops_common.hpp"

#include <cmath>

#include <shardkit/ops/ops.hpp>

namespace sk = shardkit;
namespace ops = shardkit::ops;
namespace bench = shardkit::bench;

namespace {

constexpr std::int64_t kFlatElements = std::int64_t{1} << 26;

bench::OpsWorkload& workload(bool flat, bool adam = false) {
  static sk::Context ctx({.seed = 11});
  static bench::OpsWorkload resnet(ctx, false, 0, false), flat_buffer(ctx, true, kFlatElements);
  static bench::OpsWorkload* resnet_adam = nullptr;
  if (adam) {
    if (!resnet_adam) resnet_adam = new bench::OpsWorkload(ctx, false, 0, true);
    return *resnet_adam;
  }
  return flat ? flat_buffer : resnet;
}

sk::Context& context() {
  static sk::Context ctx;
  return ctx;
}

void report(benchmark::State& state, double bytes_per_param, std::int64_t params) {
  const double bytes = bytes_per_param * static_cast<double>(params);
  bench::report_bandwidth(state, bytes,
                          bench::host_copy_bytes_per_second(static_cast<std::size_t>(bytes / 2)));
  state.counters["ms_per_step"] = benchmark::Counter(1e3, benchmark::Counter::kIsIterationInvariantRate |
                                                               benchmark::Counter::kInvert);
}

ops::SgdOptions sgd_options() {
  ops::SgdOptions o;
  o.lr = 1e-3f;  // small steps: the parameters stay finite over thousands of iterations
  o.momentum = 0.9f;
  o.first_step = false;
  return o;
}

ops::LarcOptions larc_options() {
  ops::LarcOptions l;
  l.trust_coefficient = 0.001f;
  l.clip = false;
  l.weight_decay = 1e-6f;
  return l;
}

void BM_copy(benchmark::State& state) {
  const bool flat = state.range(0) != 0;
  auto& w = workload(flat);
  const auto bytes = static_cast<std::size_t>(w.params) * 4;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
  }
  report(state, 8, w.params);
}

void BM_sgd_momentum(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  for (auto _ : state) ops::sgd_step<ops::Cpu>(context(), o, {w.w, w.g, w.buf, {}});
  report(state, bench::kSgdMomentumBytes, w.params);
}

void BM_sgd_momentum_bf16_copy(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  for (auto _ : state) ops::sgd_step<ops::Cpu>(context(), o, {w.w, w.g, w.buf, w.low});
  report(state, bench::kSgdBf16CopyBytes, w.params);
}

// Fused: per tensor, norms then update while the tensor is still in cache.
void BM_larc_sgd_fused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const auto l = larc_options();
  for (auto _ : state) ops::larc_sgd_step<ops::Cpu>(context(), o, l, {w.w, w.g, w.buf, {}});
  report(state, bench::kLarcSgdBytes, w.params);
}

// Composed, as sharded training runs it: all norms (partials), coefficients, then the update.
void BM_larc_sgd_composed(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context();
  const auto o = sgd_options();
  const auto l = larc_options();
  const auto n = static_cast<std::int64_t>(w.w.size());
  auto sums = sk::empty(ctx, {2, n}, sk::DType::f64);
  auto coefficients = sk::empty(ctx, {n, 2}, sk::DType::f32);
  for (auto _ : state) {
    ops::segment_sums_of_squares<ops::Cpu>(ctx, w.w, w.g, sums);
    ops::larc_coefficients<ops::Cpu>(ctx, l, o.lr, 1.0f, sums, coefficients);
    ops::sgd_step<ops::Cpu>(ctx, o, {w.w, w.g, w.buf, {}}, coefficients);
  }
  report(state, bench::kLarcSgdBytes, w.params);
}

// What apex LARC + torch.optim.SGD do today, one pass per eager op: norm(w), norm(g),
// g += wd·w, g *= rate per tensor; then buf = m·buf + g, w -= lr·buf per tensor.
void BM_larc_sgd_unfused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const auto l = larc_options();
  for (auto _ : state) {
    for (std::size_t t = 0; t < w.w.size(); ++t) {
      float* p = w.w[t].data<float>();
      float* g = w.g[t].data<float>();
      const std::int64_t n = w.w[t].numel();
      double wsq = 0, gsq = 0;
      for (std::int64_t i = 0; i < n; ++i) wsq += static_cast<double>(p[i]) * p[i];
      for (std::int64_t i = 0; i < n; ++i) gsq += static_cast<double>(g[i]) * g[i];
      const double wn = std::sqrt(wsq), gn = std::sqrt(gsq);
      if (wn == 0 || gn == 0) continue;
      const auto rate = static_cast<float>(l.trust_coefficient * wn / (gn + wn * l.weight_decay + l.eps));
      for (std::int64_t i = 0; i < n; ++i) g[i] += l.weight_decay * p[i];
      for (std::int64_t i = 0; i < n; ++i) g[i] *= rate;
    }
    for (std::size_t t = 0; t < w.w.size(); ++t) {
      float* p = w.w[t].data<float>();
      const float* g = w.g[t].data<float>();
      float* b = w.buf[t].data<float>();
      const std::int64_t n = w.w[t].numel();
      for (std::int64_t i = 0; i < n; ++i) b[i] *= o.momentum;
      for (std::int64_t i = 0; i < n; ++i) b[i] += g[i];
      for (std::int64_t i = 0; i < n; ++i) p[i] -= o.lr * b[i];
    }
    benchmark::ClobberMemory();
  }
  report(state, bench::kLarcSgdBytes, w.params);
}

void BM_adamw(benchmark::State& state) {
  auto& w = workload(false, true);
  ops::AdamOptions o;
  o.decoupled_weight_decay = true;
  o.weight_decay = 0.01f;
  o.step = 10;
  for (auto _ : state) ops::adam_step<ops::Cpu>(context(), o, {w.w, w.g, w.m, w.v, {}});
  report(state, bench::kAdamBytes, w.params);
}

void BM_cast_f32_to_bf16(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  for (auto _ : state) ops::cast<ops::Cpu>(context(), w.w, w.low);
  report(state, bench::kCastBytes, w.params);
}

void BM_unscale_and_check(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context();
  auto found = sk::zeros(ctx, {1}, sk::DType::f32);
  auto sums = sk::empty(ctx, {1, static_cast<std::int64_t>(w.g.size())}, sk::DType::f64);
  for (auto _ : state) ops::unscale_and_check<ops::Cpu>(ctx, 1.0f, w.g, found, sums);
  report(state, bench::kUnscaleBytes, w.params);
}

void workloads_arg(benchmark::internal::Benchmark* b) {
  b->ArgName("flat")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

}  // namespace

BENCHMARK(BM_copy)->Apply(workloads_arg);
BENCHMARK(BM_sgd_momentum)->Apply(workloads_arg);
BENCHMARK(BM_sgd_momentum_bf16_copy)->Apply(workloads_arg);
BENCHMARK(BM_larc_sgd_fused)->Apply(workloads_arg);
BENCHMARK(BM_larc_sgd_composed)->Apply(workloads_arg);
BENCHMARK(BM_larc_sgd_unfused)->Apply(workloads_arg);
BENCHMARK(BM_adamw)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_cast_f32_to_bf16)->Apply(workloads_arg);
BENCHMARK(BM_unscale_and_check)->Apply(workloads_arg);
BENCHMARK_MAIN();
