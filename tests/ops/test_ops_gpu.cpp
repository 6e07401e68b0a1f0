// Fused ops on a CUDA GPU: the same cases as the CPU executable (float64 references, poisoned
// outputs, edge sizes, unaligned segments), plus GPU-against-CPU runs of the same step.
#include "cpu_backend.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace ops_test {

struct CudaBackend {
  // The host's bits: the same additions in the same order (norm_tree.hpp's leaf_sum_of_squares).
  // A square of an f32, f16 or bf16 value is exact in double, so a fused multiply-add that nvcc
  // may form rounds as the separate square and addition do.
  static constexpr double leaf_tolerance = 0;
  std::unique_ptr<sk::Context> owned = sk::make_cuda_context(0, 0, 1);
  sk::Context& ctx = *owned;

  sk::Tensor upload(const sk::Tensor& host) { return sk::to_device(ctx, host, ctx.device()); }
  sk::Tensor download(const sk::Tensor& t) { return sk::to_device(ctx, t, sk::Device::cpu()); }
  sk::Tensor zeros(sk::Shape shape, sk::DType dtype) {
    return sk::zeros(ctx, std::move(shape), dtype);
  }
  void fill(const sk::Tensor& t, double value) { sk::fill(ctx, t, value); }
};

using Backend = CudaBackend;

// The same LARC-SGD steps on both backends: parameters agree to a few f32 roundings.
TEST_CASE("LARC-SGD on the GPU equals the CPU run of the same steps") {
  CpuBackend cpu;
  CudaBackend gpu;
  const Layout layout(edge_sizes(), 1);
  const auto w0 = random_values(layout.total, 1.0, 2.0, 91);
  Flat<CpuBackend> wc(cpu, w0, layout), bc(cpu, kNaNs(w0.size()), layout);
  Flat<CudaBackend> wg(gpu, w0, layout), bg(gpu, kNaNs(w0.size()), layout);
  ops::SgdOptions o{.lr = 0.3f, .momentum = 0.9f, .nesterov = true};
  const ops::LarcOptions larc{.weight_decay = 1e-4f};
  for (int step = 0; step < 3; ++step) {
    o.first_step = step == 0;
    const auto g0 = random_values(layout.total, 0.5, 1.5, 92 + static_cast<std::uint32_t>(step));
    Flat<CpuBackend> gc(cpu, g0, layout);
    Flat<CudaBackend> gg(gpu, g0, layout);
    ops::larc_sgd_step(cpu.ctx, o, larc, ops::SgdTensors{wc.views, gc.views, bc.views, {}});
    ops::larc_sgd_step(gpu.ctx, o, larc, ops::SgdTensors{wg.views, gg.views, bg.views, {}});
    check_close(wg.values(gpu), widen(wc.values(cpu)), layout, "param (GPU vs CPU)");
    check_close(bg.values(gpu), widen(bc.values(cpu)), layout, "momentum (GPU vs CPU)");
  }
}

