// The reverse-mode tape of one Context: grad mode, the creation order of recorded nodes, the
// module path under construction (for errors), and the recompute flag of checkpointing.
// It lives in the Context's resource slot, so N ranks as N threads each have their own.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/autograd/node.hpp"

namespace shardkit::autograd {

// One backward pass's bookkeeping, by row: each node it reaches (how many edges still point at
// it, the gradient gathered for it so far) and each leaf (how many edges still point at it).
// Nodes and leaves find their row through their backward_pass / backward_row fields, so the pass
// inserts into no map; the tape keeps one set of tables per nesting depth and reuses their
// capacity, so a pass allocates nothing once a step has run.
struct BackwardTables {
  struct NodeRow {
    Node* node;
    int dependencies;
    Tensor gradient;
  };
  struct LeafRow {
    VariableImpl* leaf;
    int uses;
  };
  // A node or leaf that an outer pass still running had numbered: its numbers, put back when
  // this (inner) pass ends.
  struct Renumbered {
    std::uint64_t* pass;
    std::uint32_t* row;
    std::uint64_t old_pass;
    std::uint32_t old_row;
  };
  std::vector<NodeRow> nodes;
  std::vector<LeafRow> leaves;
  std::vector<Node*> to_visit;  // the discovery's stack
  std::vector<Node*> ready;     // a heap: the latest-recorded ready node on top
  std::vector<Renumbered> renumbered;
};

class Tape {
 public:
  bool grad_enabled() const { return grad_enabled_; }
  void set_grad_enabled(bool enabled) { grad_enabled_ = enabled; }

  // True while activation checkpointing recomputes a segment: modules with side effects on
  // their buffers (batch-norm running statistics) must not apply them a second time.
  bool recomputing() const { return recomputing_; }
  void set_recomputing(bool value) { recomputing_ = value; }

  // True during a checkpoint segment's first forward: it runs without grad, but a backward
  // follows (the segment's recomputation), so what a forward keeps for its backward -- FSDP's
  // slice of a unit over the node under hpZ -- is kept as after a forward with grad.
  bool backward_follows() const { return grad_enabled_ || before_recompute_; }
  bool before_recompute() const { return before_recompute_; }
  void set_before_recompute(bool value) { before_recompute_ = value; }

  // The training forward's random stream (dropout's masks, dropout.hpp): a Philox key, the next
  // 128-bit block and the block it must not reach. A trainer keys it per step
  // (set_random_stream, with random_stream_key), so a run resumed at step s draws the masks one
  // that never stopped drew there; activation checkpointing puts it back for a recomputation,
  // so a segment recomputes with the masks its forward drew. Its key is derived apart from the
  // other streams' (the context's, which initialisation draws from, is keyed by the seed
  // itself), so masks never repeat their numbers. Until keyed: the context's seed, rank 0.
  struct RandomStream {
    std::uint64_t key = 0, next_block = 0, end_block = ~std::uint64_t{0};
  };
  const RandomStream& random_stream() const { return random_stream_; }
  void set_random_stream(RandomStream stream) { random_stream_ = stream; }
  // The first of `blocks` blocks; refused where they would pass the stream's end (a step drawing
  // into the next step's range would repeat its masks).
  std::uint64_t take_random_blocks(std::uint64_t blocks) {
    const std::uint64_t first = random_stream_.next_block;
    check<StateError>(blocks <= random_stream_.end_block - first,
                      "the tape's random stream: ", blocks, " blocks from block ", first,
                      " pass its end, block ", random_stream_.end_block,
                      "; key a longer range for the step (Tape::set_random_stream)");
    random_stream_.next_block += blocks;
    return first;
  }

