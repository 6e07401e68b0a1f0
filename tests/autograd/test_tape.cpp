// Tape semantics: accumulation, no-grad, retain/free of saved activations, grad-ready hooks,
// errors, and independent tapes for ranks running as threads.
#include <doctest/doctest.h>

#include <string>
#include <thread>

#include "gradcheck.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;
using ag::testing::random_variable;

namespace {

std::vector<double> values(sk::Context& ctx, const sk::Tensor& t) {
  return sk::to_vector<double>(ctx, sk::contiguous(ctx, t));
}

// loss = cross_entropy(linear(relu(linear(x, w1)), w2), labels)
Variable two_layer_loss(sk::Context& ctx, const Variable& x, const Variable& w1,
                        const Variable& w2) {
  auto labels = sk::from_vector<std::int64_t>(ctx, {0, 2, 1}, {3});
  return ag::cross_entropy(ctx, ag::linear(ctx, ag::relu(ctx, ag::linear(ctx, x, w1)), w2), labels);
}

}  // namespace

TEST_CASE("gradients accumulate over backward passes until cleared") {
  sk::Context ctx({.seed = 11});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  const auto once = values(ctx, w1.grad());
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  const auto twice = values(ctx, w1.grad());
  REQUIRE(once.size() == twice.size());
  for (std::size_t i = 0; i < once.size(); ++i)
    CHECK(twice[i] == doctest::Approx(2 * once[i]).epsilon(1e-12));
  CHECK(!x.grad().defined());  // inputs that do not require grad get none
  w1.clear_grad();
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  CHECK(values(ctx, w1.grad()) == once);
}

TEST_CASE("backward into a caller-provided gradient buffer (a flat-buffer view)") {
  sk::Context ctx({.seed = 12});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  const auto expected = values(ctx, w1.grad());
  sk::Tensor flat = sk::zeros(ctx, {100}, sk::DType::f64, sk::MemoryCategory::gradients);
  w1.set_grad(flat.flat_view(7, {5, 4}));
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  CHECK(values(ctx, flat.flat_view(7, {5, 4})) == expected);
  CHECK(values(ctx, flat.flat_view(0, {7})) == std::vector<double>(7, 0.0));
}

TEST_CASE("a gradient buffer passed along several edges is added once per edge") {
  // An add passes one gradient buffer along both of its edges. The engine adds gradients in
  // place, or hands one to a leaf, only where it holds the sole reference to the buffer: here
  // (v + v + v) / 3 and (w + w + w) / 3 must give v's and w's gradients, not a buffer doubled
  // into itself.
  sk::Context ctx({.seed = 16});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  const auto expected_w1 = values(ctx, w1.grad()), expected_w2 = values(ctx, w2.grad());
  w1.clear_grad();
  w2.clear_grad();
  auto thrice = [&](const Variable& v) {
    return ag::scale(ctx, ag::add(ctx, ag::add(ctx, v, v), v), 1.0 / 3.0);
  };
  auto labels = sk::from_vector<std::int64_t>(ctx, {0, 2, 1}, {3});
  auto hidden = thrice(ag::linear(ctx, x, w1));  // a node's output used three times
  ag::backward(ctx, ag::cross_entropy(ctx, ag::linear(ctx, ag::relu(ctx, hidden), thrice(w2)),
                                      labels));  // and a leaf's
  const auto got_w1 = values(ctx, w1.grad()), got_w2 = values(ctx, w2.grad());
  REQUIRE(got_w1.size() == expected_w1.size());
  for (std::size_t i = 0; i < got_w1.size(); ++i)
    CHECK(got_w1[i] == doctest::Approx(expected_w1[i]).epsilon(1e-12));
  REQUIRE(got_w2.size() == expected_w2.size());
  for (std::size_t i = 0; i < got_w2.size(); ++i)
    CHECK(got_w2[i] == doctest::Approx(expected_w2[i]).epsilon(1e-12));
}

TEST_CASE("no-grad scope records nothing") {
  sk::Context ctx({.seed = 13});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  Variable loss;
  const auto recorded = ag::tape(ctx).nodes_recorded();
  {
    ag::NoGradGuard no_grad(ctx);
    loss = two_layer_loss(ctx, x, w1, w2);
  }
  CHECK(ag::tape(ctx).nodes_recorded() == recorded);
  CHECK(!loss.requires_grad());
  CHECK(ag::tape(ctx).grad_enabled());
  CHECK_THROWS_WITH_AS(ag::backward(ctx, loss), doctest::Contains("does not require grad"),
                       sk::InvalidArgument);
}

