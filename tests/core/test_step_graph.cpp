// StepGraph on the CPU: warm-up, one capture per key, replays, re-capture on a new key and
// eviction; what a CUDA graph cannot replay refused by name (host waits, random draws, a host
// value that drifted, a step taking another course); the capture pool's memory (blocks reused
// inside the step, kept for the graph after it, pre-capture memory held, all back at clear())
// with the memory statistics as the eager step's.
#include <doctest/doctest.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardkit/core/step_graph.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;

namespace {

std::string refusal_of(sk::StepGraph& graph, const std::string& key,
                       const std::function<void()>& step) {
  try {
    graph.run(key, step);
  } catch (const sk::CaptureRefused& e) {
    return e.what();
  }
  return "(not refused)";
}

}  // namespace

TEST_CASE("a step graph warms a key up eagerly, captures it once, replays it; a new key anew") {
  sk::Context ctx;
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 2, .max_graphs = 2});
  const auto x = sk::from_vector(ctx, std::vector<float>{1.5f, -2.0f, 3.25f}, {3});
  const auto y = sk::zeros(ctx, {3}, sk::DType::f32);
  int calls = 0;
  const auto step = [&] {
    ++calls;
    CHECK(ctx.in_step_graph());
    sk::add_(ctx, y, x);  // y accumulates x: every run, replays included, does the work
  };
  using sk::StepRun;
  std::vector<StepRun> runs;
  for (int s = 0; s < 5; ++s) runs.push_back(graph.run("a", step));
  CHECK(runs == std::vector<StepRun>{StepRun::eager, StepRun::eager, StepRun::captured,
                                     StepRun::replayed, StepRun::replayed});
  CHECK(calls == 5);  // (the CPU's replay runs the step again)
  CHECK(sk::to_vector<float>(ctx, y) == std::vector<float>{7.5f, -10.0f, 16.25f});
  CHECK_FALSE(ctx.in_step_graph());
  CHECK(graph.holds("a"));

  CHECK(graph.run("b", step) == StepRun::eager);  // a new key warms up and is captured anew
  CHECK(graph.run("b", step) == StepRun::eager);
  CHECK(graph.run("b", step) == StepRun::captured);
  CHECK(graph.graphs() == 2);
  CHECK(graph.run("a", step) == StepRun::replayed);  // "b" is now the least recently run
  for (int s = 0; s < 2; ++s) CHECK(graph.run("c", step) == StepRun::eager);
  CHECK(graph.run("c", step) == StepRun::captured);  // max_graphs: "b" goes
  CHECK(graph.graphs() == 2);
  CHECK(graph.holds("a"));
  CHECK_FALSE(graph.holds("b"));
  CHECK(graph.holds("c"));
  CHECK(graph.run("b", step) == StepRun::eager);  // its warm-up starts again
  CHECK(graph.stats().captures == 3);
  CHECK(graph.stats().replays == 3);
  CHECK(graph.stats().eager == 7);

  graph.clear();
  CHECK(graph.graphs() == 0);
  CHECK(graph.reserved_bytes() == 0);
  CHECK(graph.run("a", step) == StepRun::eager);
}

// What a captured step registers to run around each of its graph's runs (a local world's ranks
// meet there, comm/local_communicator.hpp): once per key, only while captured, then before and
// after every replay, around the step's own work, in the order of their keys (the same on every
// rank); never for eager steps. A run that throws between them tells each why, and the actions
// after it do not run.
TEST_CASE("a captured step's host work around each run: registered once, run before and after") {
  sk::Context ctx;
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 1, .max_graphs = 2});
  std::vector<std::string> log;
  bool fail = false;
  const auto step = [&] {
    log.push_back("step");
    ctx.around_each_run(
        "meet", [&] { log.push_back("meet"); },
        [&](const std::string& why) { log.push_back("meet told: " + why); });
    ctx.around_each_run("meet", [&] { log.push_back("meet again"); });  // same key: kept once
    ctx.around_each_run("early", [&] { log.push_back("early"); });      // sorts first
    if (fail) throw std::runtime_error("the step failed");
  };
  using sk::StepRun;
  CHECK(graph.run("a", step) == StepRun::eager);
  CHECK(graph.run("a", step) == StepRun::captured);  // (on the CPU the capture is the run)
  CHECK(log == std::vector<std::string>{"step", "step"});
  log.clear();
  CHECK(graph.run("a", step) == StepRun::replayed);
  CHECK(log == std::vector<std::string>{"early", "meet", "step", "early", "meet"});
  log.clear();
  CHECK(graph.run("b", step) == StepRun::eager);  // another key's graph has none of them yet
  CHECK(log == std::vector<std::string>{"step"});
  log.clear();
  fail = true;
  CHECK_THROWS_WITH_AS(graph.run("a", step), "the step failed", std::runtime_error);
  CHECK(log == std::vector<std::string>{"early", "meet", "step", "meet told: the step failed"});
  CHECK_FALSE(ctx.in_step_graph());
}

