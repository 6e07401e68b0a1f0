// ParamNorms: the sum of squares of every whole parameter of a PieceTable, from the pieces the
// ranks hold, with the same bits under every stage and world size (ops/norm_tree.hpp): what
// LARC's trust ratios and global-norm gradient clipping need.
//
// Each rank forms the leaf sums of its pieces (one backend pass over all of them), the values
// of its pieces' covers (a second backend pass, where the leaves lie), and -- when the table is
// sharded over several ranks -- one all_gather_v exchanges every rank's cover values (a few per
// piece: their number follows from the table alone, so nothing else is sent). Every rank then
// finishes every parameter's tree. A replicated table (DDP) needs no exchange.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/device_ops.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/shard/piece_table.hpp"

namespace shardkit::optim {

class ParamNorms {
 public:
  // `comm` joins the ranks of a sharded table (nullptr: one rank, or a replicated table).
  ParamNorms(Context& ctx, const shard::PieceTable& table, int rank, comm::Communicator* comm)
      : ctx_(&ctx), table_(&table), rank_(rank) {
    const bool exchange = comm != nullptr && !table.replicated() && table.world_size() > 1;
    comm_ = exchange ? comm : nullptr;
    covers_.resize(static_cast<std::size_t>(table.world_size()));
    for (int r = 0; r < table.world_size(); ++r) {
      // Only what this rank will use: every rank's covers when exchanging, else its own.
      if (comm_ == nullptr && r != rank) {
        cover_counts_.push_back(0);
        continue;
      }
      std::size_t nodes = 0;
      for (const auto& piece : table.pieces(r)) {
        check(piece.param_begin % ops::kNormLeaf == 0, "ParamNorms: a piece of '",
              table.params()[piece.param].name, "' starts at element ", piece.param_begin,
              ", not on a ", ops::kNormLeaf, "-element leaf; shard plans align pieces to 16");
        const auto lo = piece.param_begin / ops::kNormLeaf;
        covers_[static_cast<std::size_t>(r)].push_back(
            ops::norm_cover(lo, lo + ops::norm_leaves(piece.numel())));
        nodes += covers_[static_cast<std::size_t>(r)].back().size();
      }
      cover_counts_.push_back(nodes);
    }
    // This rank's leaf sums for one operand list, and where its cover nodes lie among them.
    const auto& mine = covers_[static_cast<std::size_t>(rank)];
    for (std::size_t q = 0; q < table.pieces(rank).size(); ++q) {
      const auto& piece = table.pieces(rank)[q];
      const auto lo = piece.param_begin / ops::kNormLeaf;
      for (const auto& node : mine[q])
        own_nodes_.push_back({own_leaves_ + (node.index << node.level) - lo, node.level});
      own_leaves_ += ops::norm_leaves(piece.numel());
    }
  }

  // Whether every piece of this rank is a whole parameter and no exchange is needed (a
  // replicated table, or one rank): each parameter's sums then come from its piece alone, and
  // a fused step may form them itself with the same tree (ops::larc_sgd_step_tree).
  bool pieces_whole() const {
    if (comm_ != nullptr) return false;
    for (const auto& piece : table_->pieces(rank_))
      if (piece.param_begin != 0 || piece.numel() != table_->params()[piece.param].numel)
        return false;
    return true;
  }

  // Per operand list (one 1-D f32 view per piece of this rank, in pieces() order), the sum of
  // squares of every table parameter: out[k][param]. Collective when the table is sharded.
  // Parameters no rank reported (a replicated table reports all) stay 0.
  std::vector<std::vector<double>> sums(const std::vector<std::vector<Tensor>>& operands) {
    return sums_on(*ctx_, operands);
  }

