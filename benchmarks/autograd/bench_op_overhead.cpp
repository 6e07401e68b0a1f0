// The host's cost of one autograd op on the CPU: a chain of element-wise ops (add, mul, ReLU)
// on tensors of a few elements and its backward, where the arithmetic is next to nothing and
// the time is each op's host work -- the node, the allocations, the dispatch through the kernel
// table, the backward's bookkeeping. torch_op_overhead.py times the same chain in PyTorch's CPU
// eager mode; compare_op_overhead.sh runs the two alternately and prints the ratio. The floor
// is a few nanoseconds of arithmetic per op: everything above it is overhead. The counter
// heap_allocs_per_op counts operator new calls per op (forward with its backward) on one untimed
// step after the timing: this program replaces the global operator new to count them.
#include <atomic>
#include <cstdlib>
#include <new>

#include "bench_common.hpp"
#include "shardkit/shardkit.hpp"

namespace {
std::atomic<bool> counting_allocations{false};
std::atomic<long> allocations{0};

void* counted_new(std::size_t bytes, std::size_t alignment) {
  if (counting_allocations.load(std::memory_order_relaxed))
    allocations.fetch_add(1, std::memory_order_relaxed);
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes ? bytes : 1)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

// (operator delete stays the library's, which frees with free())
void* operator new(std::size_t bytes) { return counted_new(bytes, alignof(std::max_align_t)); }
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return counted_new(bytes, static_cast<std::size_t>(alignment));
}

namespace sk = shardkit;
namespace ag = shardkit::autograd;

namespace {

constexpr int kLinks = 32;  // each link is three ops: y = relu((y + b) * s)

// One forward of the chain and its backward; returns the ops it ran (forward ops; each has its
// backward too).
int chain_step(sk::Context& ctx, const ag::Variable& x, const ag::Variable& b,
               const ag::Variable& s, const sk::Tensor& seed) {
  ag::Variable y = x;
  for (int k = 0; k < kLinks; ++k) y = ag::relu(ctx, ag::mul(ctx, ag::add(ctx, y, b), s));
  ag::backward(ctx, y, seed);
  return 3 * kLinks;
}

void BM_tiny_op_chain(benchmark::State& state) {
  sk::Context ctx({.seed = 1});
  const sk::Shape shape{state.range(0)};
  auto leaf = [&](double low, double high) {
    sk::Tensor t = sk::empty(ctx, shape, sk::DType::f32);
    sk::uniform_(ctx, t, low, high);
    return ag::Variable(t, /*requires_grad=*/true);
  };
  const ag::Variable x = leaf(-1, 1), b = leaf(-0.5, 0.5), s = leaf(0.5, 1.5);
  const sk::Tensor seed = sk::full(ctx, shape, sk::DType::f32, 1.0);
  int ops = chain_step(ctx, x, b, s, seed);  // warm-up (allocator caches)
  shardkit::bench::LoopClock clock;
  for (auto _ : state) ops = chain_step(ctx, x, b, s, seed);
  state.counters["us_per_op"] = clock.seconds_per_iteration(state) / ops * 1e6;
  allocations = 0;
  counting_allocations = true;
  ops = chain_step(ctx, x, b, s, seed);
  counting_allocations = false;
  state.counters["heap_allocs_per_op"] = static_cast<double>(allocations.load()) / ops;
}
BENCHMARK(BM_tiny_op_chain)->ArgName("numel")->Arg(8)->Arg(1024)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