TEST_CASE("what a CUDA graph cannot replay is refused by name, and the context recovers") {
  sk::Context ctx({.seed = 5});
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 0});
  const auto t = sk::full(ctx, {4}, sk::DType::f32, 2.0);
  const auto before = ctx.memory_stats().current_total();
  struct Case {
    std::function<void()> step;
    const char* named;
  };
  const std::vector<Case> cases = {
      {[&] { (void)sk::to_vector<float>(ctx, t); }, "a read of device values on the host"},
      {[&] {
         (void)sk::from_vector(ctx, std::vector<float>{1, 2}, {2});
       },
       "an upload of host values"},
      {[&] { ctx.synchronize(); }, "a stream synchronisation"},
      {[&] { sk::uniform_(ctx, sk::empty(ctx, {8}, sk::DType::f32), 0.0, 1.0); }, "a random draw"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.named);
    const std::string message = refusal_of(graph, "k", [&] {
      const auto scratch = sk::empty(ctx, {256}, sk::DType::f32);  // freed as it unwinds
      c.step();
    });
    CHECK(message.find(c.named) != std::string::npos);
    CHECK(message.find("inside the captured step 'train' (key 'k')") != std::string::npos);
    CHECK_FALSE(ctx.capturing());
    CHECK_FALSE(graph.holds("k"));
    CHECK(ctx.memory_stats().current_total() == before);
  }
  // Outside a step every one of them is allowed again, and the key captures once it can.
  CHECK(sk::to_vector<float>(ctx, t) == std::vector<float>(4, 2.0f));
  ctx.synchronize();
  CHECK(graph.run("k", [&] { sk::fill(ctx, t, 3.0); }) == sk::StepRun::captured);
  CHECK(graph.run("k", [&] { sk::fill(ctx, t, 3.0); }) == sk::StepRun::replayed);
  CHECK(ctx.host_waits().total() == 2);  // the read and the synchronisation above
  // Captures do not nest (one stream, one graph).
  sk::StepGraph inner(ctx, "inner", {.warmup_steps = 0});
  CHECK_THROWS_AS(graph.run("nested", [&] { inner.run("k", [] {}); }), sk::StateError);
  CHECK_FALSE(ctx.capturing());
}

TEST_CASE("a host value a captured step was built with may not drift, nor the step's course") {
  sk::Context ctx;
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 1});
  float lr = 0.1f;
  bool extra = false;
  const auto step = [&] {
    ctx.capture_scalar("lr", lr);
    if (extra) ctx.capture_scalar("momentum", 0.9);
  };
  for (int s = 0; s < 3; ++s) graph.run("lr=0.1", step);
  lr = 0.05f;
  const std::string drifted = refusal_of(graph, "lr=0.1", step);
  CHECK(drifted.find("was built with lr = 0.1") != std::string::npos);
  CHECK(drifted.find("this replay has 0.05") != std::string::npos);
  CHECK_FALSE(ctx.capturing());
  // With the value in the key, a change is a new capture.
  for (int s = 0; s < 2; ++s) graph.run("lr=0.05", step);
  CHECK(graph.run("lr=0.05", step) == sk::StepRun::replayed);
  extra = true;
  const std::string branched = refusal_of(graph, "lr=0.05", step);
  CHECK(branched.find("took a different course") != std::string::npos);
  CHECK(branched.find("'momentum'") != std::string::npos);
  extra = false;
  CHECK(graph.run("lr=0.05", step) == sk::StepRun::replayed);
}

