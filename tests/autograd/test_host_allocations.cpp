// The host side of an autograd op allocates nothing from the heap once a step has run: its node,
// its output's VariableImpl and Storage come from the thread's small-object pool, shapes live
// inside tensors, the output's memory comes back from the host allocator's cache, kernels' scratch
// from the thread's HostScratch, and the backward pass keeps its tables on the tape. Counted by
// tests/heap_counter.hpp, which replaces the global operator new of this test executable (it
// counts only while a test asks it to); an allocation made inside oneDNN (its execution of a
// convolution builds an argument map per call) is counted apart, by the library in its call stack.
#include <doctest/doctest.h>

#include <stdexcept>

#include "gradcheck.hpp"
#include "heap_counter.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

namespace {

// Heap allocations of `step()` on its third run (the first two fill the caches).
template <class Step>
sk::testing::HeapAllocations allocations_of(Step&& step) {
  step();
  step();
  return sk::testing::heap_allocations_of(step);
}

}  // namespace

TEST_CASE("a chain of small autograd ops and its backward allocate nothing on the heap") {
  if (!sk::detail::kPoolSmallObjects) return;  // (AddressSanitizer: the pool is bypassed)
  sk::Context ctx({.seed = 3, .cpu_threads = 1});
  const auto x = ag::testing::random_variable(ctx, {4, 8}, -1, 1);
  const auto b = ag::testing::random_variable(ctx, {4, 8}, -1, 1);
  const auto s = ag::testing::random_variable(ctx, {4, 8}, 0.5, 1.5);
  const sk::Tensor seed = sk::full(ctx, {4, 8}, sk::DType::f32, 1.0);
  const auto allocations = allocations_of([&] {
    ag::Variable y = x;
    for (int k = 0; k < 16; ++k) y = ag::relu(ctx, ag::mul(ctx, ag::add(ctx, y, b), s));
    ag::backward(ctx, y, seed);
  });
  CHECK(allocations.ours == 0);
  CHECK(x.grad().defined());
}

// Blocks of 64 KiB and more are carved out of segments, split and merged as they come and go
// (an AVX2 machine's oneDNN asks for such scratch in every convolution of the step below): the
// allocator's indexes reuse the nodes of the entries that left.
TEST_CASE("large host blocks split from and merged into segments allocate no bookkeeping") {
  if (!sk::detail::kPoolSmallObjects) return;
  sk::Context ctx({.seed = 1, .cpu_threads = 1});
  const auto allocations = allocations_of([&] {
    sk::Tensor a = sk::empty(ctx, {std::int64_t{1} << 15}, sk::DType::f32);  // 128 KiB
    sk::Tensor b = sk::empty(ctx, {std::int64_t{1} << 16}, sk::DType::f32);  // 256 KiB
    sk::Tensor c = sk::empty(ctx, {std::int64_t{3} << 14}, sk::DType::f32);  // 192 KiB
    b = sk::Tensor();  // (a hole between two blocks in use)
    sk::Tensor d = sk::empty(ctx, {std::int64_t{1} << 14}, sk::DType::f32);  // into the hole
    a = sk::Tensor();
    c = sk::Tensor();  // (merges with its free neighbours)
  });
  CHECK(allocations.ours == 0);
}

TEST_CASE("a ResNet-18 training step's host side allocates nothing on the heap") {
  if (!sk::detail::kPoolSmallObjects) return;
  // The host-bound configuration of bench_autograd: batch 2, 8 x 8 images, base width 4, where
  // the step is its ops' host work.
  sk::Context ctx({.seed = 5, .cpu_threads = 1});
  sk::nn::ResNetOptions options;
  options.num_classes = 10;
  options.small_image_stem = true;
  options.base_channels = 4;
  const auto net = sk::nn::resnet18(ctx, options);
  sk::Tensor pixels = sk::empty(ctx, {2, 3, 8, 8}, sk::DType::f32);
  sk::uniform_(ctx, pixels, -1, 1);
  const ag::Variable images(pixels);
  const sk::Tensor labels = sk::from_vector<std::int64_t>(ctx, {3, 7}, {2});
  const auto allocations = allocations_of([&] {
    net->zero_grad();
    ag::backward(ctx, ag::cross_entropy(ctx, (*net)(ctx, images), labels));
  });
  CHECK(allocations.ours == 0);
  MESSAGE("allocations inside oneDNN's convolutions, per step: ", allocations.onednn);
}

