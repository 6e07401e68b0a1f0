// Fused optimizer steps, LARC's norms pass alone, casts, the unscale pass and the quantised
// gather's codes (qwZ's int8, E4M3 and int4 blocks of a flat buffer; per-tensor scales) on the
// CPU over ResNet-50's 161 tensors and a flat buffer of 2^26 elements (2^28 would need 4 GiB per
// operand here), on 1 thread and on every hardware thread (SHARDKIT_NUM_THREADS), next to the
// unfused LARC-SGD users run today (one thread). GBps = minimum bytes / time; pct_of_copy against
// a memcpy on the same number of threads, measured just before each benchmark. benchmarks/run
// runs this with repetitions beside PyTorch's LARC + SGD (torch_larc_sgd.py) and tabulates both.
#include "bench_common.hpp"
#include "bench_ops_common.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <shardkit/ops/ops.hpp>

namespace sk = shardkit;
namespace ops = shardkit::ops;
namespace bench = shardkit::bench;

namespace {

constexpr std::int64_t kFlatElements = std::int64_t{1} << 26;

bench::OpsWorkload& workload(bool flat, bool adam = false) {
  static sk::Context ctx({.seed = 11});
  static std::map<int, std::unique_ptr<bench::OpsWorkload>> cache;
  auto& slot = cache[(flat ? 1 : 0) + (adam ? 2 : 0)];
  if (!slot) slot = std::make_unique<bench::OpsWorkload>(ctx, flat, kFlatElements, adam);
  return *slot;
}

// One context per thread count, so each benchmark runs on the threads its name says.
sk::Context& context(int threads) {
  static std::map<int, std::unique_ptr<sk::Context>> cache;
  auto& slot = cache[threads];
  if (!slot) slot = std::make_unique<sk::Context>(sk::ContextOptions{.cpu_threads = threads});
  return *slot;
}

int threads_of(const benchmark::State& state) { return static_cast<int>(state.range(1)); }

// Runs `step` as the benchmark loop and reports against a copy on the same threads.
template <class Step>
void run(benchmark::State& state, double bytes_per_param, std::int64_t params, Step&& step) {
  const double bytes = bytes_per_param * static_cast<double>(params);
  const double ceiling =
      bench::host_copy_bytes_per_second(static_cast<std::size_t>(bytes / 2), threads_of(state));
  step();  // warm-up
  bench::LoopClock clock;
  for (auto _ : state) {
    step();
    benchmark::ClobberMemory();
  }
  bench::report_bandwidth(state, clock.seconds_per_iteration(state), bytes, ceiling);
}

ops::SgdOptions sgd_options() { return bench::bench_sgd_options(); }
ops::LarcOptions larc_options() { return bench::bench_larc_options(); }

void BM_sgd_momentum(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  const auto o = sgd_options();
  run(state, bench::kSgdMomentumBytes, w.params, [&] {
    ops::sgd_step(ctx, o, {w.w, w.g, w.buf, {}});
  });
}

void BM_sgd_momentum_bf16_copy(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  const auto o = sgd_options();
  run(state, bench::kSgdBf16CopyBytes, w.params, [&] {
    ops::sgd_step(ctx, o, {w.w, w.g, w.buf, w.low});
  });
}

// Fused: norms, coefficients and update per L2-sized batch of tensors.
void BM_larc_sgd_fused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  const auto o = sgd_options();
  const auto l = larc_options();
  run(state, bench::larc_sgd_floor_bytes(state.range(0) != 0), w.params, [&] {
    ops::larc_sgd_step(ctx, o, l, {w.w, w.g, w.buf, {}});
  });
}

// Fused, with each param's sum of squares kept from the step before (LarcParamSquares): the
// norms pass reads only the grads, the update squares what it writes. The bits are those of the
// row above; a training loop that calls larc_sgd_step each step gets this one.
void BM_larc_sgd_fused_kept(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  const auto o = sgd_options();
  const auto l = larc_options();
  ops::LarcParamSquares squares;
  run(state, bench::larc_sgd_floor_bytes(state.range(0) != 0, true), w.params, [&] {
    ops::larc_sgd_step(ctx, o, l, {w.w, w.g, w.buf, {}}, &squares);
  });
}

// Composed, as sharded training runs it: all norms (partials), coefficients, then the update.
void BM_larc_sgd_composed(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  const auto o = sgd_options();
  const auto l = larc_options();
  const auto n = static_cast<std::int64_t>(w.w.size());
  auto sums = sk::empty(ctx, {2, n}, sk::DType::f64);
  auto coefficients = sk::empty(ctx, {n, 2}, sk::DType::f32);
  run(state, bench::larc_sgd_floor_bytes(state.range(0) != 0), w.params, [&] {
    ops::segment_sums_of_squares(ctx, w.w, w.g, sums);
    ops::larc_coefficients(ctx, l, o.lr, 1.0f, sums, coefficients);
    ops::sgd_step(ctx, o, {w.w, w.g, w.buf, {}}, coefficients);
  });
}

