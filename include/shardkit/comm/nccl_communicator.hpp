// NcclCommunicator: ranks are GPUs (one per process, any number of nodes), buffers are device
// memory of the context's GPU, calls are queued on the context's stream (stream-ordered: later
// kernels on that stream see the result; Work::wait() also blocks the host until done).
//
// Fault handling follows NCCL's non-blocking model: the communicator is created with
// config.blocking = 0, so neither init nor a collective can block the host forever; every wait
// polls ncclCommGetAsyncError, and when the timeout passes the communicator is aborted
// (ncclCommAbort) and sk::TimeoutError names the operation.
//
// Checked here: everything local (dtype, sizes, root, aliasing, the buffers' device). That peers
// issue the same calls (kind, dtype, counts, root, op) is checked with CommOptions::validate_order
// (nccl_order_check.hpp: the fingerprints exchanged on the stream, compared by the host without
// waiting); without it a mismatch may corrupt results or hang until the timeout. f16/bf16
// reductions run in NCCL's own arithmetic (it cannot accumulate in f32 without widening the data);
// NCCL refuses two ranks on one GPU.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/cuda_event.hpp"
#include "shardkit/comm/nccl_order_check.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/nccl_check.hpp"
#include "shardkit/core/storage.hpp"

namespace shardkit::comm {

namespace detail {

inline void nccl_status(ncclResult_t status, const char* call) {
  shardkit::detail::nccl_check(status, call, __FILE__, __LINE__);
}

// Owns the ncclComm_t; shared with the Work handles that poll it.
class NcclHandle {
 public:
  NcclHandle(ncclComm_t comm, std::chrono::milliseconds timeout) : comm_(comm), timeout_(timeout) {}
  ~NcclHandle() {
    if (comm_ == nullptr) return;
    // Finalize flushes pending work without blocking; wait for it up to the timeout, then abort.
    ncclResult_t state = ncclCommFinalize(comm_);
    const auto start = std::chrono::steady_clock::now();
    while (state == ncclInProgress && std::chrono::steady_clock::now() - start < timeout_) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess)
      (void)ncclCommDestroy(comm_);
    else
      (void)ncclCommAbort(comm_);
  }
  NcclHandle(const NcclHandle&) = delete;
  NcclHandle& operator=(const NcclHandle&) = delete;

  ncclComm_t get() const { return comm_; }
  const std::string& aborted() const { return aborted_; }

  // The order check, made by the communicator at its first checked call; null without one.
  NcclOrderCheck* order_check() const { return order_.get(); }
  void set_order_check(std::unique_ptr<NcclOrderCheck> check) { order_ = std::move(check); }

  // Throws InvalidArgument (after aborting: the calls after a mismatch may be queued already)
  // when a finished order-check exchange found ranks issuing different calls. Never waits.
  void check_order() {
    if (!order_) return;
    const std::string mismatch = order_->harvest();
    if (mismatch.empty()) return;
    const std::string message = mismatch + "; the communicator is aborted (ncclCommAbort)";
    abort(message);
    throw InvalidArgument(message);
  }

  void abort(const std::string& reason) {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_ = reason;
  }

  void check_alive(std::string_view name) const {
    if (comm_ == nullptr)
      fail<CommunicatorAborted>(name, " (nccl): the communicator was aborted (", aborted_,
                                "); create a new one");
  }

