// The host API in a plain g++ translation unit: only -I include and the host libraries (Eigen,
// zlib, nlohmann-json), no CUDA headers, no test framework. A CPU tensor round trip must work there
// (CPU-only use is a real use).
#include <shardkit/shardkit.hpp>

#include <Eigen/Core>

#include <cstdio>
#include <vector>

#if SK_WITH_CUDA || defined(__CUDA_RUNTIME_H__) || defined(CUDART_VERSION)
#error "the host API pulled in CUDA in a plain host build"
#endif

namespace sk = shardkit;

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                               \
    }                                                                         \
  } while (0)

int main() {
  sk::Context ctx({.seed = 2024});
  std::vector<float> values(4 * 5);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 2.0f;

  // host vector -> tensor -> strided view -> contiguous copy -> host vector
  auto t = sk::from_vector(ctx, values, {4, 5}, sk::MemoryCategory::parameters);
  {
    auto transposed = sk::contiguous(ctx, t.transpose(0, 1));
    auto back = sk::to_vector<float>(ctx, transposed);
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 5; ++c)
        EXPECT(back[static_cast<std::size_t>(c * 4 + r)] ==
               values[static_cast<std::size_t>(r * 5 + c)]);

    // f32 -> bf16 -> f32 keeps these values (they need few mantissa bits).
    auto round_trip = sk::cast(ctx, sk::cast(ctx, t, sk::DType::bf16), sk::DType::f32);
    EXPECT(sk::to_vector<float>(ctx, round_trip) == values);
    // Copies made from t are counted under t's category while they live.
    EXPECT(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 80 + 80 + 80);
  }

  // Tensor memory maps onto Eigen without copies.
  Eigen::Map<const Eigen::Matrix<float, 4, 5, Eigen::RowMajor>> matrix(t.data<float>());
  EXPECT(matrix(2, 3) == values[13]);

  sk::uniform_(ctx, t, 0.0, 1.0);
  EXPECT(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 80);
  EXPECT(!sk::cuda_available());

  std::printf("host-only round trip ok\n");
  return 0;
}
