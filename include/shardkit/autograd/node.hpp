// Node: one recorded operation of the tape -- its backward function, the edges to the producers
// of its inputs (or to leaves), and the tensors it saved from the forward pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/autograd/variable.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/small_object_pool.hpp"

namespace shardkit::autograd {

// Where the gradient of one input goes: the node that produced it, or the leaf itself.
// Both empty: the input needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  std::shared_ptr<VariableImpl> leaf;
  bool valid() const { return node != nullptr || leaf != nullptr; }
};

// A backward function's result, one gradient per input. Its storage comes from the thread's
// small-object pool (small_object_pool.hpp): a backward allocates nothing per node.
using Gradients = std::vector<Tensor, detail::PoolAllocator<Tensor>>;

class Node {
 public:
  virtual ~Node() = default;

  // Operation name for errors ("conv2d", "batch_norm"...).
  virtual const char* name() const = 0;

  // Gradients with respect to each input, aligned with `edges`; an undefined Tensor where an
  // input needs none. `grad_output` has the output's shape, dtype and device.
  virtual Gradients apply(Context& ctx, const Tensor& grad_output) = 0;

  // Drops the saved activations (after a backward without retain_graph): memory comes back
  // as soon as each node is done, not when the whole graph dies.
  virtual void release_saved() {}

  // (their storage comes from the thread's small-object pool, as the node's own does: recording
  // an op allocates nothing once a step has run)
  std::vector<Edge, detail::PoolAllocator<Edge>> edges;
  // Where the backward pass that last reached this node keeps its count and incoming gradient:
  // the pass's number and the node's row in that pass's tables (BackwardTables, tape.hpp).
  // Only the backward engine reads or writes them.
  std::uint64_t backward_pass = 0;
  std::uint32_t backward_row = 0;
  std::uint64_t sequence_nr = 0;  // creation order on the context's tape; backward runs it reversed
  // The module that recorded the node, for error messages (null outside modules).
  std::shared_ptr<const std::string> module_path;
  bool released = false;
};

}  // namespace shardkit::autograd
