// ParamGroup: one flat parameter at run time (FSDP2's FSDPParamGroup) -- its storage
// (FlatParam: plan, buffer, shard), its gradients (GradBucketer: buckets and readiness), what
// this rank's optimizer updates of it (pieces: their parameter views and averaged gradients),
// and, when sharded, its gather state (an all-gather in flight, started ahead of use). DDP, OSS
// and SDP run one group under a stage policy; FSDP runs one group per unit (engine.hpp).
//
// Its hooks, in the order a training step calls them (engine.hpp and unit_hooks.hpp call them;
// on a replicated group the gathers and releases are no-ops):
//
//   read_shard_ahead()  under offload to NVMe, start reading the shard from disk for a
//                    gather to come (FSDP's hooks: the unit after those gathered ahead)
//   start_gather()   begin the all-gather without waiting (prefetch)
//   gather()         the whole buffer there (waits for a prefetch in flight)
//   grad(i), ready(i)  the backward adds parameter i's gradient, then marks it final: complete
//                    buckets are reduced (all-reduce, or reduce-scatter into the owners' parts)
//   release()        frees the whole buffer (a prefetch nobody used is completed first, a
//                    read ahead nobody used dropped)
//   release_after_forward()  the same; with hpZ (a `node` communicator) this rank first keeps
//                    its slice of the buffer over the node, and the next gather -- the
//                    backward's -- is an all-gather inside the node from those slices
//   finish()         waits for every bucket: the pieces' averaged gradients are in place
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "shardkit/parallel/collectives.hpp"
#include "shardkit/parallel/flat_param.hpp"
#include "shardkit/parallel/grad_bucketer.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/reduce_scatter_coalescer.hpp"
#include "shardkit/parallel/tensor_scales.hpp"

namespace shardkit::parallel {

// A group's name and its parameters (names, shapes, trainable flags), in registration order.
struct ParamGroupSpec {
  std::string name;
  std::vector<shard::ParamSpec> params;
};

class ParamGroup {
 public:
  // `shard_home`: FSDP's parameter offload keeps the shard in that (host) context. `coalescer`:
  // small buckets reduce-scattered together with other groups' (nullptr: each alone).
  // `node`: hpZ's group of consecutive ranks (comm split by rank / its size; nullptr: none).
  // `grads_home`: offload keeps the reduced gradients in that (host) context (reduce_scatter).
  ParamGroup(Context& ctx, comm::Communicator& comm, ParamGroupSpec spec,
             const ResolvedPolicy& policy, comm::Communicator* replicas = nullptr,
             Context* shard_home = nullptr, ReduceScatterCoalescer* coalescer = nullptr,
             comm::Communicator* node = nullptr, Context* grads_home = nullptr)
      : name_(std::move(spec.name)),
        node_(node),
        flat_(ctx, comm, spec.params, policy.partition, policy.residency, policy.param_dtype,
              replicas, shard_home),
        bucketer_(ctx, comm, flat_.plan(), policy.grad_sync, policy.buckets, coalescer, replicas,
                  grads_home),
        pieces_(flat_.updated_pieces(policy.every_rank_updates)),
        piece_params_(flat_.piece_params(pieces_)),
        quantized_block_(policy.quantized_gather_block),
        quantized_format_(policy.quantized_gather_format),
        quantized_scale_(policy.quantized_gather_scale) {
    for (const auto& piece : pieces_) piece_grads_.push_back(bucketer_.piece_grad(piece));
    if (flat_.sharded()) flat_.release(not_gathered_reason());
  }

  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  const std::string& name() const { return name_; }
  FlatParam& flat() { return flat_; }
  const FlatParam& flat() const { return flat_; }
  const shard::ShardPlan& plan() const { return flat_.plan(); }
  const Tensor& shard() const { return flat_.shard(); }
  std::size_t size() const { return flat_.plan().layout().size(); }
  // Parameter i's full values: a view of the buffer (touching it while released throws).
  const Tensor& param(std::size_t i) const { return flat_.param(i); }
  // What this rank's optimizer updates of the group: the pieces, their parameter views (the
  // shard's, when sharded) and their averaged gradients (after finish()).
  const std::vector<shard::ParamPiece>& pieces() const { return pieces_; }
  const std::vector<Tensor>& piece_params() const { return piece_params_; }
  const std::vector<Tensor>& piece_grads() const { return piece_grads_; }