// LARC's norms pass alone (the first half of the two above): a read-only pass over params and
// grads. Its % of copy is the read rate the norms reach; with the SGD row it bounds the fused
// step wherever a tensor is too large for its reads to be cached for the update.
void BM_larc_norms(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  auto sums = sk::empty(ctx, {2, static_cast<std::int64_t>(w.w.size())}, sk::DType::f64);
  run(state, bench::kNormsPairBytes, w.params,
      [&] { ops::segment_sums_of_squares(ctx, w.w, w.g, sums); });
}

// What apex LARC + torch.optim.SGD do, one pass per eager op, in plain loops on one thread:
// norm(w), norm(g), g += wd·w, g *= rate per tensor; then buf = m·buf + g, w -= lr·buf.
void BM_larc_sgd_unfused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const auto l = larc_options();
  run(state, bench::larc_sgd_floor_bytes(state.range(0) != 0), w.params, [&] {
    for (std::size_t t = 0; t < w.w.size(); ++t) {
      float* p = w.w[t].data<float>();
      float* g = w.g[t].data<float>();
      const std::int64_t n = w.w[t].numel();
      double wsq = 0, gsq = 0;
      for (std::int64_t i = 0; i < n; ++i) wsq += static_cast<double>(p[i]) * p[i];
      for (std::int64_t i = 0; i < n; ++i) gsq += static_cast<double>(g[i]) * g[i];
      const double wn = std::sqrt(wsq), gn = std::sqrt(gsq);
      if (wn == 0 || gn == 0) continue;
      const auto rate =
          static_cast<float>(l.trust_coefficient * wn / (gn + wn * l.weight_decay + l.eps));
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
  });
}

void BM_adamw(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0, true);
  auto& ctx = context(threads_of(state));
  ops::AdamOptions o;
  o.decoupled_weight_decay = true;
  o.weight_decay = 0.01f;
  o.step = 10;
  run(state, bench::kAdamBytes, w.params, [&] {
    ops::adam_step(ctx, o, {w.w, w.g, w.m, w.v, {}});
  });
}

void BM_cast_f32_to_bf16(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  run(state, bench::kCastBytes, w.params, [&] { ops::cast(ctx, w.w, w.low); });
}

// f16 goes through branch-free integer conversions (core/float16.hpp) the compiler vectorises.
void BM_cast_f32_to_f16(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  run(state, bench::kCastBytes, w.params, [&] { ops::cast(ctx, w.w, w.half); });
}

void BM_cast_f16_to_f32(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  run(state, bench::kCastBytes, w.params, [&] { ops::cast(ctx, w.half, w.buf); });
}

void BM_unscale_and_check(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context(threads_of(state));
  auto found = sk::zeros(ctx, {1}, sk::DType::f32);
  auto sums = sk::empty(ctx, {1, static_cast<std::int64_t>(w.g.size())}, sk::DType::f64);
  run(state, bench::kUnscaleBytes, w.params,
      [&] { ops::unscale_and_check(ctx, 1.0f, w.g, found, sums); });
}

