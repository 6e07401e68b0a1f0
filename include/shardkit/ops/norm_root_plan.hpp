// NormRootPlan: the programs that finish many norm trees (norm_tree.hpp,
// append_norm_root_program) or add up finished ones in a fixed order (add_sum: clipping's
// total), written once on the host and kept on a device, so that a step finishes its norms
// there (ops::norm_roots) with the host's bits and nothing read back or uploaded. ParamNorms
// keeps one per way it lays out its roots.
//
// The device table is i64 [roots + 1 + words]: root r's program is words
// [table[r], table[r + 1]) of the part after the offsets.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/norm_tree.hpp"

namespace shardkit::ops {

class NormRootPlan {
 public:
  // Appends the next root: a tensor of `leaves` leaves whose cover nodes' values lie at the
  // indices `known` gives (empty: the root is 0).
  void add_root(std::int64_t leaves, const std::map<NormNode, std::int64_t>& known) {
    check<StateError>(!table_.defined(), "NormRootPlan: a root added after upload()");
    append_norm_root_program(leaves, known, words_);
    offsets_.push_back(static_cast<std::int64_t>(words_.size()));
    for (const auto& entry : known) values_read_ = std::max(values_read_, entry.second + 1);
  }

  // Appends a root that is the sum of the values at `indices` added left to right,
  // ((v0 + v1) + v2) + ...: a host loop's sum from 0 (0 + v0 = v0 exactly). No indices: 0.
  void add_sum(std::span<const std::int64_t> indices) {
    check<StateError>(!table_.defined(), "NormRootPlan: a root added after upload()");
    for (std::size_t i = 0; i < indices.size(); ++i) {
      words_.push_back(indices[i]);
      if (i > 0) words_.push_back(kNormAdd);
      values_read_ = std::max(values_read_, indices[i] + 1);
    }
    offsets_.push_back(static_cast<std::int64_t>(words_.size()));
  }

  // Copies the programs to `ctx`'s device (once: one upload, at set-up).
  void upload(Context& ctx) {
    check<StateError>(!table_.defined(), "NormRootPlan: uploaded twice");
    std::vector<std::int64_t> table = offsets_;
    table.insert(table.end(), words_.begin(), words_.end());
    table_ = from_vector(ctx, table, {static_cast<std::int64_t>(table.size())});
  }

  std::int64_t roots() const { return static_cast<std::int64_t>(offsets_.size()) - 1; }
  // How many values the programs read: indices [0, values_read()).
  std::int64_t values_read() const { return values_read_; }
  bool uploaded() const { return table_.defined(); }
  // i64 [roots() + 1 + words] on the device upload() was given.
  const Tensor& table() const { return table_; }

 private:
  std::vector<std::int64_t> offsets_{0};  // root r: words [offsets_[r], offsets_[r + 1])
  std::vector<std::int64_t> words_;
  std::int64_t values_read_ = 0;
  Tensor table_;
};

}  // namespace shardkit::ops
