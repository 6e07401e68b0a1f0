// The host's cost of one autograd op on the CPU: a chain of element-wise ops (add, mul, ReLU)
// on tensors of a few elements and its backward, where the arithmetic is next to nothing and
// the time is each op's host work -- the node, the allocations, the dispatch through the kernel
// table, the backward's bookkeeping. torch_op_overhead.py times the same chain in PyTorch's CPU
// eager mode; compare_op_overhead.sh runs the two alternately and prints the ratio. The floor
// is a few nanoseconds of arithmetic per op: everything above it is overhead. The counter
// heap_allocs_per_op counts operator new calls per op (forward with its backward) on one untimed
// step after the timing (tests/heap_counter.hpp replaces this program's global operator new).
#include "bench_common.hpp"
#include "shardkit/shardkit.hpp"
#include "tests/heap_counter.hpp"

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
  const auto allocations =
      sk::testing::heap_allocations_of([&] { ops = chain_step(ctx, x, b, s, seed); });
  state.counters["heap_allocs_per_op"] = static_cast<double>(allocations.ours) / ops;
}
BENCHMARK(BM_tiny_op_chain)->ArgName("numel")->Arg(8)->Arg(1024)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