  // The same with the leaf sums formed on `compute` (CPU offload: the host context, over views
  // in host memory); the exchange still travels on this object's context, where the
  // communicator's buffers live.
  std::vector<std::vector<double>> sums_on(Context& compute,
                                           const std::vector<std::vector<Tensor>>& operands) {
    const auto& pieces = table_->pieces(rank_);
    const std::size_t n_ops = operands.size();
    for (const auto& views : operands)
      check(views.size() == pieces.size(), "ParamNorms::sums: ", views.size(), " views for ",
            pieces.size(), " pieces; pass one per piece");
    const std::int64_t total = own_leaves_;  // per operand list (the leaf ops check the sizes)
    // Every list's leaf sums, row k list k's: params and grads in one pass when both are asked
    // (their pieces have the same sizes), else a pass per list. Read in place from host memory.
    // Then this rank's cover values, operand after operand, piece after piece, each node
    // formed where the leaves lie: a device sends back a few values per piece, not every leaf.
    std::vector<double> mine;
    if (total > 0) {
      Tensor leaves = empty(compute, {static_cast<std::int64_t>(n_ops), total}, DType::f64,
                            MemoryCategory::other);
      if (n_ops == 2) {
        ops::leaf_sums_of_squares(compute, operands[0], operands[1], leaves);
      } else {
        for (std::size_t k = 0; k < n_ops; ++k)
          ops::leaf_sums_of_squares(compute, operands[k],
                                    leaves.select(0, static_cast<std::int64_t>(k)));
      }
      std::vector<ops::NormSubtree> nodes;  // list k's nodes lie in row k
      nodes.reserve(own_nodes_.size() * n_ops);
      for (std::size_t k = 0; k < n_ops; ++k)
        for (const auto& node : own_nodes_)
          nodes.push_back({static_cast<std::int64_t>(k) * total + node.first, node.level});
      Tensor values = empty(compute, {static_cast<std::int64_t>(nodes.size())}, DType::f64,
                            MemoryCategory::other);
      ops::norm_subtree_sums(compute, leaves, nodes, values);
      mine = to_vector<double>(compute, values);
    }
    // Every rank's values, in the same order (counts follow from the table).
    std::vector<std::vector<double>> by_rank(static_cast<std::size_t>(table_->world_size()));
    if (comm_ != nullptr) {
      std::vector<std::size_t> counts;
      std::size_t before = 0, everything = 0;
      for (int r = 0; r < table_->world_size(); ++r) {
        counts.push_back(cover_counts_[static_cast<std::size_t>(r)] * n_ops);
        if (r < rank_) before += counts.back();
        everything += counts.back();
      }
      std::vector<double> gathered(everything, 0.0);
      std::copy(mine.begin(), mine.end(), gathered.begin() + static_cast<std::ptrdiff_t>(before));
      if (everything > 0) {
        Tensor wire = from_vector(*ctx_, gathered, {static_cast<std::int64_t>(everything)});
        comm_->all_gather_v(wire, counts).wait_on_stream();
        gathered = to_vector<double>(*ctx_, wire);
      }
      std::size_t offset = 0;
      for (int r = 0; r < table_->world_size(); ++r) {
        auto& values = by_rank[static_cast<std::size_t>(r)];
        values.assign(gathered.begin() + static_cast<std::ptrdiff_t>(offset),
                      gathered.begin() + static_cast<std::ptrdiff_t>(
                                             offset + counts[static_cast<std::size_t>(r)]));
        offset += counts[static_cast<std::size_t>(r)];
      }
    } else {
      by_rank[static_cast<std::size_t>(rank_)] = std::move(mine);
    }
    // Finish every parameter's tree from the covers that arrived.
    const std::size_t params = table_->params().size();
    std::vector<std::vector<std::map<ops::NormNode, double>>> known(
        n_ops, std::vector<std::map<ops::NormNode, double>>(params));
    for (int r = 0; r < table_->world_size(); ++r) {
      const auto& values = by_rank[static_cast<std::size_t>(r)];
      if (values.empty()) continue;
      std::size_t next = 0;
      const auto& rank_pieces = table_->pieces(r);
      for (std::size_t k = 0; k < n_ops; ++k)
        for (std::size_t q = 0; q < rank_pieces.size(); ++q)
          for (const auto& node : covers_[static_cast<std::size_t>(r)][q])
            known[k][rank_pieces[q].param][node] = values[next++];
    }
    std::vector<std::vector<double>> out(n_ops, std::vector<double>(params, 0.0));
    for (std::size_t k = 0; k < n_ops; ++k)
      for (std::size_t p = 0; p < params; ++p)
        if (!known[k][p].empty())
          out[k][p] = ops::norm_root(ops::norm_leaves(table_->params()[p].numel), known[k][p]);
    return out;
  }

 private:
  Context* ctx_;
  const shard::PieceTable* table_;
  int rank_;
  comm::Communicator* comm_ = nullptr;
  std::vector<std::vector<std::vector<ops::NormNode>>> covers_;  // [rank][piece]
  std::vector<std::size_t> cover_counts_;                        // nodes per operand, per rank
  std::int64_t own_leaves_ = 0;              // this rank's leaf sums per operand list
  std::vector<ops::NormSubtree> own_nodes_;  // its cover nodes among them, piece by piece
};

}  // namespace shardkit::optim