TEST_CASE("saved activations are freed by backward unless retained") {
  sk::Context ctx({.seed = 14});
  auto x = random_variable(ctx, {64, 32}, -1, 1, false);
  auto w1 = random_variable(ctx, {128, 32}, -1, 1), w2 = random_variable(ctx, {3, 128}, -1, 1);
  auto& stats = ctx.memory_stats();
  const auto before = stats.current(sk::MemoryCategory::activations);
  auto loss = ag::cross_entropy(ctx, ag::linear(ctx, ag::relu(ctx, ag::linear(ctx, x, w1)), w2),
                                sk::zeros(ctx, {64}, sk::DType::i64));
  const auto held = stats.current(sk::MemoryCategory::activations) - before;
  CHECK(held >= 64 * 128 * 8);  // at least the hidden activation is kept for backward
  ag::backward(ctx, loss, sk::Tensor(), {.retain_graph = true});
  CHECK(stats.current(sk::MemoryCategory::activations) - before == held);
  ag::backward(ctx, loss);  // allowed: the first one retained the graph
  // Only the loss value itself is still alive.
  CHECK(stats.current(sk::MemoryCategory::activations) - before <= 64);
  CHECK_THROWS_WITH_AS(ag::backward(ctx, loss), doctest::Contains("second time"), sk::StateError);
  try {
    ag::backward(ctx, loss);
  } catch (const sk::StateError& e) {
    CHECK(std::string(e.what()).find("retain_graph") != std::string::npos);
    CHECK(std::string(e.what()).find("cross_entropy") != std::string::npos);
  }
}

TEST_CASE("grad-ready hooks fire once per backward, with the final gradient, in reverse order") {
  sk::Context ctx({.seed = 15});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  std::vector<std::string> order;
  std::vector<std::vector<double>> seen;
  w1.set_name("w1");
  w2.set_name("w2");
  for (auto* w : {&w1, &w2})
    w->register_grad_ready_hook([&](Variable& v) {
      order.push_back(v.name());
      seen.push_back(values(ctx, v.grad()));
    });
  // w1 is used twice: its hook must wait for both contributions.
  auto labels = sk::from_vector<std::int64_t>(ctx, {0, 2, 1}, {3});
  auto h = ag::relu(ctx, ag::linear(ctx, x, w1));
  auto h2 = ag::add(ctx, h, ag::linear(ctx, x, w1));
  ag::backward(ctx, ag::cross_entropy(ctx, ag::linear(ctx, h2, w2), labels));
  REQUIRE(order == std::vector<std::string>{"w2", "w1"});
  CHECK(seen[0] == values(ctx, w2.grad()));
  CHECK(seen[1] == values(ctx, w1.grad()));
}

TEST_CASE("a grad provider receives every accumulation; end-of-backward callbacks run once") {
  sk::Context ctx({.seed = 12});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  const auto expected = values(ctx, w1.grad());
  w1.clear_grad();

  // The provider's buffer starts with values of its own: backward adds into it, and leaves the
  // leaf's grad() alone.
  auto bucket = sk::full(ctx, {5, 4}, sk::DType::f64, 0.5);
  int asked = 0;
  w1.set_grad_provider([&] {
    ++asked;
    return bucket;
  });
  std::vector<std::string> events;
  w1.register_grad_ready_hook([&](Variable&) {
    events.push_back("ready");
    ag::tape(ctx).queue_callback([&] {
      events.push_back("end");
      ag::tape(ctx).queue_callback([&] { events.push_back("queued by a callback"); });
    });
  });
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  CHECK(asked == 1);
  CHECK_FALSE(w1.grad().defined());
  const auto got = values(ctx, bucket);
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(0.5 + expected[i]));
  CHECK(events == std::vector<std::string>{"ready", "end", "queued by a callback"});
  CHECK(ag::tape(ctx).backward_depth() == 0);
  CHECK_THROWS_AS(ag::tape(ctx).queue_callback([] {}), sk::StateError);

  w1.set_grad_provider([&] { return sk::zeros(ctx, {4, 5}, sk::DType::f64); });
  CHECK_THROWS_WITH(ag::backward(ctx, two_layer_loss(ctx, x, w1, w2)),
                    doctest::Contains("returned a [4, 5] tensor for a [5, 4] parameter"));
  CHECK(ag::tape(ctx).backward_depth() == 0);  // a failed backward leaves the tape usable
}

TEST_CASE("ranks as threads have independent tapes and identical results") {
  auto run = [](std::uint64_t seed, std::vector<double>& grad) {
    sk::Context ctx({.seed = seed});
    auto x = random_variable(ctx, {3, 4}, -1, 1, false);
    auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
    for (int step = 0; step < 20; ++step) {
      w1.clear_grad();
      ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
    }
    grad = values(ctx, w1.grad());
  };
  std::vector<double> reference, a, b, c;
  run(21, reference);
  std::thread t1([&] { run(21, a); }), t2([&] { run(21, b); });
  std::thread t3([&] {  // a rank that stays in no-grad mode must not affect the others
    sk::Context ctx({.seed = 5});
    ag::NoGradGuard no_grad(ctx);
    auto x = random_variable(ctx, {3, 4}, -1, 1);
    for (int i = 0; i < 200; ++i) (void)ag::relu(ctx, x);
  });
  t1.join();
  t2.join();
  t3.join();
  CHECK(a == reference);
  CHECK(b == reference);
  run(22, c);
  CHECK(c != reference);
}

