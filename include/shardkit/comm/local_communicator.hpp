// LocalCommunicator: one rank of a LocalWorld (N ranks as N threads of one process, each with
// its own Context). Reductions run in rank order, so results are bitwise reproducible. Device
// collectives across ranks can be captured in a step graph (comm/device_rendezvous.hpp).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/local_world.hpp"
#include "shardkit/comm/rank_share.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/storage.hpp"

namespace shardkit::comm {

namespace detail {

// Waits for `op`; a timeout's message also lists this rank's last calls (`recorder`).
inline void wait_for(LocalWorld& world, LocalOp& op, int rank, std::chrono::milliseconds timeout,
                     const FlightRecorder& recorder) {
  try {
    world.wait(op, rank, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(shardkit::detail::concat(e.what(), "; ", recorder.recent()));
  }
}

// A host call in flight: waits on the world.
class LocalWorkState final : public WorkState {
 public:
  LocalWorkState(std::shared_ptr<LocalWorld> world, std::shared_ptr<LocalOp> op, int rank,
                 std::chrono::milliseconds timeout, std::shared_ptr<const FlightRecorder> recorder)
      : world_(std::move(world)),
        op_(std::move(op)),
        rank_(rank),
        timeout_(timeout),
        recorder_(std::move(recorder)) {}
  void wait() override { wait_for(*world_, *op_, rank_, timeout_, *recorder_); }
  bool test() override { return world_->test(*op_); }
  void on_drop() noexcept override { world_->drop(*op_, rank_); }

 private:
  std::shared_ptr<LocalWorld> world_;
  std::shared_ptr<LocalOp> op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const FlightRecorder> recorder_;
};

#if SK_WITH_CUDA
// A device call: already ordered on the rank's stream; wait() also blocks the host until done.
class EventWorkState final : public WorkState {
 public:
  explicit EventWorkState(std::shared_ptr<CudaEvent> done) : done_(std::move(done)) {}
  void wait() override { done_->synchronize(); }
  bool test() override { return done_->query(); }
  // submit() made the rank's stream wait for `done`.
  void wait_on_stream() override {}

 private:
  std::shared_ptr<CudaEvent> done_;
};

// A call inside a captured step: queued on the rank's own stream, which orders its consumers;
// a host wait (after the step) waits for the stream.
class StreamWorkState final : public WorkState {
 public:
  explicit StreamWorkState(const Context& ctx) : ctx_(ctx) {}
  void wait() override {
    CudaDeviceGuard guard(ctx_.device().index);
    SK_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream()));
  }
  bool test() override {
    if (ctx_.capturing()) return false;  // queued into the graph: nothing has run yet
    CudaDeviceGuard guard(ctx_.device().index);
    const cudaError_t status = cudaStreamQuery(ctx_.stream());
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    SK_CUDA_CHECK(status);
    return true;
  }
  void wait_on_stream() override {}

 private:
  const Context& ctx_;
};
#endif

}  // namespace detail

class LocalCommunicator final : public Communicator {
 public:
  // Rank `rank` of `world`; every rank of the world needs its own communicator (and Context).
  LocalCommunicator(Context& ctx, std::shared_ptr<LocalWorld> world, int rank,
                    CommOptions options = {})
      : Communicator(rank, checked(world)->size(), options), ctx_(ctx), world_(std::move(world)) {}

  // A world of one rank: every collective is a copy (what a program run without a launcher gets).
  static std::unique_ptr<LocalCommunicator> single(Context& ctx, CommOptions options = {}) {
    return std::make_unique<LocalCommunicator>(ctx, std::make_shared<LocalWorld>(1), 0, options);
  }

  std::string_view backend() const override { return "local"; }
  const std::shared_ptr<LocalWorld>& world() const { return world_; }
  // Fails every pending and later call of this world (and its splits) with `reason`.
  void abort(const std::string& reason) { world_->abort(reason); }

 protected:
  std::string aborted_reason() const override { return world_->aborted_reason(); }

