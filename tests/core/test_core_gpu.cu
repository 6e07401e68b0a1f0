// Core layer on a CUDA GPU: kernels against the CPU path (fill, strided and casting copies, add_,
// divide_, Philox uniform and normal fills bit-equal to the CPU), host<->device
// copies, device memory accounting, and the device-side f16/bf16 conversions against the host ones
// on all 65 536 patterns.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/shardkit_cuda.cuh"

namespace sk = shardkit;

// Box-Muller's log and cos are box_muller.hpp's on both sides (libm's and CUDA's differ in the
// last bit now and then: on an H100, 2026-11-25, about 15% of one dtype's normals did), and every
// product that meets a sum is an explicit fma, so the normals too are the same bits.
TEST_CASE("Philox fills on the GPU equal the CPU's bit for bit, uniform and normal") {
  for (auto dtype : {sk::DType::f32, sk::DType::f64, sk::DType::f16, sk::DType::bf16}) {
    CAPTURE(sk::dtype_name(dtype));
    sk::Context cpu({.seed = 77});
    auto gpu = sk::make_cuda_context(0, 0, 77);
    const sk::Shape shape{37, 1001};  // not a multiple of 4: exercises the block tails
    auto on_cpu = sk::empty(cpu, shape, dtype);
    auto on_gpu = sk::empty(*gpu, shape, dtype);
    sk::uniform_(cpu, on_cpu, -0.3, 0.7);
    sk::uniform_(*gpu, on_gpu, -0.3, 0.7);
    auto host_copy = sk::to_device(*gpu, on_gpu, sk::Device::cpu());
    CHECK(std::memcmp(host_copy.data_ptr(), on_cpu.data_ptr(), on_cpu.nbytes()) == 0);

    sk::normal_(cpu, on_cpu, 0.5, 2.0);
    sk::normal_(*gpu, on_gpu, 0.5, 2.0);
    auto a = sk::to_vector<double>(cpu, sk::cast(cpu, on_cpu, sk::DType::f64));
    auto b = sk::to_vector<double>(*gpu, sk::cast(*gpu, on_gpu, sk::DType::f64));
    int differing = 0;
    for (std::size_t i = 0; i < a.size(); ++i) differing += a[i] != b[i];
    CHECK(differing == 0);
  }
}

// A range of a fill made alone (a rank's shard of a deferred parameter): the GPU's per-element
// kernel reads from_element's skip through value_at; the CPU's does its head element by element.
TEST_CASE("a fill's range made alone on the GPU equals the CPU whole fill's elements") {
  for (const auto kind : {sk::RandomKind::uniform, sk::RandomKind::normal}) {
    sk::Context cpu({.seed = 3});
    auto gpu = sk::make_cuda_context(0, 0, 3);
    const sk::RandomSpec spec{kind, -0.5, 1.5, 99, 777};
    auto whole = sk::empty(cpu, {10007}, sk::DType::f32);
    sk::detail::tensor_kernels_for(cpu, whole).random(cpu, whole, spec);
    const auto expected = sk::to_vector<float>(cpu, whole);
    for (const std::int64_t first : {0, 1, 3, 4097}) {
      CAPTURE(first);
      auto part = sk::empty(*gpu, {5003}, sk::DType::f32);
      sk::detail::tensor_kernels_for(*gpu, part)
          .random(*gpu, part, spec.from_element(static_cast<std::uint64_t>(first)));
      const auto got = sk::to_vector<float>(*gpu, part);
      CHECK(std::memcmp(got.data(), expected.data() + first, got.size() * sizeof(float)) == 0);
    }
  }
}

// The GPU's kernel draws a block per thread and writes its elements through the view's strides:
// a strided view (a transposed slice) starting mid-block gets the CPU's bits, every kind.
TEST_CASE("a strided view's fill on the GPU equals the CPU's, from mid-block") {
  for (const auto kind :
       {sk::RandomKind::uniform, sk::RandomKind::normal, sk::RandomKind::keep_mask}) {
    CAPTURE(static_cast<int>(kind));
    sk::Context cpu({.seed = 4});
    auto gpu = sk::make_cuda_context(0, 0, 4);
    const sk::RandomSpec spec = sk::RandomSpec{kind, 0.25, 1.5, 1234, 55}.from_element(3);
    auto on_cpu = sk::zeros(cpu, {61, 29}, sk::DType::bf16);
    auto on_gpu = sk::zeros(*gpu, {61, 29}, sk::DType::bf16);
    const auto cpu_view = on_cpu.slice(0, 1, 60, 2).transpose(0, 1);
    const auto gpu_view = on_gpu.slice(0, 1, 60, 2).transpose(0, 1);
    sk::detail::tensor_kernels_for(cpu, cpu_view).random(cpu, cpu_view, spec);
    sk::detail::tensor_kernels_for(*gpu, gpu_view).random(*gpu, gpu_view, spec);
    auto host_copy = sk::to_device(*gpu, on_gpu, sk::Device::cpu());
    CHECK(std::memcmp(host_copy.data_ptr(), on_cpu.data_ptr(), on_cpu.nbytes()) == 0);
  }
}

