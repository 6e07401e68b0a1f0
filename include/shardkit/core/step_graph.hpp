// StepGraph: a training step captured once and replayed -- on a GPU as one CUDA graph, so the
// host launches a whole step (forward, backward, gradient synchronisation, loss scaling, the
// optimizer) with one call instead of issuing every kernel, descriptor and collective again.
//
//   sk::StepGraph graph(ctx, "train");
//   for (...) {
//     copy(ctx, x, next_batch);           // the step reads fixed tensors: refill them
//     graph.run(key, [&] {                // key: what the step's shapes and host values are
//       auto loss = criterion(model(ctx, x), y);
//       autograd::backward(ctx, loss);
//       model.step(lr, scaler);
//     });
//   }
//
// Each key first runs `warmup_steps` eager steps (whatever a step makes on first use -- the
// optimizer's state, the step gate, library workspaces -- exists before the capture), then its
// step is captured, then replayed. A new key (another batch shape, another learning rate) is
// captured anew; up to `max_graphs` are kept. While a step is captured (Context::begin_capture)
// its allocations come from the graph's CapturePool and what a graph cannot replay is refused
// by name (CaptureRefused): a host wait (reads, uploads, synchronisations, collective waits), a
// random draw. Host values a step is built with are recorded (Context::capture_scalar).
//
// On a CPU there is no graph: a capture runs the step under those rules, and a replay runs it
// again under them, comparing its host values with the captured ones -- so the CPU tests prove
// that a step replays (no host wait, no drifting host value) without a GPU. On a GPU a replay
// runs no host code: tensors the step returns or replaces (the loss, gradients) are the same
// memory at every replay, and host-side state the step's code would have advanced does not
// move (what the step needs across steps lives on the device: the step gate, the loss scale).
// Those tensors are the memory of the key captured last, though: with several keys, a host
// handle that a step replaced (`loss_ = loss.data()`) keeps pointing at the last capture's
// memory while an older key's replay writes its own. A step that several keys share writes
// what the host reads after it into tensors the caller made before the graph (copy the loss
// into them at the end of the step), as the custom loop keeps its loss.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "shardkit/core/capture_pool.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/error.hpp"

#if SK_WITH_CUDA
#include "shardkit/core/cuda_check.hpp"
#endif

