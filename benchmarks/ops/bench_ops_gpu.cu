// Fused optimizer steps, casts, the unscale pass and the quantised gather's codes (flat buffer
// only) on the GPU over ResNet-50's 161 tensors and
// a flat 2^28-element buffer, next to the unfused LARC-SGD (per-tensor norm, scale and SGD
// launches). CUDA-event timing (manual time); pct_of_copy against cudaMemcpyAsync of the same
// bytes in this run. Part of bench_gpu (bench_gpu_main.cu).
#include "bench_common_gpu.hpp"
#include "bench_ops_common.hpp"

#include <cstdio>
#include <map>
#include <string>

#include "kernels/shardkit_cuda.cuh"

namespace sk = shardkit;
namespace ops = shardkit::ops;
namespace bench = shardkit::bench;

namespace ops_gpu {

constexpr std::int64_t kFlatElements = std::int64_t{1} << 28;

sk::Context& context() {
  static std::unique_ptr<sk::Context> ctx = sk::make_cuda_context(0, 0, 5);
  return *ctx;
}

bench::OpsWorkload& workload(bool flat, bool adam = false) {
  static std::map<int, std::unique_ptr<bench::OpsWorkload>> cache;
  const int key = (flat ? 1 : 0) + (adam ? 2 : 0);
  auto& slot = cache[key];
  if (!slot) slot = std::make_unique<bench::OpsWorkload>(context(), flat, kFlatElements, adam);
  return *slot;
}

template <class Op>
double time_on_stream(benchmark::State& state, Op&& op) {
  return bench::time_on_stream(state, context(), std::forward<Op>(op));
}

void report(benchmark::State& state, double seconds, double bytes_per_param, std::int64_t params) {
  const double bytes = bytes_per_param * static_cast<double>(params);
  bench::report_bandwidth(
      state, seconds, bytes,
      bench::device_copy_bytes_per_second(context(), static_cast<std::size_t>(bytes / 2)));
}

ops::SgdOptions sgd_options() { return bench::bench_sgd_options(); }
ops::LarcOptions larc_options() { return bench::bench_larc_options(); }

void BM_gpu_copy(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context();
  const double seconds = time_on_stream(state, [&] {
    for (std::size_t t = 0; t < w.w.size(); ++t)
      SK_CUDA_CHECK(cudaMemcpyAsync(w.buf[t].data_ptr(), w.w[t].data_ptr(), w.w[t].nbytes(),
                                    cudaMemcpyDeviceToDevice, ctx.stream()));
  });
  report(state, seconds, 8, w.params);
}

void BM_gpu_sgd_momentum(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const double seconds = time_on_stream(state, [&] {
    ops::sgd_step(context(), o, {w.w, w.g, w.buf, {}});
  });
  report(state, seconds, bench::kSgdMomentumBytes, w.params);
}

void BM_gpu_sgd_momentum_bf16_copy(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const double seconds = time_on_stream(state, [&] {
    ops::sgd_step(context(), o, {w.w, w.g, w.buf, w.low});
  });
  report(state, seconds, bench::kSgdBf16CopyBytes, w.params);
}

void BM_gpu_larc_sgd_fused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const auto l = larc_options();
  const double seconds = time_on_stream(state, [&] {
    ops::larc_sgd_step(context(), o, l, {w.w, w.g, w.buf, {}});
  });
  report(state, seconds, bench::larc_sgd_floor_bytes(state.range(0) != 0), w.params);
}

// Fused, with each param's sum of squares kept from the step before (LarcParamSquares): the
// norms pass reads only the grads, the update squares the params it writes -- 24 bytes a
// parameter moved against the row above's 28, for the same bits. (The workloads' buffers are
// aligned alike, so the update squares in place rather than in a pass of its own.)
void BM_gpu_larc_sgd_fused_kept(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const auto o = sgd_options();
  const auto l = larc_options();
  ops::LarcParamSquares squares;
  const double seconds = time_on_stream(state, [&] {
    ops::larc_sgd_step(context(), o, l, {w.w, w.g, w.buf, {}}, &squares);
  });
  report(state, seconds, bench::larc_sgd_floor_bytes(state.range(0) != 0, true), w.params);
}

// The LARC scaling as its own pass, as apex does it eagerly: g <- a·g + b·w, rewriting g.
struct ScaleGradFunctor {
  static constexpr int kDepth = 2;
  using Types = ops::TypeList<float, float>;
  static constexpr unsigned kReads = 0b11u;
  static constexpr unsigned kWrites = 0b10u;
  static constexpr int kSums = 0;
  const ops::SgdCoefficients* coefficients = nullptr;
  using Segment = ops::SgdCoefficients;
  SK_HOST_DEVICE Segment segment(std::int64_t) const { return *coefficients; }
  SK_HOST_DEVICE void operator()(float (&x)[2], const Segment& c, double (&)[1]) const {
    x[1] = c.grad * x[1] + c.param * x[0];
  }
};

