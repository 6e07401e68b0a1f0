// The backward pass: walks the nodes reachable from a root in reverse creation order (ready
// nodes first by highest sequence number, as PyTorch does), accumulates gradients, frees saved
// activations as it goes unless asked to retain them, and fires each leaf's grad-ready hooks
// the moment no further gradient can reach that leaf in this pass.
#pragma once

#include <algorithm>
#include <exception>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "shardkit/autograd/functional.hpp"
#include "shardkit/autograd/tape.hpp"

namespace shardkit::autograd {

struct BackwardOptions {
  // Keep saved activations so that the graph can be walked again.
  bool retain_graph = false;
};

namespace detail {

// Whether `t` is the only reference to a whole block of memory an op allocated: a gradient that
// nothing else can read, so the engine may add into it in place or hand it over to a leaf, as
// PyTorch's autograd does with a gradient it holds the only reference to (borrowed memory, views
// and shared gradients are copied as before). A sum between nodes may also be a channels-last
// tensor (`channels_last_too`); a leaf's gradient is always contiguous.
inline bool sole_reference(const Tensor& t, bool channels_last_too = false) {
  const auto& storage = t.storage();
  return storage != nullptr && storage.use_count() == 1 && storage->owns_memory() &&
         t.offset() == 0 && (t.is_contiguous() || (channels_last_too && keeps_channels_last(t))) &&
         t.nbytes() == storage->bytes();
}

inline void accumulate_leaf(Context& ctx, VariableImpl& leaf, const Tensor& grad) {
  if (leaf.grad_provider) {
    const Tensor into = leaf.grad_provider();
    check(into.shape() == leaf.data.shape(), "the grad provider of '", leaf.name, "' returned a ",
          shape_text(into.shape()), " tensor for a ", shape_text(leaf.data.shape()), " parameter");
    fn::accumulate(ctx, into, grad);
    return;
  }
  if (!leaf.grad.defined()) {
    // The gradient itself when nothing else refers to it and it was allocated as one (so memory
    // statistics count it where they count gradients); else a fresh buffer, since `grad` may be
    // shared with other consumers of the same gradient.
    if (sole_reference(grad) && grad.storage()->category() == MemoryCategory::gradients &&
        grad.shape() == leaf.data.shape() && grad.dtype() == leaf.data.dtype() &&
        grad.device() == leaf.data.device()) {
      leaf.grad = grad;
      return;
    }
    leaf.grad = empty_on(ctx, leaf.data.device(), leaf.data.shape(), leaf.data.dtype(),
                         MemoryCategory::gradients);
    copy(ctx, leaf.grad, grad);
    return;
  }
  fn::accumulate(ctx, leaf.grad, grad);
}

inline void fire_grad_ready(VariableImpl& leaf, const std::shared_ptr<VariableImpl>& owner) {
  if (leaf.grad_ready_hooks.empty()) return;
  Variable v = Variable::from_impl(owner);
  for (auto& hook : leaf.grad_ready_hooks) hook(v);
}

// Counts a backward pass on the tape for its whole extent, so that callbacks queued during it
// run when the outermost one ends.
class BackwardScope {
 public:
  explicit BackwardScope(Context& ctx) : tape_(tape(ctx)), exceptions_(std::uncaught_exceptions()) {
    tape_.enter_backward();
  }
  ~BackwardScope() noexcept(false) {
    tape_.exit_backward(std::uncaught_exceptions() > exceptions_);
  }
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  Tape& tape_;
  int exceptions_;
};

// A backward pass's rows in the tape's tables (BackwardTables): numbers the nodes and leaves it
// reaches, and when it ends -- by an exception too -- drops the gradients still held, gives an
// outer pass back the numbers this one took over (a checkpoint's recomputation runs a pass inside
// a pass), and closes the pass on the tape.
class PassRows {
 public:
  explicit PassRows(Tape& tape) : tape_(tape) {
    std::tie(pass_, tables_) = tape.begin_backward_pass();
    tables_->nodes.clear();
    tables_->leaves.clear();
    tables_->to_visit.clear();
    tables_->ready.clear();
    tables_->renumbered.clear();
  }
  ~PassRows() {
    for (auto it = tables_->renumbered.rbegin(); it != tables_->renumbered.rend(); ++it) {
      *it->pass = it->old_pass;
      *it->row = it->old_row;
    }
    tables_->nodes.clear();  // (gradients left by a pass that failed)
    tables_->ready.clear();
    tape_.end_backward_pass();
  }
  PassRows(const PassRows&) = delete;
  PassRows& operator=(const PassRows&) = delete;