  // --- gather / release ----------------------------------------------------------------------
  // The gathers of a training step: quantised under qwZ (the policy's quantized_gather_block).
  void start_gather() {
    if (!flat_.sharded() || flat_.gathered() || gathering_) return;
    try {
      begin_gather();
    } catch (...) {
      // (The buffer was materialised for the gather, its values undefined: released again,
      // the next gather starts over instead of finding the unit held -- after a refusal in a
      // capture, a failing disk's read.)
      if (!gathering_) flat_.release(not_gathered_reason());
      throw;
    }
  }
  // The shard read in from disk for the next gather (offload to NVMe), beside the work before
  // it; no-op where that gather will not read it -- the unit gathered or gathering, its next
  // gather hpZ's from the node's slices -- or where the shard is not in files.
  void read_shard_ahead() {
    if (!flat_.sharded() || holds_full() || node_slice_.defined()) return;
    flat_.read_shard_ahead();
  }
  void gather() {
    start_gather();
    if (!gathering_) return;
    pending_.wait_on_stream();
    gathering_ = false;
  }
  // The shards' exact values, whatever the gathers of a step carry (summon_full_params reads
  // and writes them back). Collective.
  void gather_exact() {
    gather();
    if (!flat_.sharded() || exact_) return;
    auto label = flat_.communicator().label(gather_label_);
    start_all_gather(flat_).wait();
    exact_ = true;
  }
  void release() {
    if (!flat_.sharded()) return;
    if (gathering_) {  // a prefetch nobody used: complete it before freeing its buffer
      pending_.wait_on_stream();
      gathering_ = false;
    }
    flat_.drop_read_ahead();  // (one nobody used: out of RAM again)
    flat_.release(not_gathered_reason());
  }
  // After a training forward: under hpZ this rank keeps its slice of the values over the node
  // (the gathered ones: quantised under qwZ, so the backward computes with what the forward
  // did), then frees the buffer; otherwise as release().
  void release_after_forward() {
    if (node_ != nullptr && flat_.sharded() && holds_full()) {
      gather();  // (a prefetch in flight: its values are the ones to keep)
      const std::int64_t slice = flat_.plan().trainable_end() / node_->size();
      const std::int64_t at = slice * node_->rank();
      node_slice_ = empty(flat_.context(), {slice}, flat_.dtype(), MemoryCategory::communication);
      copy(flat_.context(), node_slice_, flat_.params().flat().slice(0, at, at + slice));
      node_slice_exact_ = exact_;
    }
    release();
  }
  // The shards changed (a step, a load, values written): a kept node slice is stale.
  void forget_node_slice() { node_slice_ = Tensor(); }
  // Per-tensor-scaled qwZ: the step's gathers take their maxima from `scales` as unit `u`.
  void use_tensor_scales(TensorScales* scales, std::size_t u) {
    scales_ = scales;
    scales_unit_ = u;
  }
  // Gathered, or its gather in flight (always, when replicated).
  bool holds_full() const { return flat_.gathered() || gathering_; }

