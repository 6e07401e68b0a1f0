// Node: one recorded operation of the tape -- its backward function, the edges to the producers
// of its inputs (or to leaves), and the tensors it saved from the forward pass.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/autograd/variable.hpp"
#include "shardkit/core/context.hpp"

namespace shardkit::autograd {

// Where the gradient of one input goes: the node that produced it, or the leaf itself.
// Both empty: the input needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  std::shared_ptr<VariableImpl> leaf;
  bool valid() const { return node != nullptr || leaf != nullptr; }
};

class Node {
 public:
  virtual ~Node() = default;

  // Operation name for errors ("conv2d", "batch_norm"...).
  virtual const char* name() const = 0;

  // Gradients with respect to each input, aligned with `edges`; an undefined Tensor where an
  // input needs none. `grad_output` has the output's shape, dtype and device.
  virtual std::vector<Tensor> apply(Context& ctx, const Tensor& grad_output) = 0;

  // Drops the saved activations (after a backward without retain_graph): memory comes back
  // as soon as each node is done, not when the whole graph dies.
  virtual void release_saved() {}

  std::vector<Edge> edges;
  std::uint64_t sequence_nr = 0;  // creation order on the context's tape; backward runs it reversed
  std::string module_path;        // module that recorded the node, for error messages
  bool released = false;
};

}  // namespace shardkit::autograd
