// Sums of squares that do not depend on how a tensor is split: the norms LARC and gradient
// clipping need, equal bit for bit whether a rank holds the whole tensor (DDP) or a piece of it
// (OSS/SDP flat split, FSDP shards).
//
// A tensor of n elements is cut into leaves of kNormLeaf elements (the last one may be short).
// A leaf's sum of squares is formed in one fixed order (leaf_sum_of_squares, the same on every
// device). Leaves combine along one fixed binary tree: node (level l, index j) covers leaves
// [j·2^l, (j+1)·2^l) and its value is left child + right child, leaves past the end counting
// as 0 (x + 0 = x exactly). The norm is the root's value.
//
// A rank that holds leaves [lo, hi) computes the largest nodes that lie wholly inside (its
// cover: at most ~2·log2(hi - lo) of them, each value formed along the tree); the ranks exchange
// their covers; anyone can then finish the tree. Since
// every node is formed by the same additions whoever forms it, the root has the same bits for
// every split, and for no split at all.
//
// Needs pieces that start on a leaf boundary: shard plans align every parameter and every
// rank's range to 16 elements (shard_plan.hpp), and kNormLeaf is 16.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "shardkit/core/config.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/ops/element.hpp"

namespace shardkit::ops {

inline constexpr std::int64_t kNormLeaf = 16;

inline std::int64_t norm_leaves(std::int64_t numel) { return (numel + kNormLeaf - 1) / kNormLeaf; }

// The sum of squares of x[0..count) (count <= kNormLeaf; missing elements count as 0), in
// double (squares of floats are exact there) and in one fixed order: four groups of four
// (x0² + x1²) + (x2² + x3²), then (g0 + g1) + (g2 + g3).
template <class T>
SK_HOST_DEVICE SK_INLINE double leaf_sum_of_squares(const T* x, int count) {
  double q[kNormLeaf];
  SK_UNROLL
  for (int i = 0; i < kNormLeaf; ++i) {
    const double v = i < count ? static_cast<double>(load_element(x + i)) : 0.0;
    q[i] = v * v;
  }
  double g[4];
  SK_UNROLL
  for (int k = 0; k < 4; ++k) g[k] = (q[4 * k] + q[4 * k + 1]) + (q[4 * k + 2] + q[4 * k + 3]);
  return (g[0] + g[1]) + (g[2] + g[3]);
}

struct NormNode {
  int level = 0;
  std::int64_t index = 0;
  friend bool operator<(const NormNode& a, const NormNode& b) {
    return a.level != b.level ? a.level < b.level : a.index < b.index;
  }
  friend bool operator==(const NormNode& a, const NormNode& b) = default;
};

// A node to evaluate over leaf values laid out elsewhere: the 2^level values that start at
// `first` (an index into that array, not a leaf number: pieces of several tensors and lists lie
// one after another there). ops::norm_subtree_sums forms many at once where the values are.
struct NormSubtree {
  std::int64_t first = 0;
  int level = 0;
};

// The value of a node over n = 2^l leaves x[0..n): each pair of neighbours added, level by
// level -- the tree's own additions (a node is left child + right child), done in place in
// `scratch`.
inline double norm_subtree(const double* x, std::int64_t n, std::vector<double>& scratch) {
  if (n == 1) return x[0];
  scratch.resize(static_cast<std::size_t>(n / 2));
  double* s = scratch.data();
  for (std::int64_t i = 0; i < n / 2; ++i) s[i] = x[2 * i] + x[2 * i + 1];
  for (std::int64_t len = n / 2; len > 1; len /= 2)
    for (std::int64_t i = 0; i < len / 2; ++i) s[i] = s[2 * i] + s[2 * i + 1];  // (reads ahead)
  return s[0];
}

// norm_subtree over the N = 2^l values x[0..N), in place (x is overwritten): the same
// additions, for a block whose size is known at compile time.
template <std::size_t N>
double norm_subtree_in_place(double (&x)[N]) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a subtree covers a power of two of leaves");
  for (std::size_t len = N; len > 1; len /= 2)
    for (std::size_t i = 0; i < len / 2; ++i) x[i] = x[2 * i] + x[2 * i + 1];
  return x[0];
}

// The cover of a run of consecutive leaves formed as the run arrives, left to right: each
// node pushed is added to its left sibling as soon as both are known (left + right, the tree's
// own addition), so every value equals the node's norm_subtree, and the nodes left at the end
// are norm_cover's. For a run that starts at leaf 0, or at a multiple of a power of two at least
// its length (a chunk of a span), the levels fall from left to right, one node per level at
// most: Capacity 64 then holds any run.
template <int Capacity>
class NormCoverStack {
 public:
  NormCoverStack() = default;
  explicit NormCoverStack(std::int64_t first_leaf) : next_(first_leaf) {}

  // Appends the node of 2^level leaves that starts at the next leaf (a multiple of 2^level).
  void push(int level, double value) {
    NormNode node{level, next_ >> level};
    next_ += std::int64_t{1} << level;
    while (count_ > 0 && nodes_[count_ - 1].level == node.level && (node.index & 1) != 0) {
      --count_;
      value = values_[count_] + value;
      node = {node.level + 1, node.index >> 1};
    }
    check<StateError>(count_ < Capacity, "NormCoverStack: more than ", Capacity,
                      " nodes; the run does not start where its length allows");
    nodes_[count_] = node;
    values_[count_] = value;
    ++count_;
  }