  // Throws NcclError (after aborting) when NCCL reported an asynchronous failure; returns true
  // while the last non-blocking operation is still in progress.
  bool in_progress(std::string_view name) {
    check_alive(name);
    ncclResult_t state = ncclSuccess;
    nccl_status(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
    if (state == ncclInProgress) return true;
    if (state != ncclSuccess) {
      const std::string message = shardkit::detail::concat(
          name, " (nccl) failed asynchronously: ", ncclGetErrorString(state),
          "; the communicator "
          "is aborted");
      abort(message);
      throw NcclError(message, state);
    }
    return false;
  }

  // Polls until `done()` or the timeout; then aborts and throws TimeoutError naming `name`.
  template <class Done>
  void poll(std::string_view name, Done&& done) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !done(); ++polls) {
      if (std::chrono::steady_clock::now() - start >= timeout_) {
        // Ranks that issued different calls is the likeliest cause, and then the order check
        // (when on) has the pair: name it rather than the bare timeout.
        check_order();
        const std::string message = shardkit::detail::concat(
            name, " (nccl) timed out after ", timeout_.count(),
            " ms: some rank never joined it (dead, stuck, or issuing other calls); the "
            "communicator was aborted (ncclCommAbort)");
        abort(message);
        throw TimeoutError(message);
      }
      if (polls < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // After a call that may have answered ncclInProgress: waits until NCCL accepted it.
  void settle(std::string_view name, ncclResult_t status, const char* call) {
    nccl_status(status, call);
    poll(name, [&] { return !in_progress(name); });
  }

 private:
  ncclComm_t comm_;
  std::chrono::milliseconds timeout_;
  std::string aborted_;
  std::unique_ptr<NcclOrderCheck> order_;
};

class NcclWorkState final : public WorkState {
 public:
  NcclWorkState(std::shared_ptr<NcclHandle> handle, std::string name)
      : handle_(std::move(handle)), name_(std::move(name)) {}
  void set_event(std::shared_ptr<CudaEvent> event) { event_ = std::move(event); }

  bool test() override {
    check<StateError>(event_ != nullptr, name_,
                      ": the call belongs to an open group scope; end "
                      "the group before waiting on it");
    if (handle_->in_progress(name_)) return false;
    if (!event_->query()) return false;
    handle_->check_order();  // this call's own exchange ran before it
    return true;
  }
  void wait() override {
    handle_->poll(name_, [&] { return test(); });
  }
  // Issued on the rank's stream. Inside an open group the call is not launched yet, and work
  // queued now would run before it: refused, as wait() is.
  void wait_on_stream() override {
    check<StateError>(event_ != nullptr, name_,
                      ": the call belongs to an open group scope; end the group before waiting on "
                      "it");
  }

 private:
  std::shared_ptr<NcclHandle> handle_;
  std::string name_;
  std::shared_ptr<CudaEvent> event_;
};

inline ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::u8:
      return ncclUint8;
    default:
      break;
  }
  fail<InvalidArgument>("dtype ", dtype_name(dtype), " has no NCCL collective here");
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
  }
  return ncclSum;
}

}  // namespace detail

class NcclCommunicator final : public Communicator {
 public:
  // Joins the communicator `id` as `rank` of `size`, on the context's GPU. Every rank must get
  // the same id (MPI broadcast, NCCL_COMM_ID, or a shared file: see bootstrap.hpp).
  NcclCommunicator(Context& ctx, const ncclUniqueId& id, int rank, int size,
                   CommOptions options = {})
      : NcclCommunicator(ctx, init(ctx, id, rank, size, options), options, Adopt{}) {}

  // A fresh id, made by one rank and handed to the others.
  static ncclUniqueId unique_id() {
    ncclUniqueId id;
    SK_NCCL_CHECK(ncclGetUniqueId(&id));
    return id;
  }

  std::string_view backend() const override { return "nccl"; }
  ncclComm_t handle() const { return handle_->get(); }

 protected:
  std::string aborted_reason() const override { return handle_->aborted(); }

