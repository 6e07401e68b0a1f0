// The step-time cost of CPU offload (parallel/offload.hpp), written once for both backends:
// bench_offload.cpp (the CPU path) and bench_offload_gpu.cu (a GPU, in bench_gpu) run it.
//
// One rank holds ResNet-50's 161 tensors whole (DDP at world size 1: the case offload is for, a
// model whose optimizer state does not fit beside it), with gradients already reduced; each
// iteration is one optimizer step, offloaded (gradients down, the fused update on the host's
// threads, parameters up) and, timed in the same run, the same step without offload on the
// device. Reported:
//
//   GBps, pct_of_copy  the bytes the offloaded step must move in host memory per second --
//                      the fused update's floor (update_bytes per parameter) plus the
//                      gradients arriving and the parameters leaving (once each beside a GPU,
//                      where the other side is device memory; twice on the CPU path, where
//                      both sides are RAM) -- against a memcpy on the same threads measured
//                      just before: the offloaded optimizer's throughput
//   ms_per_step        the offloaded step
//   plain_ms, cost     the step without offload and offload's factor over it
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <shardkit/comm/local_communicator.hpp>
#include <shardkit/parallel/data_parallel.hpp>
#include "bench_common.hpp"
#include "workloads/resnet50_params.hpp"

namespace shardkit::bench::offload_step {

// Floor bytes per parameter of the host update. AdamW: read w, g, m, v, write w, m, v (f32),
// or under bf16 read g and write the compute copy in 2 bytes each (4 + 2 + 8 + 4 + 8 + 2).
// LARC-SGD with momentum: read w, g, buf, write w, buf (the norms re-read w and g from cache);
// bf16 likewise with 2-byte g and copy: the same totals.
inline double update_bytes(optim::OptimizerKind kind) { return optim::is_adam(kind) ? 28 : 20; }

inline std::vector<shard::ParamSpec> resnet50_specs() {
  std::vector<shard::ParamSpec> specs;
  int i = 0;
  for (const auto& s : workloads::kResNet50Shapes)
    specs.push_back({std::string("p").append(std::to_string(i++)), s.shape()});
  return specs;
}

inline optim::OptimizerConfig optimizer_config(optim::OptimizerKind kind) {
  optim::OptimizerConfig c;
  c.kind = kind;
  c.sgd.momentum = 0.9f;
  c.larc.trust_coefficient = 0.001f;
  c.larc.clip = false;
  c.larc.weight_decay = 1e-6f;
  c.adam.weight_decay = 0.01f;
  return c;
}

// A one-rank engine over ResNet-50 with random parameters and reduced random gradients.
struct Engine {
  std::unique_ptr<comm::LocalCommunicator> comm;
  std::unique_ptr<parallel::DataParallel> dp;

  Engine(Context& ctx, optim::OptimizerKind kind, DType precision, bool offload)
      : Engine(ctx, kind, precision, parallel::OffloadOptions{.optimizer = offload}) {}
  Engine(Context& ctx, optim::OptimizerKind kind, DType precision,
         const parallel::OffloadOptions& offload) {
    comm = comm::LocalCommunicator::single(ctx);
    parallel::ParallelOptions o;
    o.stage = parallel::Stage::ddp;
    o.precision = parallel::MixedPrecision::of(precision);
    o.offload = offload;
    o.buckets.bucket_bytes = std::size_t{25} << 20;
    const auto specs = resnet50_specs();
    dp = std::make_unique<parallel::DataParallel>(ctx, *comm, specs, optimizer_config(kind), o);
    dp->set_full_params([&](std::size_t, const Tensor& view) { uniform_(ctx, view, 1.0, 2.0); });
    for (std::size_t i = specs.size(); i-- > 0;) {
      const Tensor g = dp->grad(i);
      Tensor wide = empty(ctx, g.shape(), DType::f32);
      uniform_(ctx, wide, 0.5, 1.5);
      copy(ctx, g, wide);
      dp->ready(i);
    }
    dp->finish();
  }
  void step() { dp->step(1e-4f); }
};

// Median seconds of `repeats` calls of `fn` after one warm-up; `sync` waits for the device.
template <class Fn, class Sync>
double median_seconds(int repeats, Fn&& fn, Sync&& sync) {
  fn();
  sync();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    sync();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// The benchmark body: `ctx` is the device's context (its cpu_threads are the host's threads);
// `host_sides` is how many sides of each transfer are host memory (1 beside a GPU, 2 on the
// CPU path).
template <class Sync>
void run(benchmark::State& state, Context& ctx, optim::OptimizerKind kind, DType precision,
         int host_sides, Sync&& sync) {
  const double params = static_cast<double>(workloads::kResNet50Params);
  const double moved = static_cast<double>(dtype_size(precision));  // gradients down, params up
  const double bytes = (update_bytes(kind) + host_sides * 2 * moved) * params;
  double plain = 0;
  {
    Engine device(ctx, kind, precision, false);
    plain = median_seconds(
        5, [&] { device.step(); }, sync);
  }
  Engine offloaded(ctx, kind, precision, true);
  const double ceiling =
      host_copy_bytes_per_second(static_cast<std::size_t>(bytes / 2), ctx.cpu_threads());
  offloaded.step();
  sync();
  LoopClock clock;
  for (auto _ : state) {
    offloaded.step();
    sync();
  }
  const double seconds = clock.seconds_per_iteration(state);
  report_bandwidth(state, seconds, bytes, ceiling);
  state.counters["plain_ms"] = plain * 1e3;
  state.counters["cost"] = seconds / plain;
}

}  // namespace shardkit::bench::offload_step