  int size() const { return count_; }
  const NormNode& node(int i) const { return nodes_[i]; }
  double value(int i) const { return values_[i]; }

 private:
  std::int64_t next_ = 0;  // the first leaf not yet pushed
  int count_ = 0;
  NormNode nodes_[Capacity];
  double values_[Capacity];
};

// The cover of leaves [lo, hi): the largest tree nodes wholly inside, left to right -- from
// each position the largest aligned block of 2^l leaves that fits. Their values are each
// node's norm_subtree over its leaves (ops::norm_subtree_sums forms them where the leaves lie).
inline std::vector<NormNode> norm_cover(std::int64_t lo, std::int64_t hi) {
  std::vector<NormNode> out;
  for (std::int64_t at = lo; at < hi;) {
    int level = 0;
    while (level < 62) {
      const std::int64_t wider = std::int64_t{2} << level;
      if (at % wider != 0 || at + wider > hi) break;
      ++level;
    }
    out.push_back({level, at >> level});
    at += std::int64_t{1} << level;
  }
  return out;
}

// The root's value for a tensor of `leaves` leaves, given the values of nodes that cover them
// all (the covers of every piece). Throws if a leaf is covered by none.
inline double norm_root(std::int64_t leaves, const std::map<NormNode, double>& known) {
  if (leaves == 0) return 0.0;
  int top = 0;
  while ((std::int64_t{1} << top) < leaves) ++top;
  auto value = [&](auto&& self, int level, std::int64_t index) -> double {
    if ((index << level) >= leaves) return 0.0;  // wholly past the end
    const auto found = known.find({level, index});
    if (found != known.end()) return found->second;
    check<StateError>(level > 0, "norm tree: leaf ", index, " of ", leaves,
                      " is covered by no piece; every piece of the tensor must report");
    return self(self, level - 1, 2 * index) + self(self, level - 1, 2 * index + 1);
  };
  return value(value, top, 0);
}

// Finishing trees where the cover values lie (a device, after the exchange): each root's
// additions written down once, on the host, as a program that a device runs for every step.
// A program is a run of words over an array of values: a word w >= 0 pushes values[w], a
// kNormAdd word pops the top two (a, then b beneath it) and pushes b + a. It makes exactly
// norm_root's additions, left + right, in norm_root's order; subtrees wholly past the end are
// left out instead of added as 0 (x + 0 = x exactly for a sum of squares), and an empty
// program is the value 0 (a tensor of no leaves, or one no piece reported).
inline constexpr std::int64_t kNormAdd = -1;
// The evaluation stack a program may need: one value per tree level and one more.
inline constexpr int kNormProgramStack = 64;

// Appends the program of the root of a tensor of `leaves` leaves whose cover nodes are
// `known` (node -> index of its value); returns the largest stack depth it needs. Empty
// `known`: no words (the root is 0). Throws, as norm_root does, when a leaf is covered by none.
inline int append_norm_root_program(std::int64_t leaves,
                                    const std::map<NormNode, std::int64_t>& known,
                                    std::vector<std::int64_t>& words) {
  if (leaves == 0 || known.empty()) return 0;
  int top = 0;
  while ((std::int64_t{1} << top) < leaves) ++top;
  int depth = 0, deepest = 0;
  // Returns whether the node pushed a value (false: wholly past the end).
  auto emit = [&](auto&& self, int level, std::int64_t index) -> bool {
    if ((index << level) >= leaves) return false;
    const auto found = known.find({level, index});
    if (found != known.end()) {
      words.push_back(found->second);
      deepest = std::max(deepest, ++depth);
      return true;
    }
    check<StateError>(level > 0, "norm tree: leaf ", index, " of ", leaves,
                      " is covered by no piece; every piece of the tensor must report");
    const bool left = self(self, level - 1, 2 * index);
    const bool right = self(self, level - 1, 2 * index + 1);
    if (left && right) {
      words.push_back(kNormAdd);
      --depth;
    }
    return left || right;
  };
  emit(emit, top, 0);
  check<StateError>(deepest <= kNormProgramStack, "norm tree: a program needs ", deepest,
                    " stack entries, more than ", kNormProgramStack);
  return deepest;
}

// Runs the program words[begin, end) over `values` (append_norm_root_program's).
SK_HOST_DEVICE SK_INLINE double run_norm_root_program(const double* values,
                                                      const std::int64_t* words, std::int64_t begin,
                                                      std::int64_t end) {
  double stack[kNormProgramStack];
  int depth = 0;
  for (std::int64_t at = begin; at < end; ++at) {
    const std::int64_t word = words[at];
    if (word == kNormAdd) {
      --depth;
      stack[depth - 1] = stack[depth - 1] + stack[depth];
    } else {
      stack[depth++] = values[word];
    }
  }
  return depth == 0 ? 0.0 : stack[0];
}

}  // namespace shardkit::ops