  Work do_all_reduce(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    return launch("all_reduce", [&] {
      return ncclAllReduce(send.data, recv.data, send.count, detail::nccl_type(send.dtype),
                           detail::nccl_op(op), handle(), ctx_.stream());
    });
  }
  Work do_reduce(const Buffer& send, const Buffer& recv, int root, ReduceOp op) override {
    return launch("reduce", [&] {
      return ncclReduce(send.data, recv.data, send.count, detail::nccl_type(send.dtype),
                        detail::nccl_op(op), root, handle(), ctx_.stream());
    });
  }
  Work do_broadcast(const Buffer& data, int root) override {
    return launch("broadcast", [&] {
      return ncclBroadcast(data.data, data.data, data.count, detail::nccl_type(data.dtype), root,
                           handle(), ctx_.stream());
    });
  }
  Work do_all_gather(const Buffer& send, const Buffer& recv) override {
    return launch("all_gather", [&] {
      return ncclAllGather(send.data, recv.data, send.count, detail::nccl_type(send.dtype),
                           handle(), ctx_.stream());
    });
  }
  Work do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    return launch("reduce_scatter", [&] {
      return ncclReduceScatter(send.data, recv.data, recv.count, detail::nccl_type(send.dtype),
                               detail::nccl_op(op), handle(), ctx_.stream());
    });
  }
  // One broadcast per owner, batched in one NCCL group.
  Work do_all_gather_v(const Buffer& data, std::span<const std::size_t> counts) override {
    return launch("all_gather_v", [&] {
      detail::nccl_status(ncclGroupStart(), "ncclGroupStart");
      std::size_t offset = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const Buffer segment = data.slice(offset, counts[r]);
        offset += counts[r];
        if (segment.empty()) continue;
        detail::nccl_status(
            ncclBroadcast(segment.data, segment.data, segment.count, detail::nccl_type(data.dtype),
                          static_cast<int>(r), handle(), ctx_.stream()),
            "ncclBroadcast");
      }
      return ncclGroupEnd();
    });
  }
  // One reduce per owner (to that owner), batched in one NCCL group.
  Work do_reduce_scatter_v(const Buffer& send, const Buffer& recv,
                           std::span<const std::size_t> counts, ReduceOp op) override {
    return launch("reduce_scatter_v", [&] {
      detail::nccl_status(ncclGroupStart(), "ncclGroupStart");
      std::size_t offset = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const Buffer segment = send.slice(offset, counts[r]);
        offset += counts[r];
        if (segment.empty()) continue;
        void* out = static_cast<int>(r) == rank() ? recv.data : nullptr;
        detail::nccl_status(
            ncclReduce(segment.data, out, segment.count, detail::nccl_type(send.dtype),
                       detail::nccl_op(op), static_cast<int>(r), handle(), ctx_.stream()),
            "ncclReduce");
      }
      return ncclGroupEnd();
    });
  }
  // Point-to-point in one NCCL group: segment r of `send` to rank r, rank q's segment for this
  // rank into recv at q x counts[rank] (this rank's own is copied by NCCL like any other).
  Work do_all_to_all_v(const Buffer& send, const Buffer& recv,
                       std::span<const std::size_t> counts) override {
    return launch("all_to_all_v", [&] {
      const std::size_t own = counts[static_cast<std::size_t>(rank())];
      const ncclDataType_t type = detail::nccl_type(send.dtype);
      detail::nccl_status(ncclGroupStart(), "ncclGroupStart");
      std::size_t offset = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const int peer = static_cast<int>(r);
        if (counts[r] > 0)
          detail::nccl_status(ncclSend(send.slice(offset, counts[r]).data, counts[r], type, peer,
                                       handle(), ctx_.stream()),
                              "ncclSend");
        if (own > 0)
          detail::nccl_status(
              ncclRecv(recv.slice(r * own, own).data, own, type, peer, handle(), ctx_.stream()),
              "ncclRecv");
        offset += counts[r];
      }
      return ncclGroupEnd();
    });
  }
  // NCCL has no barrier: a one-element all-reduce, waited for on the host.
  void do_barrier() override {
    const Buffer flag(scratch_->data(), 1, DType::f32, ctx_.device());
    launch("barrier", [&] {
      return ncclAllReduce(flag.data, flag.data, 1, ncclFloat32, ncclSum, handle(), ctx_.stream());
    }).wait();
  }
  std::unique_ptr<Communicator> do_split(int color, int key) override {
    const std::string name = call_name("split");
    CudaDeviceGuard guard(ctx_.device().index);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    handle_->settle(
        name, ncclCommSplit(handle(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config),
        "ncclCommSplit");
    if (child == nullptr) return nullptr;
    auto child_handle = std::make_shared<detail::NcclHandle>(child, options().timeout);
    child_handle->poll(name, [&] { return !child_handle->in_progress(name); });
    return std::unique_ptr<Communicator>(
        new NcclCommunicator(ctx_, std::move(child_handle), options(), Adopt{}));
  }
  // Memory of the context's GPU.
  void do_check_buffers(std::string_view call, std::span<const Buffer> buffers) const override {
    for (const Buffer& b : buffers)
      check(b.empty() || b.device == ctx_.device(), where(call), ": a buffer is on ", b.device,
            " but this communicator's GPU is ", ctx_.device(),
            "; NCCL moves device memory of the context's GPU (copy host data there first)");
  }
  // CommOptions::validate_order: first the verdicts of earlier exchanges the GPU has finished,
  // then this call's fingerprint exchange, queued ahead of it (nccl_order_check.hpp).
  void do_validate(const CallRecord& call) override {
    const std::string name = where(call.name()).str();
    handle_->check_alive(name);
    handle_->check_order();
    if (handle_->order_check() == nullptr)
      handle_->set_order_check(std::make_unique<detail::NcclOrderCheck>(
          ctx_, size(), shardkit::detail::concat("rank ", rank(), " of ", size(), " (nccl)"),
          recorder()));
    CudaDeviceGuard guard(ctx_.device().index);
    handle_->order_check()->exchange(call, handle(), group_depth() > 0, [&](ncclResult_t status) {
      handle_->settle(name, status, "ncclAllGather (the order check's fingerprints)");
    });
  }
  void do_group_start() override { detail::nccl_status(ncclGroupStart(), "ncclGroupStart"); }
  void do_group_end() override {
    CudaDeviceGuard guard(ctx_.device().index);
    handle_->settle("group", ncclGroupEnd(), "ncclGroupEnd");
    if (group_depth() > 0) return;  // an outer scope still batches
    if (auto* order = handle_->order_check()) order->end_group();
    auto event = record();
    for (auto& work : pending_) work->set_event(event);
    pending_.clear();
  }

 private:
  struct Adopt {};

  NcclCommunicator(Context& ctx, std::shared_ptr<detail::NcclHandle> handle, CommOptions options,
                   Adopt)
      : Communicator(user_rank(handle->get()), count(handle->get()), options),
        ctx_(ctx),
        handle_(std::move(handle)),
        scratch_(std::make_shared<Storage>(ctx.allocator_ptr(), sizeof(float),
                                           MemoryCategory::communication)) {}

  static std::shared_ptr<detail::NcclHandle> init(Context& ctx, const ncclUniqueId& id, int rank,
                                                  int size, const CommOptions& options) {
    check(ctx.device().is_cuda(), "NcclCommunicator needs a context on a CUDA GPU, got ",
          ctx.device(), "; use the MPI or local backend for host memory");
    check(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank,
          " is outside a world of ", size, " ranks");
    CudaDeviceGuard guard(ctx.device().index);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init must not block: a missing rank becomes a timeout, not a hang
    ncclComm_t comm = nullptr;
    const ncclResult_t status = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    if (status != ncclSuccess && status != ncclInProgress && comm != nullptr)
      (void)ncclCommAbort(comm);
    detail::nccl_status(status, "ncclCommInitRankConfig");
    auto handle = std::make_shared<detail::NcclHandle>(comm, options.timeout);
    const std::string name =
        shardkit::detail::concat("NCCL init of rank ", rank, " of ", size, " on ", ctx.device());
    handle->poll(name, [&] { return !handle->in_progress(name); });
    return handle;
  }
  static int user_rank(ncclComm_t comm) {
    int rank = 0;
    SK_NCCL_CHECK(ncclCommUserRank(comm, &rank));
    return rank;
  }
  static int count(ncclComm_t comm) {
    int size = 0;
    SK_NCCL_CHECK(ncclCommCount(comm, &size));
    return size;
  }

  std::string call_name(std::string_view call) const {
    return shardkit::detail::concat(call, " #", call_number(), " on rank ", rank(), " of ", size());
  }

  std::shared_ptr<CudaEvent> record() {
    auto event = std::make_shared<CudaEvent>(ctx_.device().index);
    event->record(ctx_.stream());
    return event;
  }

  template <class Issue>
  Work launch(std::string_view call, Issue&& issue) {
    const std::string name = call_name(call);
    handle_->check_alive(name);
    CudaDeviceGuard guard(ctx_.device().index);
    handle_->settle(name, issue(), "NCCL collective");
    auto work = std::make_shared<detail::NcclWorkState>(handle_, name);
    if (group_depth() > 0)
      pending_.push_back(work);  // launched at the end of the group
    else
      work->set_event(record());
    return Work(std::move(work), ctx_);
  }

  Context& ctx_;
  std::shared_ptr<detail::NcclHandle> handle_;
  std::shared_ptr<Storage> scratch_;  // the barrier's one float
  std::vector<std::shared_ptr<detail::NcclWorkState>> pending_;
};

}  // namespace shardkit::comm

#endif  // SK_WITH_CUDA