// qwZ's gather codes of one flat buffer (2^26 f32 values), int8 / E4M3 / int4: what quantising
// before the all-gather and dequantising after it cost against a copy of the same bytes.
void BM_quantize_blocks(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context(threads_of(state));
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const sk::Tensor payload = bench::quant_payload(ctx, w.params, format);
  run(state, bench::quant_bytes_per_value(format), w.params,
      [&] { ops::quantize_blocks(ctx, format, w.w[0], ops::kDefaultQuantBlock, payload); });
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

void BM_dequantize_blocks(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context(threads_of(state));
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const sk::Tensor payload = bench::quant_payload(ctx, w.params, format);
  ops::quantize_blocks(ctx, format, w.w[0], ops::kDefaultQuantBlock, payload);
  run(state, bench::quant_bytes_per_value(format), w.params,
      [&] { ops::dequantize_blocks(ctx, format, payload, ops::kDefaultQuantBlock, w.buf[0]); });
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

// The per-tensor scales (FSDP2's float8 gather, QuantScale::tensor) over the same flat buffer
// cut into ResNet-50's tensors one after another, repeated to fill it: each tensor a slot.
struct SlotTables {
  sk::Tensor chunks, amax, codes;
};
const SlotTables& slot_tables() {
  static const SlotTables tables = [] {
    auto& w = workload(true);
    sk::Context& ctx = context(1);
    std::vector<ops::SlotRange> ranges;
    std::int64_t at = 0, slot = 0;
    while (at < w.params)
      for (const auto& s : sk::workloads::kResNet50Shapes) {
        const std::int64_t n = std::min(sk::shape_numel(s.shape()), w.params - at);
        if (n == 0) break;
        ranges.push_back({at, at + n, slot++});
        at += n;
      }
    const std::vector<std::int64_t> rows = ops::slot_chunks(ranges, 0, w.params);
    SlotTables t;
    t.chunks = sk::from_vector(ctx, rows, {static_cast<std::int64_t>(rows.size() / 3), 3});
    t.amax = sk::zeros(ctx, {slot}, sk::DType::f32);
    t.codes = sk::empty(ctx, {w.params}, sk::DType::u8);
    return t;
  }();
  return tables;
}

// Quantising per tensor: the slots' maxima (a pass of its own: across ranks they are
// all-reduced before any code is formed, so the values are read twice -- 9 bytes per value:
// two reads of the f32 value and the code), then the codes. Format 0 int8, 1 E4M3.
void BM_quantize_by_slots(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context(threads_of(state));
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const SlotTables& t = slot_tables();
  run(state, 9.0, w.params, [&] {
    ops::slot_abs_max(ctx, w.w[0], t.chunks, t.amax);
    ops::quantize_by_slots(ctx, format, w.w[0], t.chunks, t.amax, t.codes);
  });
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

void BM_dequantize_by_slots(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context(threads_of(state));
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const SlotTables& t = slot_tables();
  ops::slot_abs_max(ctx, w.w[0], t.chunks, t.amax);
  ops::quantize_by_slots(ctx, format, w.w[0], t.chunks, t.amax, t.codes);
  run(state, 5.0, w.params,
      [&] { ops::dequantize_by_slots(ctx, format, t.codes, t.chunks, t.amax, w.buf[0]); });
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

// {format: 0 int8, 1 E4M3, 2 int4; the first `Formats`} x {threads: 1, every hardware thread}.
// The per-tensor scales take the byte formats only (Formats = 2).
template <std::int64_t Formats = bench::kQuantFormats>
void formats_and_threads(benchmark::internal::Benchmark* b) {
  const int all = sk::default_cpu_threads();
  b->ArgNames({"format", "threads"});
  for (std::int64_t format = 0; format < Formats; ++format) {
    b->Args({format, 1});
    if (all > 1) b->Args({format, all});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

// {flat: 0 ResNet-50's tensors, 1 one flat buffer} x {threads: 1, every hardware thread}.
void workloads_and_threads(benchmark::internal::Benchmark* b) {
  const int all = sk::default_cpu_threads();
  b->ArgNames({"flat", "threads"});
  for (int flat : {0, 1}) {
    b->Args({flat, 1});
    if (all > 1) b->Args({flat, all});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

void resnet50_and_threads(benchmark::internal::Benchmark* b) {
  const int all = sk::default_cpu_threads();
  b->ArgNames({"flat", "threads"})->Args({0, 1});
  if (all > 1) b->Args({0, all});
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

}  // namespace

BENCHMARK(BM_sgd_momentum)->Apply(workloads_and_threads);
BENCHMARK(BM_sgd_momentum_bf16_copy)->Apply(workloads_and_threads);
BENCHMARK(BM_larc_sgd_fused)->Apply(workloads_and_threads);
BENCHMARK(BM_larc_sgd_fused_kept)->Apply(workloads_and_threads);
BENCHMARK(BM_larc_sgd_composed)->Apply(workloads_and_threads);
BENCHMARK(BM_larc_norms)->Apply(workloads_and_threads);
BENCHMARK(BM_larc_sgd_unfused)
    ->ArgNames({"flat", "threads"})
    ->Args({0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);
BENCHMARK(BM_adamw)->Apply(resnet50_and_threads);
BENCHMARK(BM_cast_f32_to_bf16)->Apply(workloads_and_threads);
BENCHMARK(BM_cast_f32_to_f16)->Apply(workloads_and_threads);
BENCHMARK(BM_cast_f16_to_f32)->Apply(workloads_and_threads);
BENCHMARK(BM_unscale_and_check)->Apply(workloads_and_threads);
BENCHMARK(BM_quantize_blocks)->Apply(formats_and_threads<>);
BENCHMARK(BM_dequantize_blocks)->Apply(formats_and_threads<>);
BENCHMARK(BM_quantize_by_slots)->Apply(formats_and_threads<2>);
BENCHMARK(BM_dequantize_by_slots)->Apply(formats_and_threads<2>);
BENCHMARK_MAIN();