  Work do_all_reduce(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    return submit(make_post(CollectiveKind::all_reduce, send, recv, op));
  }
  Work do_reduce(const Buffer& send, const Buffer& recv, int root, ReduceOp op) override {
    return submit(make_post(CollectiveKind::reduce, send, recv, op, root));
  }
  Work do_broadcast(const Buffer& data, int root) override {
    return submit(make_post(CollectiveKind::broadcast, data, data, ReduceOp::sum, root));
  }
  Work do_all_gather(const Buffer& send, const Buffer& recv) override {
    return submit(make_post(CollectiveKind::all_gather, send, recv));
  }
  Work do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    return submit(make_post(CollectiveKind::reduce_scatter, send, recv, op));
  }
  Work do_all_gather_v(const Buffer& data, std::span<const std::size_t> counts) override {
    return submit(make_post(CollectiveKind::all_gather_v, data, data, ReduceOp::sum, 0, counts));
  }
  Work do_reduce_scatter_v(const Buffer& send, const Buffer& recv,
                           std::span<const std::size_t> counts, ReduceOp op) override {
    return submit(make_post(CollectiveKind::reduce_scatter_v, send, recv, op, 0, counts));
  }
  Work do_all_to_all_v(const Buffer& send, const Buffer& recv,
                       std::span<const std::size_t> counts) override {
    return submit(make_post(CollectiveKind::all_to_all_v, send, recv, ReduceOp::sum, 0, counts));
  }
  // Host memory, or (in a build with CUDA) memory of this rank's GPU, whose stream the call
  // runs on.
  void do_check_buffers(std::string_view call, std::span<const Buffer> buffers) const override {
    const Device device = buffers.front().device;
    if (!device.is_cuda()) return;
#if SK_WITH_CUDA
    check(device == ctx_.device(), where(call), ": buffers on ", device,
          " but this rank's context is on ", ctx_.device(),
          "; device collectives run on the context's stream: use that GPU's memory");
#else
    fail<NotAvailable>(where(call), ": buffers on ", device,
                       " in a build without CUDA; pass host memory");
#endif
  }
  // The order check: the posts of a call meet in one operation and are compared there
  // (local_validation.hpp); what the shapes cannot tell, the label, goes with the next post.
  void do_validate(const CallRecord& call) override {
    next_label_ = call.label;
    next_labelled_ = true;
  }
  LocalPost labelled(LocalPost post) {
    if (std::exchange(next_labelled_, false)) {
      post.labelled = true;
      post.label = std::move(next_label_);
    }
    return post;
  }

  void do_barrier() override {
    auto op = world_->post(rank(), next_sequence_++, "barrier", call_number(),
                           labelled(make_post(CollectiveKind::barrier, {}, {})), nullptr);
    detail::wait_for(*world_, *op, rank(), options().timeout, *recorder());
  }
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    LocalPost post;
    post.is_split = true;
    post.color = color;
    post.key = key;
    auto op = world_->post(rank(), next_sequence_++, "split", call_number(),
                           labelled(std::move(post)), nullptr);
    detail::wait_for(*world_, *op, rank(), options().timeout, *recorder());
    const auto index = static_cast<std::size_t>(rank());
    if (!op->split_worlds[index]) return nullptr;
    return std::make_unique<LocalCommunicator>(ctx_, op->split_worlds[index],
                                               op->split_ranks[index], options());
  }

 private:
  static const std::shared_ptr<LocalWorld>& checked(const std::shared_ptr<LocalWorld>& world) {
    check(world != nullptr, "LocalCommunicator needs a LocalWorld; got none");
    return world;
  }

  static LocalPost make_post(CollectiveKind kind, const Buffer& send, const Buffer& recv,
                             ReduceOp op = ReduceOp::sum, int root = 0,
                             std::span<const std::size_t> counts = {}) {
    LocalPost post;
    post.kind = kind;
    post.send = send;
    post.recv = recv;
    post.op = op;
    post.root = root;
    post.counts.assign(counts.begin(), counts.end());
    return post;
  }

  Work submit(LocalPost unlabelled) {
    LocalPost post = labelled(std::move(unlabelled));
    const std::string_view call = collective_name(post.kind);
    if (post.send.device.is_cuda()) {
#if SK_WITH_CUDA
      if (size() > 1 && ctx_.capturing()) return submit_captured(call, std::move(post));
      auto ready = std::make_shared<CudaEvent>(ctx_.device().index);
      ready->record(ctx_.stream());
      auto op = world_->post(rank(), next_sequence_++, call, call_number(), std::move(post), ready);
      detail::wait_for(*world_, *op, rank(), options().timeout, *recorder());
      CudaDeviceGuard guard(ctx_.device().index);
      SK_CUDA_CHECK(cudaStreamWaitEvent(ctx_.stream(), op->done->get(), 0));
      return Work(std::make_shared<detail::EventWorkState>(op->done), ctx_);
#endif
    }
    auto op = world_->post(rank(), next_sequence_++, call, call_number(), std::move(post), nullptr);
    return Work(std::make_shared<detail::LocalWorkState>(world_, std::move(op), rank(),
                                                         options().timeout, recorder()),
                ctx_);
  }

