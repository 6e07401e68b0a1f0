// Quick start: one rank's Context, a flat parameter buffer handed out as per-layer views,
// PyTorch-style initialisation from the counter-based RNG, and the memory counters.
#include <shardkit/shardkit.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace sk = shardkit;

int main() {
  sk::Context ctx({.seed = 42});

  // An MLP 784-1024-1024-10: all parameters live in one flat, contiguous buffer.
  struct Param {
    std::string name;
    sk::Shape shape;
  };
  const std::vector<Param> params = {{"fc1.weight", {1024, 784}},  {"fc1.bias", {1024}},
                                     {"fc2.weight", {1024, 1024}}, {"fc2.bias", {1024}},
                                     {"fc3.weight", {10, 1024}},   {"fc3.bias", {10}}};
  std::int64_t total = 0;
  for (const auto& p : params) total += sk::shape_numel(p.shape);
  auto flat = sk::empty(ctx, {total}, sk::DType::f32, sk::MemoryCategory::parameters);

  std::int64_t offset = 0;
  std::printf("%-12s %-14s %10s %10s\n", "parameter", "shape", "offset", "numel");
  for (const auto& p : params) {
    auto view = flat.flat_view(offset, p.shape);  // shares flat's memory
    // torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
    const double fan_in = p.shape.size() == 2 ? static_cast<double>(p.shape[1]) : 1024.0;
    const double bound = 1.0 / std::sqrt(p.name.starts_with("fc1") ? 784.0 : fan_in);
    sk::uniform_(ctx, view, -bound, bound);
    std::printf("%-12s %-14s %10lld %10lld\n", p.name.c_str(), sk::shape_str(p.shape).c_str(),
                static_cast<long long>(offset), static_cast<long long>(view.numel()));
    offset += view.numel();
  }

  // Mixed precision: the compute copy in bf16, a gradient buffer, and momentum state.
  auto compute = sk::cast(ctx, flat, sk::DType::bf16);
  auto grads = sk::zeros(ctx, {total}, sk::DType::f32, sk::MemoryCategory::gradients);
  auto momentum = sk::zeros(ctx, {total}, sk::DType::f32, sk::MemoryCategory::optimizer_state);

  const auto values = sk::to_vector<float>(ctx, flat.flat_view(0, {8}));
  std::printf("\nfc1.weight[0, :8] =");
  for (float v : values) std::printf(" %+.5f", v);
  std::printf("\n\nmemory by category (bytes):\n");
  const auto snapshot = ctx.memory_stats().snapshot();
  for (auto category : sk::kAllMemoryCategories)
    std::printf("  %-16s current %11lld  peak %11lld\n",
                std::string(sk::memory_category_name(category)).c_str(),
                static_cast<long long>(snapshot.current_of(category)),
                static_cast<long long>(snapshot.peak_of(category)));
  std::printf("  %-16s current %11lld  peak %11lld\n", "total",
              static_cast<long long>(snapshot.current_total),
              static_cast<long long>(snapshot.peak_total));
  std::printf("CUDA GPUs visible: %d\n", sk::cuda_device_count());
  return 0;
}
