// Fused ops on a CUDA GPU: the same cases as the CPU executable (float64 references, poisoned
// outputs, edge sizes, unaligned segments), plus GPU-against-CPU runs of the same step.
#include "cpu_backend.hpp"
#include "shardkit/cuda.hpp"
#include "shardkit/shardkit.hpp"

namespace ops_test {

struct CudaBackend {
  // nvcc may fuse a square into the next addition (an FMA): leaf sums agree with the host's to
  // the last bit or so, and every GPU run gives the same bits.
  static constexpr double leaf_tolerance = 1e-15;
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

}  // namespace ops_test

#include "ops_test_list.hpp"