TEST_CASE("add_ on the GPU equals the CPU path bit for bit (strided, converting)") {
  sk::Context cpu({.seed = 5});
  auto gpu = sk::make_cuda_context(0);
  for (auto dtype : {sk::DType::f32, sk::DType::f16, sk::DType::bf16}) {
    auto dst = sk::empty(cpu, {33, 65}, sk::DType::f32);
    auto src = sk::empty(cpu, {65, 33}, dtype);
    sk::normal_(cpu, dst, 0.0, 1.0);
    sk::normal_(cpu, src, 0.0, 1.0);
    auto dst_gpu = sk::to_device(*gpu, dst, gpu->device());
    auto src_gpu = sk::to_device(*gpu, src, gpu->device());
    sk::add_(cpu, dst, src.transpose(0, 1));
    sk::add_(*gpu, dst_gpu, src_gpu.transpose(0, 1));
    auto back = sk::to_device(*gpu, dst_gpu, sk::Device::cpu());
    CHECK_MESSAGE(std::memcmp(back.data_ptr(), dst.data_ptr(), dst.nbytes()) == 0,
                  sk::dtype_name(dtype));
  }
}

// Overlapping views read the source as it was (memmove's semantics) on the device too: its
// kernels visit the elements in no order and cudaMemcpy of overlapping ranges is undefined.
TEST_CASE("copy and add_ between overlapping views on the GPU equal the CPU's") {
  sk::Context cpu({.seed = 6});
  auto gpu = sk::make_cuda_context(0);
  const std::int64_t n = 1 << 20;
  auto table = sk::empty(cpu, {n + 1, 2}, sk::DType::f32);
  sk::uniform_(cpu, table, -1, 1);
  auto on_gpu = sk::to_device(*gpu, table, gpu->device());
  for (sk::Context* ctx : {&cpu, gpu.get()}) {
    const sk::Tensor t = ctx == &cpu ? table : on_gpu;
    sk::copy(*ctx, t.slice(0, 1, n + 1).select(1, 0), t.slice(0, 0, n).select(1, 0));
    const sk::Tensor flat = t.view({2 * n + 2});
    sk::copy(*ctx, flat.slice(0, 7, 2 * n + 2), flat.slice(0, 0, 2 * n - 5));  // contiguous
    sk::add_(*ctx, flat.slice(0, 1, 2 * n + 2), flat.slice(0, 0, 2 * n + 1));
  }
  const auto back = sk::to_device(*gpu, on_gpu, sk::Device::cpu());
  CHECK(std::memcmp(back.data_ptr(), table.data_ptr(), table.nbytes()) == 0);
}

TEST_CASE("divide_ on the GPU equals the CPU path bit for bit (strided, 16-bit)") {
  sk::Context cpu({.seed = 6});
  auto gpu = sk::make_cuda_context(0);
  for (auto dtype : {sk::DType::f32, sk::DType::f64, sk::DType::f16, sk::DType::bf16}) {
    auto values = sk::empty(cpu, {65, 33}, dtype);
    sk::normal_(cpu, values, 0.0, 1.0);
    auto on_gpu = sk::to_device(*gpu, values, gpu->device());
    sk::divide_(cpu, values.transpose(0, 1), 6.0);
    sk::divide_(*gpu, on_gpu.transpose(0, 1), 6.0);
    auto back = sk::to_device(*gpu, on_gpu, sk::Device::cpu());
    CHECK_MESSAGE(std::memcmp(back.data_ptr(), values.data_ptr(), values.nbytes()) == 0,
                  sk::dtype_name(dtype));
  }
}