  // --- gradients -------------------------------------------------------------------------------
  Tensor grad(std::size_t i) { return bucketer_.grad(i); }
  void ready(std::size_t i) {
    auto label = flat_.communicator().label(reduce_label_);
    bucketer_.ready(i);
  }
  bool is_ready(std::size_t i) const { return bucketer_.is_ready(i); }
  bool all_ready() const { return bucketer_.all_ready(); }
  // Frees the buckets whose reductions completed (never blocks).
  void poll() { bucketer_.poll(); }
  void finish() {
    auto label = flat_.communicator().label(reduce_label_);
    bucketer_.finish();
  }
  bool finished() const { return bucketer_.finished(); }
  // Gradients kept on the host (offload): copies down await the host's wait; then land them.
  bool copies_pending() const { return bucketer_.copies_pending(); }
  void land_copies() { bucketer_.land_copies(); }
  void zero_grad() { bucketer_.zero_grad(); }
  bool backward_open() const { return bucketer_.backward_open(); }
  void abandon_backward() { bucketer_.abandon_backward(); }
  void follow_loss_scale(const Tensor& state) { bucketer_.follow_loss_scale(state); }
  void reset_error_feedback() { bucketer_.reset_error_feedback(); }
  void set_sync(bool enabled) { bucketer_.set_sync(enabled); }
  void restore_sync(bool enabled) { bucketer_.restore_sync(enabled); }
  bool sync_enabled() const { return bucketer_.sync_enabled(); }

 private:
  void begin_gather() {
    if (node_slice_.defined()) return start_node_gather();
    // (The scales first: computed for every unit when stale, a collective of its own.)
    const Tensor amax = scales_ != nullptr ? scales_->scales(scales_unit_) : Tensor();
    auto label = flat_.communicator().label(gather_label_);
    comm::assign(pending_, start_all_gather(flat_, quantized_block_, quantized_format_,
                                            quantized_scale_, amax));
    gathering_ = true;
    exact_ = quantized_block_ == 0;
  }
  // hpZ: the whole buffer from the node's slices, by an all-gather inside the node (in place:
  // this rank's slice is copied into its segment first); the slice is used once.
  void start_node_gather() {
    flat_.materialize();
    const std::int64_t slice = node_slice_.numel();
    const Tensor whole = flat_.params().flat().slice(0, 0, slice * node_->size());
    const Tensor own = whole.slice(0, slice * node_->rank(), slice * (node_->rank() + 1));
    copy_async(flat_.context(), own, node_slice_);
    auto label = node_->label(node_gather_label_);
    comm::assign(pending_, node_->all_gather(own, whole));
    gathering_ = true;
    exact_ = node_slice_exact_;
    node_slice_ = Tensor();
  }

  std::string not_gathered_reason() const {
    return "the parameters of FSDP unit '" + name_ +
           "' are not gathered: they exist only during the unit's forward and backward; run "
           "the module (its hooks gather them), or call gather() in a custom loop";
  }

  std::string name_;
  // What this group's collectives are labelled with (comm/call_record.hpp), made once.
  std::string gather_label_ = "unit '" + name_ + "': all-gather of its parameters";
  std::string reduce_label_ = "unit '" + name_ + "': gradient reduction";
  std::string node_gather_label_ = "unit '" + name_ + "': all-gather inside the node (hpZ)";
  comm::Communicator* node_;  // hpZ's group (nullptr: none)
  FlatParam flat_;
  GradBucketer bucketer_;
  std::vector<shard::ParamPiece> pieces_;  // what this rank updates, in table order
  std::vector<Tensor> piece_params_;
  std::vector<Tensor> piece_grads_;
  comm::Work pending_;  // an all-gather started ahead of use (prefetch)
  bool gathering_ = false;
  std::int64_t quantized_block_;       // qwZ's block for the step's gathers (0: exact)
  ops::QuantFormat quantized_format_;  // and its codes
  ops::QuantScale quantized_scale_;    // and what a scale covers
  bool exact_ = true;                  // the gathered values are the shards' own (not quantised)
  // hpZ: this rank's slice over the node of the values a training forward gathered, kept for
  // the backward's gather (undefined: none kept), and whether they were exact.
  Tensor node_slice_;
  bool node_slice_exact_ = true;
  TensorScales* scales_ = nullptr;  // per-tensor-scaled qwZ's maxima (nullptr: not scaled so)
  std::size_t scales_unit_ = 0;
};

}  // namespace shardkit::parallel
