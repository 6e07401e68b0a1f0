// ParamNorms: the sum of squares of every whole parameter of a PieceTable, from the pieces the
// ranks hold, with the same bits under every stage and world size (ops/norm_tree.hpp): what
// LARC's trust ratios and global-norm gradient clipping need.
//
// Each rank forms the leaf sums of its pieces (one backend pass over all of them), the values
// of its pieces' covers (a second backend pass, where the leaves lie), and -- when the table is
// sharded over several ranks -- one all_gather_v exchanges every rank's cover values (a few per
// piece: their number follows from the table alone, so nothing else is sent). Every rank then
// finishes every parameter's tree where the values are (ops::norm_roots, with programs written
// once per layout: NormRootPlan), so a step's norms need the host for nothing but launches. A
// replicated table (DDP) needs no exchange.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
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
    // (Without it every rank would clip by the norm of its own parameters: each its own
    // coefficient, and the replicas drift apart.)
    check(comm != nullptr || table.replicated() || table.world_size() == 1,
          "ParamNorms: a table sharded over ", table.world_size(),
          " ranks needs the communicator that joins them, got none; pass the shard group's");
    check(comm == nullptr || table.replicated() || comm->size() == table.world_size(),
          "ParamNorms: a table sharded over ", table.world_size(),
          " ranks, with a communicator of ", comm == nullptr ? 0 : comm->size(),
          "; pass the shard group's communicator");
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

  // How roots() lays out its sums: [operand list][table parameter], or [operand list][piece
  // of this rank] (pieces() order: what a per-piece step such as LARC's coefficients reads).
  enum class Layout { params, pieces };

  // Per operand list (one 1-D f32 view per piece of this rank, in pieces() order), the sum of
  // squares of every table parameter (or of the parameter of each of this rank's pieces) into
  // `out` (f64 [operand lists, params or pieces], contiguous, on `compute`'s device), formed,
  // exchanged and finished on the devices: nothing is read back or uploaded once the first
  // call has set up its plans, unless `compute` is another device than this object's context
  // (CPU offload: the leaf sums formed on the host context over views in host memory, the
  // cover values crossing to the exchange on this object's context, the sums back). Collective
  // when the table is sharded. Parameters no rank reported (a replicated table reports all)
  // stay 0.
  void roots(Context& compute, const std::vector<std::vector<Tensor>>& operands, Layout layout,
             const Tensor& out) {
    const auto& pieces = table_->pieces(rank_);
    const std::size_t n_ops = operands.size();
    for (const auto& views : operands)
      check(views.size() == pieces.size(), "ParamNorms::roots: ", views.size(), " views for ",
            pieces.size(), " pieces; pass one per piece");
    const std::int64_t total = own_leaves_;  // per operand list (the leaf ops check the sizes)
    // Every list's leaf sums, row k list k's: params and grads in one pass when both are asked
    // (their pieces have the same sizes), else a pass per list. Read in place from host memory.
    // Then this rank's cover values, operand after operand, piece after piece, each node
    // formed where the leaves lie: a device exchanges a few values per piece, not every leaf.
    Tensor mine;
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
      const Subtrees& nodes = subtrees(compute, n_ops, total);
      mine = empty(compute, {static_cast<std::int64_t>(nodes.list.size())}, DType::f64,
                   MemoryCategory::other);
      ops::norm_subtree_sums(compute, leaves, nodes.list, mine, nodes.on_device);
    }
    // Every rank's values in one array, rank after rank (counts follow from the table), on
    // this object's context; the trees are finished where the values are.
    Context* where = &compute;
    Tensor values = mine;
    if (comm_ != nullptr) {
      std::vector<std::size_t> counts;
      std::size_t before = 0, everything = 0;
      for (int r = 0; r < table_->world_size(); ++r) {
        counts.push_back(cover_counts_[static_cast<std::size_t>(r)] * n_ops);
        if (r < rank_) before += counts.back();
        everything += counts.back();
      }
      where = ctx_;
      values =
          empty(*ctx_, {static_cast<std::int64_t>(everything)}, DType::f64, MemoryCategory::other);
      if (mine.defined())
        copy(*ctx_,
             values.slice(0, static_cast<std::int64_t>(before),
                          static_cast<std::int64_t>(before) + mine.numel()),
             mine);
      if (everything > 0) comm_->all_gather_v(values, counts).wait_on_stream();
    }
    const ops::NormRootPlan& plan = plan_for(*where, n_ops, layout);
    if (where->device() == compute.device() && out.device() == compute.device())
      return ops::norm_roots(compute, values, plan, out);
    // (`out` elsewhere: clipping's sums of gradients kept on the host go to the device)
    if (out.device() == where->device()) return ops::norm_roots(*where, values, plan, out);
    Tensor finished = empty(*where, out.shape(), DType::f64, MemoryCategory::other);
    ops::norm_roots(*where, values, plan, finished);
    copy(*ctx_, out, finished);
  }

 private:
  // This rank's cover nodes among its leaf sums for n_ops lists, and the same on a device.
  struct Subtrees {
    std::vector<ops::NormSubtree> list;
    Tensor on_device;  // i64 [nodes, 2], on the device of the context they were made for
  };

  const Subtrees& subtrees(Context& compute, std::size_t n_ops, std::int64_t total) {
    const Key key{n_ops, 0, compute.device().str()};
    auto found = subtrees_.find(key);
    if (found != subtrees_.end()) return found->second;
    Subtrees made;  // list k's nodes lie in row k
    made.list.reserve(own_nodes_.size() * n_ops);
    std::vector<std::int64_t> pairs;
    for (std::size_t k = 0; k < n_ops; ++k)
      for (const auto& node : own_nodes_) {
        made.list.push_back({static_cast<std::int64_t>(k) * total + node.first, node.level});
        pairs.push_back(made.list.back().first);
        pairs.push_back(node.level);
      }
    if (!made.list.empty())
      made.on_device =
          from_vector(compute, pairs, {static_cast<std::int64_t>(made.list.size()), 2});
    return subtrees_.emplace(key, std::move(made)).first->second;
  }

  // The programs that finish every root of `layout` for n_ops lists from the values laid out
  // as roots() lays them (rank after rank when exchanging, else this rank's alone; in each
  // rank's part list after list, piece after piece, node after node), uploaded to `where`.
  const ops::NormRootPlan& plan_for(Context& where, std::size_t n_ops, Layout layout) {
    const Key key{n_ops, layout == Layout::params ? 1 : 2, where.device().str()};
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    const std::size_t params = table_->params().size();
    std::vector<std::vector<std::map<ops::NormNode, std::int64_t>>> known(
        n_ops, std::vector<std::map<ops::NormNode, std::int64_t>>(params));
    std::int64_t next = 0;
    for (int r = 0; r < table_->world_size(); ++r) {
      if (comm_ == nullptr && r != rank_) continue;
      const auto& rank_pieces = table_->pieces(r);
      for (std::size_t k = 0; k < n_ops; ++k)
        for (std::size_t q = 0; q < rank_pieces.size(); ++q)
          for (const auto& node : covers_[static_cast<std::size_t>(r)][q])
            known[k][rank_pieces[q].param][node] = next++;
    }
    ops::NormRootPlan plan;
    for (std::size_t k = 0; k < n_ops; ++k) {
      auto add = [&](std::size_t p) {
        plan.add_root(ops::norm_leaves(table_->params()[p].numel), known[k][p]);
      };
      if (layout == Layout::params) {
        for (std::size_t p = 0; p < params; ++p) add(p);
      } else {
        for (const auto& piece : table_->pieces(rank_)) add(piece.param);
      }
    }
    plan.upload(where);
    return plans_.emplace(key, std::move(plan)).first->second;
  }

  // (operand lists, what, device): the set-ups kept from one step to the next.
  using Key = std::tuple<std::size_t, int, std::string>;

  Context* ctx_;
  const shard::PieceTable* table_;
  int rank_;
  comm::Communicator* comm_ = nullptr;
  std::vector<std::vector<std::vector<ops::NormNode>>> covers_;  // [rank][piece]
  std::vector<std::size_t> cover_counts_;                        // nodes per operand, per rank
  std::int64_t own_leaves_ = 0;              // this rank's leaf sums per operand list
  std::vector<ops::NormSubtree> own_nodes_;  // its cover nodes among them, piece by piece
  std::map<Key, Subtrees> subtrees_;
  std::map<Key, ops::NormRootPlan> plans_;
};

}  // namespace shardkit::optim