  // Backward passes running now (checkpoint recomputation nests one inside another).
  int backward_depth() const { return backward_depth_; }
  // Runs `callback` when the outermost backward pass now running ends (PyTorch's
  // queue_callback): the sharded wrappers wait for their last reductions there. If the pass
  // ends by an exception instead -- in a node, a hook or an earlier callback -- the callbacks
  // do not run, and `if_cut_short` does (it must not throw: an exception is on its way), so
  // that whoever queued one knows its end will not come.
  void queue_callback(std::function<void()> callback, std::function<void()> if_cut_short = {}) {
    check<StateError>(backward_depth_ > 0,
                      "queue_callback outside a backward pass: callbacks "
                      "run when the running backward ends; call it from a hook");
    callbacks_.push_back({std::move(callback), std::move(if_cut_short)});
  }
  void enter_backward() { ++backward_depth_; }
  // Leaves a backward pass; the outermost one runs the queued callbacks (those queued while
  // they run included), or, when it ends by an exception, their if_cut_short instead.
  void exit_backward(bool failed) {
    if (--backward_depth_ > 0) return;
    if (failed) return cut_short(0);
    ++backward_depth_;  // callbacks may queue more, and run as part of this backward
    for (std::size_t i = 0; i < callbacks_.size(); ++i) {
      auto callback = std::move(callbacks_[i].run);
      try {
        callback();
      } catch (...) {
        --backward_depth_;
        cut_short(i + 1);  // (the one that threw knows)
        throw;
      }
    }
    callbacks_.clear();
    --backward_depth_;
  }

  // A backward pass's number and its tables (cleared, capacity kept), for the pass about to run
  // at the current depth; end_backward_pass when it ends, however it ends.
  std::pair<std::uint64_t, BackwardTables*> begin_backward_pass() {
    const std::size_t depth = active_passes_.size();
    if (tables_.size() == depth) tables_.push_back(std::make_unique<BackwardTables>());
    // (numbered across the process: a node or leaf another context's pass numbered must not
    // look numbered to this one)
    static std::atomic<std::uint64_t> last_pass{0};
    active_passes_.push_back(last_pass.fetch_add(1, std::memory_order_relaxed) + 1);
    return {active_passes_.back(), tables_[depth].get()};
  }
  void end_backward_pass() { active_passes_.pop_back(); }
  // Whether pass `pass` is still running (an outer pass of the one asking).
  bool backward_pass_running(std::uint64_t pass) const {
    for (std::uint64_t running : active_passes_)
      if (running == pass) return true;
    return false;
  }
  // The tables of running pass `pass` (nullptr: not running).
  BackwardTables* running_pass_tables(std::uint64_t pass) {
    for (std::size_t depth = 0; depth < active_passes_.size(); ++depth)
      if (active_passes_[depth] == pass) return tables_[depth].get();
    return nullptr;
  }

  std::uint64_t next_sequence_nr() { return next_sequence_nr_++; }
  std::uint64_t nodes_recorded() const { return next_sequence_nr_; }

  // Path of the module whose forward is running ("layer1.0.conv1"), empty outside modules.
  const std::string& module_path() const {
    static const std::string kNone;
    return module_paths_.empty() ? kNone : *module_paths_.back();
  }
  // The same, shared: every node recorded in the module's forward holds it without copying it
  // (a path longer than a short string's inline room was a heap allocation per op).
  const std::shared_ptr<const std::string>& shared_module_path() const {
    static const std::shared_ptr<const std::string> kNone;
    return module_paths_.empty() ? kNone : module_paths_.back();
  }
  void push_module(std::shared_ptr<const std::string> path) {
    module_paths_.push_back(std::move(path));
  }
  void pop_module() {
    if (!module_paths_.empty()) module_paths_.pop_back();
  }

 private:
  bool grad_enabled_ = true;
  bool recomputing_ = false;
  bool before_recompute_ = false;
  std::uint64_t next_sequence_nr_ = 0;
  std::vector<std::shared_ptr<const std::string>> module_paths_;
  int backward_depth_ = 0;
  RandomStream random_stream_;
  struct Callback {
    std::function<void()> run, if_cut_short;
  };
  // The backward ended by an exception: callbacks from `first` on will not run.
  void cut_short(std::size_t first) noexcept {
    for (std::size_t i = first; i < callbacks_.size(); ++i)
      if (callbacks_[i].if_cut_short) {
        try {
          callbacks_[i].if_cut_short();
        } catch (...) {  // (the backward's own exception says more)
        }
      }
    callbacks_.clear();
  }