TEST_CASE("fill, strided copy and casting copy on the GPU equal the CPU path") {
  sk::Context cpu({.seed = 3});
  auto gpu = sk::make_cuda_context(0);
  auto source = sk::empty(cpu, {5, 6, 7}, sk::DType::f32);
  sk::normal_(cpu, source, 0.0, 10.0);
  auto on_gpu = sk::to_device(*gpu, source, gpu->device());
  CHECK(on_gpu.device() == sk::Device::cuda(0));
  for (auto dtype : sk::kAllDTypes) {
    // A transposed slice, copied with conversion on the device, against the same on the host.
    auto view_gpu = on_gpu.slice(1, 1, 5).transpose(0, 2);
    auto view_cpu = source.slice(1, 1, 5).transpose(0, 2);
    auto converted_gpu = sk::cast(*gpu, view_gpu, dtype);
    auto converted_cpu = sk::cast(cpu, view_cpu, dtype);
    auto back = sk::to_device(*gpu, converted_gpu, sk::Device::cpu());
    CHECK_MESSAGE(std::memcmp(back.data_ptr(), converted_cpu.data_ptr(), back.nbytes()) == 0,
                  sk::dtype_name(dtype));
  }
  sk::fill(*gpu, on_gpu.select(2, 3), -1.25);
  sk::fill(cpu, source.select(2, 3), -1.25);
  CHECK(sk::to_vector<float>(*gpu, on_gpu) == sk::to_vector<float>(cpu, source));
  // Host <-> device copies where either side is non-contiguous.
  auto strided_host = sk::empty(cpu, {7, 6, 5}, sk::DType::f32).transpose(0, 2);
  sk::copy(*gpu, strided_host, on_gpu);
  CHECK(sk::to_vector<float>(cpu, strided_host) == sk::to_vector<float>(cpu, source));
  auto strided_device = sk::empty(*gpu, {7, 6, 5}, sk::DType::f32).transpose(0, 2);
  sk::copy(*gpu, strided_device, source);
  CHECK(sk::to_vector<float>(*gpu, strided_device) == sk::to_vector<float>(cpu, source));
}

TEST_CASE("device allocations are counted per category with peaks") {
  auto gpu = sk::make_cuda_context(0);
  auto& stats = gpu->memory_stats();
  {
    auto params = sk::empty(*gpu, {1 << 20}, sk::DType::f32, sk::MemoryCategory::parameters);
    auto state = sk::empty(*gpu, {1 << 21}, sk::DType::f32, sk::MemoryCategory::optimizer_state);
    CHECK(stats.current(sk::MemoryCategory::parameters) == 4 << 20);
    CHECK(stats.current(sk::MemoryCategory::optimizer_state) == 8 << 20);
    CHECK(stats.peak_total() == 12 << 20);
  }
  CHECK(stats.current_total() == 0);
  CHECK(stats.peak_total() == 12 << 20);
  stats.reset_peak();
  CHECK(stats.peak_total() == 0);
  // A failed allocation reports OutOfMemory, not a CUDA error, and leaves the counters alone.
  CHECK_THROWS_AS(sk::empty(*gpu, {std::int64_t{1} << 50}, sk::DType::f32), sk::OutOfMemory);
  CHECK(stats.current_total() == 0);
}

namespace {

__global__ void convert_all_patterns(std::uint16_t* ours_half, std::uint16_t* hw_half,
                                     std::uint16_t* ours_bf16, std::uint16_t* hw_bf16,
                                     float* half_to_f32, const float* inputs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inputs[i];
  ours_half[i] = sk::float_to_half_bits(x);
  hw_half[i] = __half_as_ushort(__float2half_rn(x));
  ours_bf16[i] = sk::float_to_bf16_bits(x);
  hw_bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  if (i < 65536) half_to_f32[i] = sk::half_bits_to_float(static_cast<std::uint16_t>(i));
}

}  // namespace