  BackwardTables& tables() { return *tables_; }
  bool numbered(const Node* node) const { return node->backward_pass == pass_; }
  // A node an outer pass still running numbered (a checkpoint's recomputation reaching, through
  // a value its function captured, a node of the graph around it): that pass's, not this one's.
  bool outer_node(const Node* node) const {
    return node->backward_pass != pass_ && node->backward_pass != 0 &&
           tape_.backward_pass_running(node->backward_pass);
  }
  // This pass's gradient for an outer pass's node goes into that pass's sum for it, which runs
  // the node once, with every contribution, when its own count says so. (Walked and freed here
  // instead, the node's saved values were gone when the outer pass ran it.)
  void add_to_outer(Context& ctx, Node* node, const Tensor& grad) {
    BackwardTables* outer = tape_.running_pass_tables(node->backward_pass);
    SK_ASSERT(outer != nullptr && node->backward_row < outer->nodes.size() &&
              outer->nodes[node->backward_row].node == node);
    BackwardTables::NodeRow& row = outer->nodes[node->backward_row];
    const bool pending = row.dependencies > 0 || std::find(outer->ready.begin(), outer->ready.end(),
                                                           node) != outer->ready.end();
    check<StateError>(pending && !node->released,
                      "backward: a checkpoint's recomputation reached '", node->name(),
                      "' of the graph around it after that node ran; pass the "
                      "value to the checkpointed function as its input instead of capturing it");
    Tensor& sum = row.gradient;
    if (!sum.defined())
      sum = grad;
    else
      sum = fn::add(ctx, sum, grad);
  }
  std::uint32_t row_of(Node* node) {
    if (node->backward_pass != pass_) {
      take_number(node->backward_pass, node->backward_row, tables_->nodes.size());
      tables_->nodes.push_back({node, 0, Tensor()});
    }
    return node->backward_row;
  }
  std::uint32_t row_of(VariableImpl* leaf) {
    if (leaf->backward_pass != pass_) {
      take_number(leaf->backward_pass, leaf->backward_row, tables_->leaves.size());
      tables_->leaves.push_back({leaf, 0});
    }
    return leaf->backward_row;
  }

 private:
  void take_number(std::uint64_t& pass, std::uint32_t& row, std::size_t new_row) {
    if (pass != 0 && tape_.backward_pass_running(pass))
      tables_->renumbered.push_back({&pass, &row, pass, row});
    pass = pass_;
    row = static_cast<std::uint32_t>(new_row);
  }

