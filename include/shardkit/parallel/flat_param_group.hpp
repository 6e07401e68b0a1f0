// FlatParamGroup: one flat parameter (what FSDP2 calls a parameter group) -- its ShardPlan, this
// rank's storage of it with one view per parameter, the pieces this rank's optimizer updates,
// and the collectives that keep the ranks' copies in step. DataParallel is one group under a
// stage policy; FSDP is one group per unit.
//
// The buffer's dtype is the compute dtype: f32, or f16/bf16 under mixed precision (the f32
// master then lives in the sharded optimizer, for the pieces each rank updates).
//
// Residency::replicated (ddp, oss, sdp): every rank keeps the whole flat buffer, counted as
// parameters. Residency::sharded (fsdp): a rank keeps only its even 1/N shard (parameters);
// the whole buffer (communication) exists between gather() and release(), and the parameter
// views keep naming it while it is released (core/storage.hpp), so touching them then fails
// with the reason given to release(). With a `shard_home` context (FSDP's parameter offload) the
// shard lives in that context's (host) memory and goes up into the gathered buffer at each
// gather.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/parallel/flat_buffer.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/shard/shard_plan.hpp"

namespace shardkit::parallel {

// Ranks compare a fingerprint (as two exact 32-bit halves in f64) with one max all-reduce of
// the values and their negatives; `what` says what differs and how to fix it.
inline void check_same_fingerprint(Context& ctx, comm::Communicator& comm, std::uint64_t print,
                                   std::string_view what) {
  std::vector<double> values = {
      static_cast<double>(print >> 32), static_cast<double>(print & 0xffffffffu),
      -static_cast<double>(print >> 32), -static_cast<double>(print & 0xffffffffu)};
  Tensor t = from_vector(ctx, values, {4});
  comm.all_reduce(t, comm::ReduceOp::max).wait();
  const auto reduced = to_vector<double>(ctx, t);
  check(reduced[0] == -reduced[2] && reduced[1] == -reduced[3], what, " (rank ", comm.rank(),
        " has fingerprint ", print, ")");
}

// The parameters of a group of ranks as one flat buffer, partitioned by a ShardPlan over `comm`.
// Under hybrid sharding (comm/hybrid_mesh.hpp) `comm` is this rank's shard group and
// `replicas` the ranks that hold the same range in the other groups: broadcasts and checks
// then reach every rank of the world, gathers stay inside the group.
class FlatParamGroup {
 public:
  FlatParamGroup(Context& ctx, comm::Communicator& comm, const std::vector<shard::ParamSpec>& specs,
                 shard::PartitionKind partition, Residency residency = Residency::replicated,
                 DType dtype = DType::f32, comm::Communicator* replicas = nullptr,
                 Context* shard_home = nullptr)
      : ctx_(&ctx),
        comm_(&comm),
        replicas_(replicas != nullptr && replicas->size() > 1 ? replicas : nullptr),
        residency_(residency),
        plan_(specs, comm.size(), checked_partition(partition, residency)),
        params_(ctx, plan_.layout(), dtype,
                residency == Residency::replicated ? MemoryCategory::parameters
                                                   : MemoryCategory::communication) {
    check(shard_home == nullptr || residency == Residency::sharded,
          "FlatParamGroup: a shard home is for sharded residency (fsdp)");
    if (residency == Residency::sharded)
      shard_ = zeros(shard_home != nullptr ? *shard_home : ctx, {plan_.numel(comm.rank())}, dtype,
                     MemoryCategory::parameters);
  }

  DType dtype() const { return params_.dtype(); }

  // Sets every parameter from exact f32 values on every rank: fill(i, view) writes parameter i
  // into an f32 view, rank `root`'s values are broadcast, and the group keeps them in its
  // dtype (rounded under mixed precision); master(k, values) receives the f32 values of
  // updated piece k (`pieces`, e.g. for the optimizer's master; without mixed precision they
  // are the buffer's own). The whole buffer must be there (gathered). Without mixed precision
  // the values go straight into the buffer.
  template <class Fill, class Master>
  void set_from_f32(Fill&& fill, Master&& master, const std::vector<shard::ParamPiece>& pieces,
                    int root) {
    const Tensor& flat = params_.flat();
    const bool low = flat.dtype() != DType::f32;
    Tensor wide =
        low ? zeros(*ctx_, flat.shape(), DType::f32, MemoryCategory::communication) : flat;
    if (!low) fill_zero();  // the padding too: no undefined bytes anywhere
    const auto& layout = plan_.layout();
    for (std::size_t i = 0; i < layout.size(); ++i)
      fill(i, wide.flat_view(layout[i].offset, layout[i].shape));
    broadcast_from(wide, root);
    for (std::size_t k = 0; k < pieces.size(); ++k)
      master(k, wide.slice(0, pieces[k].flat_begin, pieces[k].flat_begin + pieces[k].numel()));
    if (low) copy(*ctx_, flat, wide);
    if (sharded()) copy_range_to_shard();
  }
  void fill_zero() { fill(*ctx_, params_.flat(), 0.0); }

  FlatParamGroup(const FlatParamGroup&) = delete;
  FlatParamGroup& operator=(const FlatParamGroup&) = delete;

  const shard::ShardPlan& plan() const { return plan_; }
  const parallel::FlatBuffer& params() const { return params_; }
  const Tensor& param(std::size_t i) const { return params_[i]; }