TEST_CASE("device f16/bf16 conversions equal the host ones and the hardware's") {
  // Inputs: every half value, every bf16 value, and 2^20 random floats.
  std::vector<float> inputs;
  for (std::uint32_t b = 0; b < 65536; ++b)
    inputs.push_back(sk::half_bits_to_float(static_cast<std::uint16_t>(b)));
  for (std::uint32_t b = 0; b < 65536; ++b)
    inputs.push_back(sk::bf16_bits_to_float(static_cast<std::uint16_t>(b)));
  sk::Context cpu({.seed = 8});
  auto noise = sk::empty(cpu, {1 << 20}, sk::DType::f32);
  sk::normal_(cpu, noise, 0.0, 1e4);
  for (float v : sk::to_vector<float>(cpu, noise)) inputs.push_back(v);
  const int n = static_cast<int>(inputs.size());

  auto gpu = sk::make_cuda_context(0);
  auto d_inputs = sk::from_vector(*gpu, inputs, {n});
  std::uint16_t *ours_half, *hw_half, *ours_bf16, *hw_bf16;
  float* half_to_f32;
  SK_CUDA_CHECK(cudaMalloc(&ours_half, n * 2));
  SK_CUDA_CHECK(cudaMalloc(&hw_half, n * 2));
  SK_CUDA_CHECK(cudaMalloc(&ours_bf16, n * 2));
  SK_CUDA_CHECK(cudaMalloc(&hw_bf16, n * 2));
  SK_CUDA_CHECK(cudaMalloc(&half_to_f32, 65536 * 4));
  convert_all_patterns<<<(n + 255) / 256, 256, 0, gpu->stream()>>>(
      ours_half, hw_half, ours_bf16, hw_bf16, half_to_f32, d_inputs.data<float>(), n);
  SK_CUDA_CHECK_LAUNCH("convert_all_patterns");
  gpu->synchronize();
  std::vector<std::uint16_t> h_ours_half(n), h_hw_half(n), h_ours_bf16(n), h_hw_bf16(n);
  std::vector<float> h_half_to_f32(65536);
  SK_CUDA_CHECK(cudaMemcpy(h_ours_half.data(), ours_half, n * 2, cudaMemcpyDeviceToHost));
  SK_CUDA_CHECK(cudaMemcpy(h_hw_half.data(), hw_half, n * 2, cudaMemcpyDeviceToHost));
  SK_CUDA_CHECK(cudaMemcpy(h_ours_bf16.data(), ours_bf16, n * 2, cudaMemcpyDeviceToHost));
  SK_CUDA_CHECK(cudaMemcpy(h_hw_bf16.data(), hw_bf16, n * 2, cudaMemcpyDeviceToHost));
  SK_CUDA_CHECK(cudaMemcpy(h_half_to_f32.data(), half_to_f32, 65536 * 4, cudaMemcpyDeviceToHost));
  for (void* p :
       {static_cast<void*>(ours_half), static_cast<void*>(hw_half), static_cast<void*>(ours_bf16),
        static_cast<void*>(hw_bf16), static_cast<void*>(half_to_f32)})
    SK_CUDA_CHECK(cudaFree(p));

  for (int i = 0; i < n; ++i) {
    const float x = inputs[static_cast<std::size_t>(i)];
    REQUIRE(h_ours_half[i] == sk::float_to_half_bits(x));
    REQUIRE(h_ours_bf16[i] == sk::float_to_bf16_bits(x));
    if (std::isnan(x)) continue;  // NaN payloads are implementation-defined in hardware
    REQUIRE(h_hw_half[i] == h_ours_half[i]);
    REQUIRE(h_hw_bf16[i] == h_ours_bf16[i]);
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float host = sk::half_bits_to_float(static_cast<std::uint16_t>(b));
    REQUIRE(std::memcmp(&host, &h_half_to_f32[b], 4) == 0);
  }
}

// A StepGraph on the GPU: the capture runs nothing, its graph's launches do -- on the input as
// refilled before each step (outside it), into the memory the capture gave its outputs.
TEST_CASE("a step graph on the GPU replays the captured kernels on refilled inputs") {
  auto gpu = sk::make_cuda_context(0, 0, 1);
  auto& ctx = *gpu;
  constexpr std::int64_t kN = 4099;
  const auto x = sk::zeros(ctx, {kN}, sk::DType::f32);
  const auto sum = sk::zeros(ctx, {kN}, sk::DType::f64);
  sk::Tensor out;
  sk::StepGraph graph(ctx, "gpu", {.warmup_steps = 1});
  const auto step = [&] {
    const auto wide = sk::cast(ctx, x, sk::DType::f64);  // a temporary: the pool's
    sk::add_(ctx, sum, wide);
    out = sk::clone(ctx, wide);
  };
  std::vector<sk::StepRun> runs;
  double expected = 0;
  for (int s = 1; s <= 5; ++s) {
    sk::fill(ctx, x, s);
    runs.push_back(graph.run("k", step));
    expected += s;
    CHECK(sk::to_vector<double>(ctx, out) == std::vector<double>(kN, s));
  }
  using sk::StepRun;
  CHECK(runs == std::vector<StepRun>{StepRun::eager, StepRun::captured, StepRun::replayed,
                                     StepRun::replayed, StepRun::replayed});
  CHECK(sk::to_vector<double>(ctx, sum) == std::vector<double>(kN, expected));
  CHECK(graph.reserved_bytes() >= 2 * kN * 8);
  const auto current = ctx.memory_stats().current_total();
  graph.clear();  // `out` still lives in the retired pool's block
  CHECK(ctx.memory_stats().current_total() == current);
  CHECK(sk::to_vector<double>(ctx, out) == std::vector<double>(kN, 5.0));
  out = sk::Tensor();
  CHECK(ctx.memory_stats().current_total() == current - kN * 8);

  // A refusal ends the stream's capture: the stream and context work on.
  sk::StepGraph refusing(ctx, "gpu", {.warmup_steps = 0});
  CHECK_THROWS_AS(refusing.run("k", [&] { (void)sk::to_vector<float>(ctx, x); }),
                  sk::CaptureRefused);
  CHECK_FALSE(ctx.capturing());
  sk::fill(ctx, x, 7.0);
  CHECK(sk::to_vector<float>(ctx, x) == std::vector<float>(kN, 7.0f));
}