  Tape& tape_;
  std::uint64_t pass_ = 0;
  BackwardTables* tables_ = nullptr;
};

}  // namespace detail

// Runs the backward pass from `root` with gradient `grad_root` (default: 1 for a one-element
// root). Without `fire_hooks` (checkpoint recomputation) leaf gradients are accumulated but
// the grad-ready hooks are left to the outer pass, which knows when a leaf is complete.
inline void run_backward(Context& ctx, const Variable& root, Tensor grad_root,
                         BackwardOptions options, bool fire_hooks = true) {
  check(root.defined(), "backward of an undefined variable");
  check(root.requires_grad(), "backward of a ", shape_text(root.shape()),
        " tensor that does not require grad: no parameter or input that requires grad "
        "contributed to it (was it computed under NoGradGuard, or from detached values?)");
  if (!grad_root.defined()) {
    check(root.numel() == 1, "backward of a non-scalar output ", shape_text(root.shape()),
          " needs an explicit gradient of that shape");
    grad_root = full(ctx, root.shape(), root.dtype(), 1.0, MemoryCategory::activations);
    if (root.device().is_cpu() != grad_root.device().is_cpu())
      grad_root = to_device(ctx, grad_root, root.device());
  }
  check(grad_root.shape() == root.shape(), "backward: gradient shape ",
        shape_text(grad_root.shape()), " differs from the output shape ", shape_text(root.shape()));
  // The nodes read their gradient in their output's dtype, on its device (PyTorch's engine
  // converts a given gradient the same way): an f32 gradient for an f64 root was read as
  // doubles, past its end.
  if (grad_root.device() != root.device()) grad_root = to_device(ctx, grad_root, root.device());
  if (grad_root.dtype() != root.dtype()) grad_root = cast(ctx, grad_root, root.dtype());
  detail::BackwardScope scope(ctx);

  if (root.is_leaf()) {
    detail::accumulate_leaf(ctx, *root.impl(), grad_root);
    if (fire_hooks) detail::fire_grad_ready(*root.impl(), root.impl_ptr());
    return;
  }

  // Discover the graph: how many edges point at each node and leaf from reachable nodes.
  detail::PassRows rows(tape(ctx));
  BackwardTables& tables = rows.tables();
  Node* const root_node = root.grad_fn().get();
  rows.row_of(root_node);
  tables.to_visit.push_back(root_node);
  while (!tables.to_visit.empty()) {
    Node* node = tables.to_visit.back();
    tables.to_visit.pop_back();
    if (node->released)
      fail<StateError>("backward through the graph a second time: the saved activations of '",
                       node->name(), "'",
                       node->module_path == nullptr || node->module_path->empty()
                           ? ""
                           : " (module '" + *node->module_path + "')",
                       " were freed by the first backward; pass retain_graph = true to the "
                       "first backward, or run the forward again");
    for (const Edge& edge : node->edges) {
      if (edge.node && rows.outer_node(edge.node.get())) continue;  // (add_to_outer)
      if (edge.node) {
        const bool first_visit = !rows.numbered(edge.node.get());
        ++tables.nodes[rows.row_of(edge.node.get())].dependencies;
        if (first_visit) tables.to_visit.push_back(edge.node.get());
      } else if (edge.leaf) {
        ++tables.leaves[rows.row_of(edge.leaf.get())].uses;
      }
    }
  }

  auto earlier = [](const Node* a, const Node* b) { return a->sequence_nr < b->sequence_nr; };
  tables.nodes[root_node->backward_row].gradient = grad_root;
  tables.ready.push_back(root_node);

  while (!tables.ready.empty()) {
    std::pop_heap(tables.ready.begin(), tables.ready.end(), earlier);
    Node* node = tables.ready.back();
    tables.ready.pop_back();
    Tensor grad = std::move(tables.nodes[node->backward_row].gradient);
    Gradients grads;
    if (grad.defined()) {
      grads = node->apply(ctx, grad);
      SK_ASSERT(grads.size() == node->edges.size());
    } else {
      grads.resize(node->edges.size());  // nothing flows, but dependants still count down
    }
    if (!options.retain_graph) {
      node->release_saved();
      node->released = true;
    }
    for (std::size_t i = 0; i < node->edges.size(); ++i) {
      const Edge& edge = node->edges[i];
      if (edge.node && rows.outer_node(edge.node.get())) {
        if (grads[i].defined()) rows.add_to_outer(ctx, edge.node.get(), grads[i]);
      } else if (edge.node) {
        Node* next = edge.node.get();
        BackwardTables::NodeRow& row = tables.nodes[next->backward_row];
        if (grads[i].defined()) {
          Tensor& sum = row.gradient;  // a + b with a held here alone is a += b: the same bits
          if (!sum.defined())
            sum = std::move(grads[i]);
          else if (detail::sole_reference(sum, true) && sum.dtype() == grads[i].dtype())
            fn::accumulate(ctx, sum, grads[i]);
          else
            sum = fn::add(ctx, sum, grads[i]);
        }
        if (--row.dependencies == 0) {
          tables.ready.push_back(next);
          std::push_heap(tables.ready.begin(), tables.ready.end(), earlier);
        }
      } else if (edge.leaf) {
        if (grads[i].defined()) detail::accumulate_leaf(ctx, *edge.leaf, grads[i]);
        if (--tables.leaves[edge.leaf->backward_row].uses == 0 && fire_hooks)
          detail::fire_grad_ready(*edge.leaf, edge.leaf);
      }
    }
  }
}

// Whether the backward running now reaches `leaf` (its graph, found before any node ran, has an
// edge to it): one called from a hook of that backward can tell, at its start, the leaves that
// will get no gradient in it (PyTorch DDP's find_unused_parameters).
inline bool reached_by_running_backward(Context& ctx, const Variable& leaf) {
  const VariableImpl* impl = leaf.impl();
  return impl != nullptr && impl->backward_pass != 0 &&
         tape(ctx).backward_pass_running(impl->backward_pass);
}

// loss.backward(): gradients of every leaf that requires grad, accumulated into leaf.grad().
inline void backward(Context& ctx, const Variable& root, const Tensor& grad = Tensor(),
                     BackwardOptions options = {}) {
  run_backward(ctx, root, grad, options);
}

// (loss · scale).backward() without forming the product: the seed gradient is `scale`
// (torch.cuda.amp.GradScaler.scale(loss).backward(); scale from optim::DynamicLossScaler).
inline void backward(Context& ctx, const Variable& root, double scale,
                     BackwardOptions options = {}) {
  check(root.defined() && root.numel() == 1, "backward(root, scale) seeds a scalar loss; the root ",
        root.defined() ? shape_text(root.shape()) : ShapeText::undefined(),
        " is not one: pass its gradient as a tensor of its shape");
  run_backward(ctx, root, full(ctx, root.shape(), root.dtype(), scale), options);
}

// Frees the saved activations of the graph behind `root` without running backward (a forward
// whose result will not be differentiated after all).
inline void release_graph(const Variable& root) {
  if (!root.defined() || root.is_leaf()) return;
  std::vector<Node*> stack{root.grad_fn().get()};
  std::unordered_set<Node*> seen{root.grad_fn().get()};
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    node->release_saved();
    node->released = true;
    for (const Edge& edge : node->edges)
      if (edge.node && seen.insert(edge.node.get()).second) stack.push_back(edge.node.get());
  }
}

}  // namespace shardkit::autograd