// AdamW's decoupled decay rounds w * (1 - lr * decay) before the update is subtracted, as
// PyTorch's mul_ then addcdiv_ and the host do; nvcc fused the two into one fma before, so the
// device's parameters left the host's in their last bits whenever the decay was on.
TEST_CASE("AdamW with decoupled decay on the GPU gives the CPU's bits") {
  CpuBackend cpu;
  CudaBackend gpu;
  const Layout layout(edge_sizes(), 1);
  const auto n = static_cast<std::size_t>(layout.total);
  const auto w0 = random_values(layout.total, 1.0, 2.0, 93);
  Flat<CpuBackend> wc(cpu, w0, layout), mc(cpu, std::vector<float>(n, 0.0f), layout),
      vc(cpu, std::vector<float>(n, 0.0f), layout);
  Flat<CudaBackend> wg(gpu, w0, layout), mg(gpu, std::vector<float>(n, 0.0f), layout),
      vg(gpu, std::vector<float>(n, 0.0f), layout);
  ops::AdamOptions o;
  o.lr = 3e-2f;
  o.weight_decay = 0.1f;
  o.decoupled_weight_decay = true;
  for (int step = 1; step <= 3; ++step) {
    o.step = step;
    const auto g0 = random_values(layout.total, -1.0, 1.0, 94 + static_cast<std::uint32_t>(step));
    Flat<CpuBackend> gc(cpu, g0, layout);
    Flat<CudaBackend> gg(gpu, g0, layout);
    ops::adam_step(cpu.ctx, o, ops::AdamTensors{wc.views, gc.views, mc.views, vc.views, {}});
    ops::adam_step(gpu.ctx, o, ops::AdamTensors{wg.views, gg.views, mg.views, vg.views, {}});
    auto bits_differ = [](const std::vector<float>& a, const std::vector<float>& b) {
      std::size_t differ = 0;
      for (std::size_t i = 0; i < a.size(); ++i)
        differ += sk::float_to_bits(a[i]) != sk::float_to_bits(b[i]);
      return differ;
    };
    CAPTURE(step);
    CHECK(bits_differ(wc.values(cpu), wg.values(gpu)) == 0);
    CHECK(bits_differ(mc.values(cpu), mg.values(gpu)) == 0);
    CHECK(bits_differ(vc.values(cpu), vg.values(gpu)) == 0);
  }
}

}  // namespace ops_test

#include "ops_test_list.hpp"

namespace ops_test {

// The block formats give the same bytes on both devices (no contraction, IEEE division and
// products, rintf; E4M3's fields by frexpf / ldexpf, exact), and the same values back.
// The default 256-value blocks take the warp kernels (a partial last block here: 5000 values),
// a view one value off 16-byte alignment and 64-value blocks the thread-block ones.
TEST_CASE(
    "int8, E4M3 and int4 blocks on the GPU: the CPU's payload bytes and values, every dtype") {
  CpuBackend cpu;
  CudaBackend gpu;
  const std::int64_t n = 5000;
  for (auto format : {ops::QuantFormat::int8, ops::QuantFormat::f8_e4m3, ops::QuantFormat::int4})
    for (auto dtype : {sk::DType::f32, sk::DType::bf16, sk::DType::f16})
      for (std::int64_t block : {256, 64})
        for (std::int64_t offset : {0, 1}) {
          CAPTURE(ops::quant_format_name(format));
          CAPTURE(sk::dtype_name(dtype));
          CAPTURE(block);
          CAPTURE(offset);
          const sk::Tensor all = sk::cast(
              cpu.ctx, sk::from_vector(cpu.ctx, quant_values(n + 1, block, dtype, 5), {n + 1}),
              dtype);
          const sk::Tensor values = all.slice(0, offset, offset + n);
          const std::int64_t bytes = ops::quant_payload_bytes(n, block, format);
          const sk::Tensor on_cpu = cpu.zeros({bytes}, sk::DType::u8);
          const sk::Tensor on_gpu = gpu.zeros({bytes}, sk::DType::u8);
          ops::quantize_blocks(cpu.ctx, format, values, block, on_cpu);
          ops::quantize_blocks(gpu.ctx, format, gpu.upload(all).slice(0, offset, offset + n), block,
                               on_gpu);
          const sk::Tensor from_gpu = gpu.download(on_gpu);
          CHECK(std::memcmp(on_cpu.data_ptr(), from_gpu.data_ptr(),
                            static_cast<std::size_t>(bytes)) == 0);
          const sk::Tensor back_cpu = cpu.zeros({n + 1}, dtype).slice(0, offset, offset + n);
          const sk::Tensor back_gpu = gpu.zeros({n + 1}, dtype).slice(0, offset, offset + n);
          ops::dequantize_blocks(cpu.ctx, format, on_cpu, block, back_cpu);
          ops::dequantize_blocks(gpu.ctx, format, on_gpu, block, back_gpu);
          const sk::Tensor back = gpu.download(back_gpu);
          CHECK(std::memcmp(back_cpu.data_ptr(), back.data_ptr(),
                            static_cast<std::size_t>(n) * sk::dtype_size(dtype)) == 0);
        }
}

}  // namespace ops_test