#if SK_WITH_CUDA
  // The ranks' host threads meet just before and just after each run of a graph holding this
  // world's captured collectives (Context::around_each_run). Their graphs wait for each other on
  // the device, and a host call may wait for the whole device (a page-locked or device
  // allocation, cudaFree, a module's load: CUDA's implicit synchronisations); one made on a
  // rank while another rank's graph waits on the device for this rank's graph, not launched
  // yet, would wait until the world's timeout. Meeting before the launches keeps every rank's
  // other host work out of the time a graph of the world waits; meeting after them, until
  // every rank's graph is launched. Not counted as a collective (no bytes, no HostWaits).
  // (The graph holds this communicator as it holds its buffers' addresses: replaying it after
  // the communicator is gone is an error either way.)
  void meet_around_graph_run() {
    LocalPost post = make_post(CollectiveKind::barrier, {}, {});
    post.in_capture = true;  // tells the meeting from a user's barrier (local_validation.hpp)
    auto op = world_->post(rank(), next_sequence_++, "graph run meeting", LocalWorld::kNotACall,
                           std::move(post), nullptr);
    detail::wait_for(*world_, *op, rank(), options().timeout, *recorder());
  }

  // Inside a captured step the world's stream cannot join this rank's graph: the host meets the
  // other ranks once (checks, their buffers), and this rank's stream carries its own share of
  // the call between two waits on the device (comm/device_rendezvous.hpp).
  Work submit_captured(std::string_view call, LocalPost post) {
    post.in_capture = true;
    auto op = world_->post(rank(), next_sequence_++, call, call_number(), std::move(post), nullptr);
    detail::wait_for(*world_, *op, rank(), options().timeout, *recorder());
    const Buffer& recv = op->posts[static_cast<std::size_t>(rank())].recv;
    const RankShare share = rank_share(plan_transfers(op->posts), op->posts, rank());
    const DeviceCommKernels& kernels = *world_->kernels();
    const DeviceBarrierParams barrier = op->rendezvous->barrier(rank(), options().timeout);
    CudaDeviceGuard guard(ctx_.device().index);
    const cudaStream_t stream = ctx_.stream();
    kernels.flag_barrier(stream, barrier);  // every rank's inputs are ready
    if (share.staged) {
      // From the capture's pool, back to it (for the step's later allocations) after the copy.
      Storage scratch(ctx_.allocator_ptr(), recv.count * recv.element_size(),
                      MemoryCategory::communication);
      run_plan_on_device(staged_into(share, recv, scratch.data()), stream, &kernels, op->name,
                         size());
      kernels.flag_barrier(stream, barrier);  // every rank has read what this rank overwrites
      for (const auto& [offset, bytes] : share.written)
        SK_CUDA_CHECK(cudaMemcpyAsync(recv.bytes() + offset,
                                      static_cast<const std::byte*>(scratch.data()) + offset, bytes,
                                      cudaMemcpyDeviceToDevice, stream));
    } else {
      run_plan_on_device(share.plan, stream, &kernels, op->name, size());
      kernels.flag_barrier(stream, barrier);  // every rank has read this rank's send buffer
    }
    ctx_.around_each_run(
        rendezvous_key(), [this] { meet_around_graph_run(); },
        // A run that failed on this rank between the meetings: the others learn why at once.
        [weak = std::weak_ptr<LocalWorld>(world_), rank = rank()](const std::string& reason) {
          if (auto world = weak.lock())
            world->abort(shardkit::detail::concat("rank ", rank,
                                                  "'s run of a captured step failed: ", reason));
        });
    ctx_.defer_check(rendezvous_key(),
                     [rendezvous = op->rendezvous, weak = std::weak_ptr<LocalWorld>(world_),
                      rank = rank(), timeout = options().timeout] {
                       try {
                         rendezvous->check(rank, timeout);
                       } catch (const TimeoutError& e) {
                         if (auto world = weak.lock()) world->abort(e.what());
                         throw;
                       }
                     });
    return Work(std::make_shared<detail::StreamWorkState>(ctx_), ctx_);
  }
#endif

  Context& ctx_;
  std::shared_ptr<LocalWorld> world_;
  std::uint64_t next_sequence_ = 0;
  std::string next_label_;  // the order check's label for the next post (do_validate)
  bool next_labelled_ = false;
#if SK_WITH_CUDA
  // The key of the rendezvous check a device call defers: the same for every call of the
  // world, made once instead of formatted at each call.
  const std::string& rendezvous_key() {
    if (rendezvous_key_.empty())
      rendezvous_key_ = shardkit::detail::concat("local device rendezvous ",
                                                 static_cast<const void*>(world_.get()));
    return rendezvous_key_;
  }
  std::string rendezvous_key_;
#endif
};

}  // namespace shardkit::comm