namespace shardkit {

struct StepGraphOptions {
  // Eager steps per key before it is captured (PyTorch's CUDA-graph recipe warms up too): what
  // a step makes at first use must exist before the capture, and a first step may differ from
  // the next ones (SGD's first momentum, a step gate made at the first loss-scaled step).
  int warmup_steps = 2;
  // Graphs kept, one per key; beyond that the least recently run goes, with its memory.
  int max_graphs = 4;
};

enum class StepRun : std::uint8_t { eager, captured, replayed };

struct StepGraphStats {
  std::int64_t eager = 0;
  std::int64_t captures = 0;
  std::int64_t replays = 0;
};

#if SK_WITH_CUDA
// An instantiated CUDA graph (RAII).
class CudaGraphExec {
 public:
  CudaGraphExec() = default;
  explicit CudaGraphExec(cudaGraph_t graph) {
    SK_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph, 0));
  }
  ~CudaGraphExec() {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
  }
  CudaGraphExec(CudaGraphExec&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  CudaGraphExec& operator=(CudaGraphExec&& other) noexcept {
    std::swap(exec_, other.exec_);
    return *this;
  }
  CudaGraphExec(const CudaGraphExec&) = delete;
  CudaGraphExec& operator=(const CudaGraphExec&) = delete;

  void launch(cudaStream_t stream) const { SK_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};
#endif

class StepGraph {
 public:
  StepGraph(Context& ctx, std::string name, StepGraphOptions options = {})
      : ctx_(&ctx), allocator_(ctx.allocator_ptr()), name_(std::move(name)), options_(options) {
    check(options.warmup_steps >= 0, "StepGraphOptions::warmup_steps is ", options.warmup_steps,
          "; use 0 or more eager steps before a capture");
    check(options.max_graphs >= 1, "StepGraphOptions::max_graphs is ", options.max_graphs,
          "; keep at least one graph");
  }
  ~StepGraph() { clear(); }
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // One training step of configuration `key` (see the file's comment): eager while the key
  // warms up, then captured, then replayed. A step that throws while it is captured leaves no
  // graph (the next run of its key tries again).
  StepRun run(const std::string& key, const std::function<void()>& step) {
    struct InStepGraph {
      Context& ctx;
      explicit InStepGraph(Context& c) : ctx(c) { ctx.enter_step_graph(); }
      ~InStepGraph() { ctx.leave_step_graph(); }
    } in_step_graph(*ctx_);
    const auto found = graphs_.find(key);
    if (found != graphs_.end()) {
      replay(key, found->second, step);
      ++stats_.replays;
      return StepRun::replayed;
    }
    int& warm = warm_steps_[key];
    if (warm < options_.warmup_steps) {
      step();
      ++warm;
      ++stats_.eager;
      return StepRun::eager;
    }
    while (static_cast<int>(graphs_.size()) >= options_.max_graphs) evict_least_recent();
    capture(key, step);
    ++stats_.captures;
    return StepRun::captured;
  }

  // Drops every graph, their memory going back to the device (blocks still held by tensors as
  // those are freed); keys warm up again.
  void clear() noexcept {
    for (auto& [key, graph] : graphs_) allocator_->retire(graph.pool);
    graphs_.clear();
    warm_steps_.clear();
  }

  const std::string& name() const { return name_; }
  const StepGraphStats& stats() const { return stats_; }
  std::size_t graphs() const { return graphs_.size(); }
  bool holds(const std::string& key) const { return graphs_.count(key) != 0; }
  // Device memory the graphs keep: their pools' blocks and what they hold for the graphs.
  std::size_t reserved_bytes() const {
    std::size_t bytes = 0;
    for (const auto& [key, graph] : graphs_)
      bytes += graph.pool->reserved_bytes() + graph.pool->held_bytes();
    return bytes;
  }

 private:
  struct Graph {
    std::shared_ptr<CapturePool> pool;
    CaptureRecord record;
    std::uint64_t last_run = 0;
#if SK_WITH_CUDA
    CudaGraphExec exec;
#endif
  };

  void capture(const std::string& key, const std::function<void()>& step) {
    Graph graph;
    graph.pool = std::make_shared<CapturePool>();
    const std::string what = described(key);
    allocator_->trim_device_pool();  // (outside the capture: it waits for the stream)
    ctx_->begin_capture(what, graph.record, false, graph.pool);
#if SK_WITH_CUDA
    const bool on_gpu = ctx_->device().is_cuda();
    bool stream_capturing = false;
#endif
    try {
#if SK_WITH_CUDA
      // (inside the try: a stream that cannot begin capturing -- a sticky error, a capture of
      // the caller's own -- must not leave the context capturing into this frame's record)
      if (on_gpu) {
        begin_stream_capture();
        stream_capturing = true;
      }
#endif
      step();
      ctx_->capture_scalar(kEndOfStep, 0.0);  // a replay that does more or less is refused
    } catch (...) {
#if SK_WITH_CUDA
      if (stream_capturing) abandon_stream_capture();
#endif
      ctx_->end_capture();
      allocator_->retire(graph.pool);
      throw;
    }
#if SK_WITH_CUDA
    if (on_gpu) {
      try {
        graph.exec = end_stream_capture(what);
      } catch (...) {
        ctx_->end_capture();
        allocator_->retire(graph.pool);
        throw;
      }
    }
#endif
    ctx_->end_capture();
    graph.last_run = ++clock_;
    const std::shared_ptr<CapturePool> pool = graph.pool;
    Graph* kept_graph = nullptr;
    try {
      kept_graph = &graphs_.emplace(key, std::move(graph)).first->second;
    } catch (...) {  // (no memory for the map's node: the pool goes, as a failed capture's)
      allocator_->retire(pool);
      throw;
    }
    auto& kept = *kept_graph;
#if SK_WITH_CUDA
    // The capture ran nothing: this step runs as the graph's first launch.
    if (on_gpu) launch(kept);
#else
    (void)kept;
#endif
  }

  void replay(const std::string& key, Graph& graph, const std::function<void()>& step) {
    graph.last_run = ++clock_;
#if SK_WITH_CUDA
    if (ctx_->device().is_cuda()) return launch(graph);
#endif
    // The CPU's replay: the step again, under the capture's rules and host values.
    between_actions(graph, [&] {
      ctx_->begin_capture(described(key), graph.record, true);
      try {
        step();
        ctx_->capture_scalar(kEndOfStep, 0.0);
      } catch (...) {
        ctx_->end_capture();
        throw;
      }
      ctx_->end_capture();
    });
  }

  // Runs `run` (a launch, a CPU replay) between the work its graph's step registered to run
  // just before and just after each run (Context::around_each_run). When anything in between
  // throws, each is told why before the error goes on: other ranks may be waiting at them.
  template <class Run>
  static void between_actions(const Graph& graph, Run&& run) {
    const auto& around = graph.record.around_each_run;
    if (around.empty()) return run();
    auto tell = [&](const std::string& reason) noexcept {
      for (const auto& a : around) try {
          if (a.failed) a.failed(reason);
        } catch (...) {  // telling is best effort; the error itself goes on
        }
    };
    try {
      for (const auto& a : around) a.action();
      run();
      for (const auto& a : around) a.action();
    } catch (const std::exception& e) {
      tell(e.what());
      throw;
    } catch (...) {
      tell("an exception that is no std::exception");
      throw;
    }
  }

  static constexpr const char* kEndOfStep = "(the end of the step)";

  std::string described(const std::string& key) const {
    return "'" + name_ + "' (key '" + key + "')";
  }

  void evict_least_recent() noexcept {
    auto oldest = graphs_.begin();
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
      if (it->second.last_run < oldest->second.last_run) oldest = it;
    allocator_->retire(oldest->second.pool);
    warm_steps_.erase(oldest->first);
    graphs_.erase(oldest);
  }

#if SK_WITH_CUDA
  void begin_stream_capture() {
    CudaDeviceGuard guard(ctx_->device().index);
    // Relaxed: the capture pool's cudaMalloc (capture_pool.hpp) must stay allowed.
    SK_CUDA_CHECK(cudaStreamBeginCapture(ctx_->stream(), cudaStreamCaptureModeRelaxed));
  }
  void abandon_stream_capture() noexcept {
    // (the device switched by hand: a CudaDeviceGuard throws when it cannot switch, and this
    // runs while an exception unwinds)
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess &&
                          cudaSetDevice(ctx_->device().index) == cudaSuccess;
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(ctx_->stream(), &graph) == cudaSuccess && graph != nullptr)
      (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    if (switched) (void)cudaSetDevice(previous);
  }
  CudaGraphExec end_stream_capture(const std::string& what) {
    CudaDeviceGuard guard(ctx_->device().index);
    cudaGraph_t graph = nullptr;
    const cudaError_t status = cudaStreamEndCapture(ctx_->stream(), &graph);
    if (status == cudaErrorStreamCaptureInvalidated || status == cudaErrorStreamCaptureUnjoined) {
      (void)cudaGetLastError();
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      fail<CaptureRefused>(
          "the CUDA capture of the step ", what, " failed (", cudaGetErrorString(status),
          "): the step made a call a capture does not allow (a synchronous copy, work on "
          "another stream not joined back, a blocking library call); run it eagerly");
    }
    if (status != cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    SK_CUDA_CHECK(status);
    try {
      CudaGraphExec exec(graph);
      (void)cudaGraphDestroy(graph);
      return exec;
    } catch (...) {
      (void)cudaGraphDestroy(graph);
      throw;
    }
  }
  void launch(Graph& graph) {
    CudaDeviceGuard guard(ctx_->device().index);
    between_actions(graph, [&] {
      graph.exec.launch(ctx_->stream());
      // At once: should what follows throw, the launched graph's verdict is still raised.
      for (const auto& [key, check] : graph.record.checks) ctx_->defer_check(key, check);
    });
  }
#endif

  Context* ctx_;
  std::shared_ptr<Allocator> allocator_;  // the context's, where the pools' memory lives
  std::string name_;
  StepGraphOptions options_;
  std::map<std::string, Graph> graphs_;
  std::map<std::string, int> warm_steps_;  // eager steps run per key
  std::uint64_t clock_ = 0;
  StepGraphStats stats_;
};

}  // namespace shardkit