// Unfused: per tensor a norm launch for w and one for g, a coefficient launch and a scale pass
// over g; then per tensor an SGD launch: what eager apex LARC + torch SGD amounts to.
void BM_gpu_larc_sgd_unfused(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context();
  const auto o = sgd_options();
  const auto l = larc_options();
  const auto n = w.w.size();
  std::vector<sk::Tensor> sums, coefficients;
  for (std::size_t t = 0; t < n; ++t) {
    sums.push_back(sk::empty(ctx, {2, 1}, sk::DType::f64));
    coefficients.push_back(sk::empty(ctx, {1, 2}, sk::DType::f32));
  }
  const std::span<const sk::Tensor> none;
  const double seconds = time_on_stream(state, [&] {
    for (std::size_t t = 0; t < n; ++t) {
      const std::span<const sk::Tensor> wt(&w.w[t], 1), gt(&w.g[t], 1);
      ops::segment_sums_of_squares(ctx, wt, none, sums[t].slice(0, 0, 1));
      ops::segment_sums_of_squares(ctx, gt, none, sums[t].slice(0, 1, 2));
      ops::larc_coefficients(ctx, l, o.lr, 1.0f, sums[t], coefficients[t]);
      ScaleGradFunctor scale;
      scale.coefficients = static_cast<const ops::SgdCoefficients*>(coefficients[t].data_ptr());
      ops::SpanList<2> span(1);
      span[0].data = {w.w[t].data_ptr(), w.g[t].data_ptr()};
      span[0].size = w.w[t].numel();
      ops::cuda::apply(ctx, scale, span);
    }
    for (std::size_t t = 0; t < n; ++t) {
      const std::span<const sk::Tensor> wt(&w.w[t], 1), gt(&w.g[t], 1), bt(&w.buf[t], 1);
      ops::sgd_step(ctx, o, {wt, gt, bt, {}});
    }
  });
  report(state, seconds, bench::larc_sgd_floor_bytes(state.range(0) != 0), w.params);
}

void BM_gpu_adamw(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0, true);
  ops::AdamOptions o;
  o.decoupled_weight_decay = true;
  o.weight_decay = 0.01f;
  o.step = 10;
  const double seconds = time_on_stream(state, [&] {
    ops::adam_step(context(), o, {w.w, w.g, w.m, w.v, {}});
  });
  report(state, seconds, bench::kAdamBytes, w.params);
}

void BM_gpu_cast_f32_to_bf16(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  const double seconds = time_on_stream(state, [&] { ops::cast(context(), w.w, w.low); });
  report(state, seconds, bench::kCastBytes, w.params);
}

void BM_gpu_unscale_and_check(benchmark::State& state) {
  auto& w = workload(state.range(0) != 0);
  auto& ctx = context();
  auto found = sk::zeros(ctx, {1}, sk::DType::f32);
  auto sums = sk::empty(ctx, {1, static_cast<std::int64_t>(w.g.size())}, sk::DType::f64);
  const double seconds =
      time_on_stream(state, [&] { ops::unscale_and_check(ctx, 1.0f, w.g, found, sums); });
  report(state, seconds, bench::kUnscaleBytes, w.params);
}

// qwZ's gather codes of the flat buffer, int8 / E4M3 / int4 (bench_ops_common.hpp).
void BM_gpu_quantize_blocks(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context();
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const sk::Tensor payload = bench::quant_payload(ctx, w.params, format);
  const double seconds = time_on_stream(
      state, [&] { ops::quantize_blocks(ctx, format, w.w[0], ops::kDefaultQuantBlock, payload); });
  report(state, seconds, bench::quant_bytes_per_value(format), w.params);
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

void BM_gpu_dequantize_blocks(benchmark::State& state) {
  auto& w = workload(true);
  auto& ctx = context();
  const ops::QuantFormat format = bench::bench_quant_format(state.range(0));
  const sk::Tensor payload = bench::quant_payload(ctx, w.params, format);
  ops::quantize_blocks(ctx, format, w.w[0], ops::kDefaultQuantBlock, payload);
  const double seconds = time_on_stream(state, [&] {
    ops::dequantize_blocks(ctx, format, payload, ops::kDefaultQuantBlock, w.buf[0]);
  });
  report(state, seconds, bench::quant_bytes_per_value(format), w.params);
  state.SetLabel(std::string(ops::quant_format_name(format)));
}

void formats_arg(benchmark::internal::Benchmark* b) {
  b->ArgName("format")
      ->DenseRange(0, bench::kQuantFormats - 1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

void workloads_arg(benchmark::internal::Benchmark* b) {
  b->ArgName("flat")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_gpu_copy)->Apply(workloads_arg);
BENCHMARK(BM_gpu_sgd_momentum)->Apply(workloads_arg);
BENCHMARK(BM_gpu_sgd_momentum_bf16_copy)->Apply(workloads_arg);
BENCHMARK(BM_gpu_larc_sgd_fused)->Apply(workloads_arg);
BENCHMARK(BM_gpu_larc_sgd_fused_kept)->Apply(workloads_arg);
BENCHMARK(BM_gpu_larc_sgd_unfused)->Apply(workloads_arg);
BENCHMARK(BM_gpu_adamw)->Apply(workloads_arg);
BENCHMARK(BM_gpu_cast_f32_to_bf16)->Apply(workloads_arg);
BENCHMARK(BM_gpu_unscale_and_check)->Apply(workloads_arg);
BENCHMARK(BM_gpu_quantize_blocks)->Apply(formats_arg);
BENCHMARK(BM_gpu_dequantize_blocks)->Apply(formats_arg);

}  // namespace ops_gpu