TEST_CASE("a backward pass run inside another, through the same nodes, leaves the outer intact") {
  // y = inner(a), a = x * w. inner's backward runs a second backward from `a` itself (through
  // the outer pass's node for a, which the inner pass numbers for itself) before handing its
  // gradient on: x's gradient gets g * w twice, and the outer pass still reaches a's node.
  struct InnerBackwardNode : ag::Node {
    ag::Variable a;
    const char* name() const override { return "inner_backward"; }
    ag::Gradients apply(sk::Context& ctx, const sk::Tensor& g) override {
      ag::backward(ctx, a, g, {.retain_graph = true});
      return {g};
    }
  };
  sk::Context ctx({.seed = 4});
  const auto x = ag::testing::random_variable(ctx, {6}, -1, 1);  // (f64)
  const auto w = ag::testing::random_variable(ctx, {6}, 0.5, 1.5, /*requires_grad=*/false);
  const ag::Variable a = ag::mul(ctx, x, w);
  auto node = sk::make_pooled<InnerBackwardNode>();
  node->a = a;
  const ag::Variable y = ag::record(ctx, node, {&a}, sk::contiguous(ctx, a.data()));
  const sk::Tensor g = sk::empty(ctx, {6}, sk::DType::f64);
  sk::uniform_(ctx, g, 0.5, 2.0);
  ag::backward(ctx, y, g);
  const auto grad = sk::to_vector<double>(ctx, x.grad());
  const auto gv = sk::to_vector<double>(ctx, g), wv = sk::to_vector<double>(ctx, w.data());
  for (std::size_t i = 0; i < grad.size(); ++i)
    CHECK(grad[i] == doctest::Approx(2 * gv[i] * wv[i]).epsilon(1e-12));
}

TEST_CASE("a pass that fails inside another gives the outer pass its numbers back") {
  // As above, but the inner pass ends by an exception (x's grad-ready hook throws the first
  // time), which the node catches: the outer pass must still find a's node under its own number.
  struct CatchingInnerNode : ag::Node {
    ag::Variable a;
    bool caught = false;
    const char* name() const override { return "catching_inner"; }
    ag::Gradients apply(sk::Context& ctx, const sk::Tensor& g) override {
      try {
        ag::backward(ctx, a, g, {.retain_graph = true});
      } catch (const std::runtime_error&) {
        caught = true;
      }
      return {g};
    }
  };
  sk::Context ctx({.seed = 6});
  auto x = ag::testing::random_variable(ctx, {5}, -1, 1);
  const auto w = ag::testing::random_variable(ctx, {5}, 0.5, 1.5, /*requires_grad=*/false);
  int hook_calls = 0;
  x.register_grad_ready_hook([&](const ag::Variable&) {
    if (hook_calls++ == 0) throw std::runtime_error("the first hook fails");
  });
  const ag::Variable a = ag::mul(ctx, x, w);
  auto node = sk::make_pooled<CatchingInnerNode>();
  node->a = a;
  const ag::Variable y = ag::record(ctx, node, {&a}, sk::contiguous(ctx, a.data()));
  const sk::Tensor g = sk::empty(ctx, {5}, sk::DType::f64);
  sk::uniform_(ctx, g, 0.5, 2.0);
  ag::backward(ctx, y, g);
  CHECK(node->caught);
  CHECK(hook_calls == 2);  // the inner pass's, then the outer's
  const auto grad = sk::to_vector<double>(ctx, x.grad());
  const auto gv = sk::to_vector<double>(ctx, g), wv = sk::to_vector<double>(ctx, w.data());
  for (std::size_t i = 0; i < grad.size(); ++i)
    CHECK(grad[i] == doctest::Approx(2 * gv[i] * wv[i]).epsilon(1e-12));

  // A pass that fails outright leaves nothing behind: the next one over the same leaf is whole.
  x.clear_grad();
  x.clear_grad_ready_hooks();
  struct ThrowingNode : ag::Node {
    const char* name() const override { return "throwing"; }
    ag::Gradients apply(sk::Context&, const sk::Tensor&) override {
      throw std::runtime_error("this backward fails");
    }
  };
  const ag::Variable b = ag::mul(ctx, x, w);
  const ag::Variable z = ag::record(ctx, sk::make_pooled<ThrowingNode>(), {&b}, b.data());
  CHECK_THROWS_AS(ag::backward(ctx, z, g), std::runtime_error);
  CHECK_FALSE(x.grad().defined());
  ag::backward(ctx, ag::mul(ctx, x, w), g);
  const auto again = sk::to_vector<double>(ctx, x.grad());
  for (std::size_t i = 0; i < again.size(); ++i)
    CHECK(again[i] == doctest::Approx(gv[i] * wv[i]).epsilon(1e-12));
}