TEST_CASE("shape errors name the op and both shapes") {
  sk::Context ctx({.seed = 16});
  auto a = random_variable(ctx, {2, 3}, -1, 1), b = random_variable(ctx, {3, 2}, -1, 1);
  CHECK_THROWS_WITH_AS(ag::add(ctx, a, b),
                       doctest::Contains("add: shapes [2, 3] and [3, 2] differ"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(ag::matmul(ctx, a, a), doctest::Contains("matmul: shapes [2, 3] and [2, 3]"),
                       sk::InvalidArgument);
  auto labels = sk::from_vector<std::int64_t>(ctx, {0, 7}, {2});
  CHECK_THROWS_WITH_AS(ag::cross_entropy(ctx, a, labels), doctest::Contains("target class 7"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(ag::backward(ctx, ag::mul(ctx, a, a)), doctest::Contains("non-scalar"),
                       sk::InvalidArgument);
  auto empty_batch = random_variable(ctx, {0, 3}, -1, 1);
  CHECK_THROWS_WITH_AS(ag::cross_entropy(ctx, empty_batch, sk::empty(ctx, {0}, sk::DType::i64)),
                       doctest::Contains("logits [0, 3] hold no rows or no classes"),
                       sk::InvalidArgument);
}

// A callback's if_cut_short runs instead of it when the backward ends by an exception -- in a
// node or hook, or in an earlier callback -- and never after a backward that ran whole: the
// sharded wrappers learn there that the end they queued will not come.
TEST_CASE("queue_callback: if_cut_short runs when the backward ends by an exception") {
  sk::Context ctx({.seed = 3});
  auto x = random_variable(ctx, {3, 4}, -1, 1, false);
  auto w1 = random_variable(ctx, {5, 4}, -1, 1), w2 = random_variable(ctx, {3, 5}, -1, 1);
  std::vector<std::string> events;
  int fail_at = 0;  // 0: nothing fails; 1: w2's hook after queuing; 2: the first callback
  w2.register_grad_ready_hook([&](Variable&) {
    ag::tape(ctx).queue_callback(
        [&] {
          events.push_back("first end");
          if (fail_at == 2) throw sk::StateError("the first callback failed");
        },
        [&] { events.push_back("first cut short"); });
    ag::tape(ctx).queue_callback([&] { events.push_back("second end"); },
                                 [&] { events.push_back("second cut short"); });
  });
  w1.register_grad_ready_hook([&](Variable&) {
    if (fail_at == 1) throw sk::StateError("the hook failed");
  });
  ag::backward(ctx, two_layer_loss(ctx, x, w1, w2));
  CHECK(events == std::vector<std::string>{"first end", "second end"});
  events.clear();
  fail_at = 1;
  CHECK_THROWS_WITH(ag::backward(ctx, two_layer_loss(ctx, x, w1, w2)), "the hook failed");
  CHECK(events == std::vector<std::string>{"first cut short", "second cut short"});
  events.clear();
  fail_at = 2;
  CHECK_THROWS_WITH(ag::backward(ctx, two_layer_loss(ctx, x, w1, w2)), "the first callback failed");
  CHECK(events == std::vector<std::string>{"first end", "second cut short"});
  CHECK(ag::tape(ctx).backward_depth() == 0);
}

// A gradient given for the root in another dtype is converted to the root's, as PyTorch's engine
// converts it: the nodes read their gradient in their output's dtype, and an f32 gradient of an
// f64 softmax was read as doubles past its end (and its result written past gx's).
TEST_CASE("backward converts a root gradient of another dtype; a scale seeds scalars only") {
  sk::Context ctx({.seed = 1});
  auto run = [&](sk::DType seed_dtype) {
    Variable x(sk::from_vector<double>(ctx, {1, 2, 3, -4, 5, 0.5}, {2, 3}), true);
    const Variable y = ag::softmax(ctx, x);
    const auto seed = sk::from_vector<double>(ctx, {0.5, -1, 2, 0.25, 1.5, -0.75}, {2, 3});
    ag::backward(ctx, y, seed_dtype == sk::DType::f64 ? seed : sk::cast(ctx, seed, seed_dtype));
    return sk::to_vector<double>(ctx, x.grad());
  };
  CHECK(run(sk::DType::f32) == run(sk::DType::f64));  // (the seed's values are exact in f32)
  Variable v(sk::from_vector<double>(ctx, {1, 2}, {2}), true);
  CHECK_THROWS_WITH(ag::backward(ctx, ag::mul(ctx, v, v), 2.0),
                    doctest::Contains("seeds a scalar loss; the root [2] is not one"));
}