TEST_CASE("a captured step's memory: reused inside it, kept for the graph, counted as eager") {
  sk::Context ctx;
  auto& stats = ctx.memory_stats();
  const auto x = sk::full(ctx, {1024}, sk::DType::f32, 1.5);
  sk::Tensor out = sk::zeros(ctx, {1024}, sk::DType::f32);  // the step replaces it, as a grad
  std::vector<const void*> temporaries;
  const auto step = [&] {
    {
      const auto a = sk::clone(ctx, x);
      temporaries.push_back(a.data_ptr());
    }
    const auto b = sk::clone(ctx, x);  // same size: the block `a` freed
    temporaries.push_back(b.data_ptr());
    sk::Tensor next = sk::empty(ctx, {1024}, sk::DType::f32);
    sk::copy(ctx, next, b);
    out = next;
  };
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 1});
  graph.run("k", step);
  const auto eager_current = stats.current_total();
  const auto eager_peak = stats.peak_total();
  const void* before_capture = out.data_ptr();
  temporaries.clear();
  REQUIRE(graph.run("k", step) == sk::StepRun::captured);
  CHECK(temporaries[0] == temporaries[1]);  // the pool gave the freed block again
  CHECK(stats.current_total() == eager_current);
  CHECK(stats.peak_total() == eager_peak);
  // The pool: a block for a and b, one for `out`; the replaced `out` (allocated before the
  // capture, which the graph may read) is held, not freed.
  CHECK(graph.reserved_bytes() == 3 * 4096);
  const void* captured_out = out.data_ptr();
  CHECK(captured_out != before_capture);
  // The CPU's replay allocates as an eager step; the captured `out` it replaces goes back to
  // the pool, which keeps its memory for the graph.
  graph.run("k", step);
  CHECK(stats.current_total() == eager_current);
  CHECK(graph.reserved_bytes() == 3 * 4096);
  CHECK(sk::to_vector<float>(ctx, out) == std::vector<float>(1024, 1.5f));
  graph.clear();
  CHECK(graph.reserved_bytes() == 0);
  CHECK(stats.current_total() == eager_current);
  graph.run("k", step);  // the allocator works as before
  CHECK(stats.current_total() == eager_current);
}

TEST_CASE("a captured step's output outlives its graph: its block goes back when it is freed") {
  sk::Context ctx;
  sk::Tensor out;
  {
    sk::StepGraph graph(ctx, "train", {.warmup_steps = 0});
    graph.run("k", [&] { out = sk::full(ctx, {300}, sk::DType::f64, 0.25); });
    CHECK(graph.reserved_bytes() == 2400);
  }
  CHECK(sk::to_vector<double>(ctx, out) == std::vector<double>(300, 0.25));
  CHECK(ctx.memory_stats().current_total() == 2400);
  out = sk::Tensor();
  CHECK(ctx.memory_stats().current_total() == 0);
}

// A block of another graph's pool freed inside a capture (the step replaces a tensor the other
// graph made): the new graph may read it before the free, so it must outlive the new graph even
// when the other one is gone -- here evicted just before the capture (max_graphs 1). Were it
// given back to its retired pool, the end of the capture would free it, and the next allocation
// of its size would take the memory the new graph's replays read.
TEST_CASE("another graph's block freed inside a capture stays until the capture's graph goes") {
  sk::Context ctx;
  sk::Tensor out;
  sk::StepGraph graph(ctx, "train", {.warmup_steps = 0, .max_graphs = 1});
  graph.run("a", [&] { out = sk::full(ctx, {300}, sk::DType::f64, 0.25); });
  const void* a_block = out.data_ptr();
  sk::Tensor first;  // what graph b read of the block
  REQUIRE(graph.run("b", [&] {
    first = sk::clone(ctx, out.slice(0, 0, 1));
    out = sk::full(ctx, {100}, sk::DType::f64, 0.5);  // frees graph a's block
  }) == sk::StepRun::captured);
  CHECK(sk::to_vector<double>(ctx, first)[0] == 0.25);
  CHECK(graph.graphs() == 1);
  CHECK(graph.holds("b"));
  std::vector<sk::Tensor> probes;  // every allocation of the block's size while b lives
  for (int k = 0; k < 4; ++k) {
    probes.push_back(sk::empty(ctx, {300}, sk::DType::f64));
    CHECK(probes.back().data_ptr() != a_block);
  }
  probes.clear();
  graph.clear();  // b goes: the block goes back with it, and the allocator works as before
  out = sk::Tensor();
  first = sk::Tensor();
  CHECK(ctx.memory_stats().current_total() == 0);
  CHECK(sk::to_vector<double>(ctx, sk::full(ctx, {300}, sk::DType::f64, 1.0))[299] == 1.0);
}