  std::vector<Callback> callbacks_;
  std::vector<std::uint64_t> active_passes_;
  std::vector<std::unique_ptr<BackwardTables>> tables_;  // by nesting depth
};

// The Philox key of the masks a training forward draws with `seed` on `rank`: the two mixed
// with a tag through SplitMix64's finaliser, so the key is none of the streams keyed by a seed
// or a seed plus a small number (initialisation, the samplers' epochs, the loss's queue).
inline std::uint64_t random_stream_key(std::uint64_t seed, std::uint64_t rank) {
  const auto mix = [](std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  return mix(mix(seed ^ 0x64726F706F757421ull) + rank);  // (the tag: "dropout!")
}

inline Tape& tape(Context& ctx) {
  return ctx.resource<Tape>([&ctx] {
    auto made = std::make_shared<Tape>();
    made->set_random_stream({random_stream_key(ctx.seed(), 0), 0});
    return made;
  });
}

// Records nothing while alive (evaluation, optimizer steps, the forward of a checkpoint).
class NoGradGuard {
 public:
  explicit NoGradGuard(Context& ctx) : tape_(tape(ctx)), previous_(tape_.grad_enabled()) {
    tape_.set_grad_enabled(false);
  }
  ~NoGradGuard() { tape_.set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  Tape& tape_;
  bool previous_;
};

// A checkpoint segment's first forward: no grad, its recomputation to come (backward_follows).
class CheckpointForwardGuard {
 public:
  explicit CheckpointForwardGuard(Context& ctx)
      : no_grad_(ctx), tape_(tape(ctx)), previous_(tape_.before_recompute()) {
    tape_.set_before_recompute(true);
  }
  ~CheckpointForwardGuard() { tape_.set_before_recompute(previous_); }
  CheckpointForwardGuard(const CheckpointForwardGuard&) = delete;
  CheckpointForwardGuard& operator=(const CheckpointForwardGuard&) = delete;

 private:
  NoGradGuard no_grad_;
  Tape& tape_;
  bool previous_;
};

// Sets grad mode and the recompute flag for a scope (checkpoint recomputation).
class RecomputeGuard {
 public:
  explicit RecomputeGuard(Context& ctx)
      : tape_(tape(ctx)), grad_(tape_.grad_enabled()), recomputing_(tape_.recomputing()) {
    tape_.set_grad_enabled(true);
    tape_.set_recomputing(true);
  }
  ~RecomputeGuard() {
    tape_.set_grad_enabled(grad_);
    tape_.set_recomputing(recomputing_);
  }
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  Tape& tape_;
  bool grad_, recomputing_;
};

// The module path shown in errors for the scope of one module's forward.
class ModuleScope {
 public:
  ModuleScope(Context& ctx, std::shared_ptr<const std::string> path) : tape_(tape(ctx)) {
    tape_.push_module(std::move(path));
  }
  ~ModuleScope() { tape_.pop_module(); }
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

 private:
  Tape& tape_;
};

// " (in module 'layer1.0.conv1')" or "" -- appended to op errors. A message part, looked up and
// formatted only when a failed check streams it (every op's checks name it).
class ModuleSuffix {
 public:
  explicit ModuleSuffix(Context& ctx) : ctx_(&ctx) {}
  friend std::ostream& operator<<(std::ostream& out, const ModuleSuffix& suffix) {
    const std::string& path = tape(*suffix.ctx_).module_path();
    return path.empty() ? out : out << " (in module '" << path << "')";
  }

 private:
  Context* ctx_;
};

inline ModuleSuffix module_suffix(Context& ctx) { return ModuleSuffix(ctx); }

// True when the op must record a node: grad mode is on and some input wants a gradient.
inline bool needs_grad(Context& ctx, std::initializer_list<const Variable*> inputs) {
  if (!tape(ctx).grad_enabled()) return false;
  for (const Variable* v : inputs)
    if (v != nullptr && v->defined() && v->requires_grad()) return true;
  return false;
}

// Wires `node` to its inputs and returns the output variable it produces.
template <class Inputs>
Variable record_inputs(Context& ctx, std::shared_ptr<Node> node, const Inputs& inputs,
                       Tensor output) {
  auto& t = tape(ctx);
  node->sequence_nr = t.next_sequence_nr();
  node->module_path = t.shared_module_path();
  node->edges.clear();
  node->edges.reserve(std::size(inputs));
  for (const Variable* v : inputs) {
    Edge edge;
    if (v != nullptr && v->defined() && v->requires_grad()) {
      if (v->is_leaf())
        edge.leaf = v->impl_ptr();
      else
        edge.node = v->grad_fn();
    }
    node->edges.push_back(std::move(edge));
  }
  Variable out(std::move(output), true);
  out.impl()->grad_fn = std::move(node);
  return out;
}

inline Variable record(Context& ctx, std::shared_ptr<Node> node,
                       std::initializer_list<const Variable*> inputs, Tensor output) {
  return record_inputs(ctx, std::move(node), inputs, std::move(output));
}

}  // namespace shardkit::autograd