  // The pieces this rank updates: every trainable parameter when `replicated` (DDP), else the
  // rank's range of the plan. Views of their parameter elements: piece_params().
  std::vector<shard::ParamPiece> updated_pieces(bool replicated) const {
    if (!replicated) return plan_.pieces(comm_->rank());
    std::vector<shard::ParamPiece> all;
    for (auto i : plan_.trainable_in_layout_order()) {
      const auto& slot = plan_.layout()[i];
      all.push_back(shard::ParamPiece{i, 0, slot.numel, slot.offset});
    }
    return all;
  }
  // Sharded: views of the shard, which the optimizer updates in place.
  std::vector<Tensor> piece_params(const std::vector<shard::ParamPiece>& pieces) const {
    std::vector<Tensor> views;
    const std::int64_t base = sharded() ? plan_.begin(comm_->rank()) : 0;
    const Tensor& values = sharded() ? shard_ : params_.flat();
    for (const auto& piece : pieces)
      views.push_back(
          values.slice(0, piece.flat_begin - base, piece.flat_begin - base + piece.numel()));
    return views;
  }

  bool sharded() const { return residency_ == Residency::sharded; }
  // This rank's shard of the flat buffer (sharded residency).
  const Tensor& shard() const { return shard_; }

  // Makes every rank's parameters equal to `root`'s (a world rank under hybrid sharding).
  // Sharded: from the gathered buffer (fill it with gather_from_values() first), and the shard
  // takes this rank's range.
  void broadcast(int root) {
    broadcast_from(params_.flat(), root);
    if (sharded()) copy_range_to_shard();
  }

  // `values` <- world rank `root`'s, on every rank. Hybrid: world rank g * G + s is rank s of
  // group g (HybridMesh's layout), so root's column first carries it to every group, then each
  // group's rank s to the group.
  void broadcast_from(const Tensor& values, int root) {
    const int group = comm_->size();
    if (replicas_ != nullptr) {
      check(root >= 0 && root < group * replicas_->size(), "broadcast: root ", root,
            " is not a rank of the world of ", group * replicas_->size(), " ranks");
      replicas_->broadcast(values, root / group).wait();
      root %= group;
    }
    comm_->broadcast(values, root).wait();
  }
  comm::Communicator* replicas() const { return replicas_; }

  // Sharded residency. gather(): the whole buffer back (this rank's shard copied in, the others
  // all-gathered); the returned work completes it (wait before use: prefetch overlaps it).
  [[nodiscard]] comm::Work gather() {
    materialize();
    const int rank = comm_->rank();
    // (Stream-ordered before the all-gather; an offloaded shard goes up without blocking.)
    copy_async(*ctx_, params_.flat().slice(0, plan_.begin(rank), plan_.end(rank)), shard_);
    return comm_->all_gather_v(params_.flat().slice(0, 0, plan_.trainable_end()), plan_.counts());
  }
  // The whole buffer's memory back, its values undefined (to be written whole, then
  // broadcast).
  void materialize() { params_.flat().storage()->materialize(); }
  // Frees the whole buffer; `reason` is what a later use of a parameter view says.
  void release(std::string reason) { params_.flat().storage()->release(std::move(reason)); }
  bool gathered() const { return !params_.flat().storage()->released(); }
  // After the caller wrote full values into the gathered buffer: take this rank's range.
  void copy_range_to_shard() {
    const int rank = comm_->rank();
    copy(*ctx_, shard_, params_.flat().slice(0, plan_.begin(rank), plan_.end(rank)));
  }

  // Owners send their updated ranges to everyone: one all_gather_v over the rank-ordered
  // ranges. With `f16_wire` only the wire is f16: every rank's f32 master of its own range
  // stays exact (FairScale's broadcast_fp16 rounds it).
  void all_gather_owned(bool f16_wire) {
    const int rank = comm_->rank();
    const auto counts = plan_.counts();
    const Tensor trainable = params_.flat().slice(0, 0, plan_.trainable_end());
    if (!f16_wire || trainable.dtype() != DType::f32) {  // (a 16-bit buffer travels as it is)
      comm_->all_gather_v(trainable, counts).wait();
      return;
    }
    Tensor wire = empty(*ctx_, {plan_.trainable_end()}, DType::f16, MemoryCategory::communication);
    copy(*ctx_, wire.slice(0, plan_.begin(rank), plan_.end(rank)),
         trainable.slice(0, plan_.begin(rank), plan_.end(rank)));
    comm_->all_gather_v(wire, counts).wait();
    for (int r = 0; r < comm_->size(); ++r)
      if (r != rank && plan_.numel(r) > 0)
        copy(*ctx_, trainable.slice(0, plan_.begin(r), plan_.end(r)),
             wire.slice(0, plan_.begin(r), plan_.end(r)));
  }

  // A parameter list that differs between ranks would make every collective wrong.
  void check_same_everywhere() {
    const std::string_view what =
        "the parameter list differs between ranks (names, shapes, order or trainable flags); "
        "build the same model on every rank";
    check_same_fingerprint(*ctx_, *comm_, plan_.layout().fingerprint(), what);
    if (replicas_ != nullptr)
      check_same_fingerprint(*ctx_, *replicas_, plan_.layout().fingerprint(), what);
  }

 private:
  static shard::PartitionKind checked_partition(shard::PartitionKind partition,
                                                Residency residency) {
    check(residency == Residency::replicated || partition == shard::PartitionKind::flat,
          "sharded parameters (fsdp) use the even flat split; got the ",
          shard::partition_kind_name(partition), " partition");
    return partition;
  }

  Context* ctx_;
  comm::Communicator* comm_;
  comm::Communicator* replicas_;  // hybrid sharding's other groups (nullptr: none)
  Residency residency_;
  shard::ShardPlan plan_;
  parallel::FlatBuffer params_;
  Tensor shard_;  // sharded residency: this rank's range, the master copy
};

}  // namespace shardkit::parallel
