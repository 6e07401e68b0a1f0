// MpiCommunicator: ranks are MPI processes (mpirun, one or many machines), buffers are host
// memory. Calls are MPI's non-blocking collectives, so they return at once and overlap with
// computation; Work::wait() polls MPI_Test until done or until the timeout.
//
// - f16/bf16 have no MPI type: moves send them as 16-bit words; reductions widen them to f32
//   on the wire (the sum accumulates in f32 and rounds once, as on the other backends), which
//   doubles the bytes actually sent (the counters keep counting the caller's dtype).
// - avg is MPI_SUM followed by one division by size() on this rank.
// - Errors come back as status values (MPI_ERRORS_RETURN) and are thrown as sk::MpiError.
// - Checked here: everything local (dtype, sizes, root, aliasing, int-sized counts). Not
//   checked: that peers pass matching counts/dtypes/roots (MPI typically reports a truncation
//   error or the call times out).
// - A timeout cannot cancel an MPI collective: the communicator is marked aborted, the request
//   is kept until it completes (MPI may still write the buffers of that call; keep them alive)
//   and the usual reaction is to end the job. MPI itself offers no portable way out.
#pragma once

#if defined(SHARDKIT_WITH_MPI) && SHARDKIT_WITH_MPI

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/mpi_session.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/mpi_check.hpp"
#include "shardkit/core/storage.hpp"

namespace shardkit::comm {

namespace detail {

struct MpiCommState {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string aborted;                              // why the communicator gave up (a timeout)
  std::vector<std::shared_ptr<WorkState>> orphans;  // requests MPI may still be working on
};

class MpiWorkState final : public WorkState, public std::enable_shared_from_this<MpiWorkState> {
 public:
  MpiWorkState(std::shared_ptr<MpiCommState> comm, std::string name,
               std::chrono::milliseconds timeout,
               std::shared_ptr<const FlightRecorder> recorder = nullptr)
      : comm_(std::move(comm)),
        name_(std::move(name)),
        timeout_(timeout),
        recorder_(std::move(recorder)) {}

  MPI_Request request = MPI_REQUEST_NULL;
  std::function<void()> finish;                      // runs once, after MPI completed the call
  std::vector<std::shared_ptr<Storage>> staging;     // f32 copies, temporary outputs
  std::vector<int> counts, displacements;            // the v-collectives' arrays, alive until done
  std::vector<int> recv_counts, recv_displacements;  // all_to_all_v's receiving side
  // The order check's fingerprints, this rank's and every rank's: owned here because a request
  // that times out stays in MPI's hands (orphaned) and is completed later, when a late rank
  // joins it -- into buffers that must still be alive then.
  std::vector<std::uint64_t> fingerprint, fingerprints;

  bool test() override {
    if (done_) return true;
    int flag = 0;
    SK_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
    if (!flag) return false;
    done_ = true;
    if (finish) finish();
    return true;
  }

  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !test(); ++polls) {
      // Another call's timeout aborted the communicator: a call issued before it fails now,
      // its request left in MPI's hands as that one's -- it waited its own full timeout, and
      // then as much again when its Work was dropped (the buckets of a whole backward did so,
      // one after another, against a dead rank).
      if (!comm_->aborted.empty()) {
        orphan();
        throw CommunicatorAborted(shardkit::detail::concat(
            name_, " (mpi): the communicator was aborted while this call was in flight (",
            comm_->aborted, "); create a new communicator"));
      }
      if (std::chrono::steady_clock::now() - start >= timeout_) {
        const std::string message = shardkit::detail::concat(
            name_, " (mpi) timed out after ", timeout_.count(),
            " ms: some rank never joined it (dead, stuck, or issuing other calls); the "
            "communicator is aborted and this call's buffers stay in MPI's hands",
            recorder_ ? "; " + recorder_->recent() : std::string());
        comm_->aborted = message;
        orphan();
        throw TimeoutError(message);
      }
      // MPI progresses inside MPI_Test; yield first (latency), then sleep (oversubscribed CPUs).
      if (polls < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 10 : 200));
    }
  }

  // MPI cannot cancel a collective: finish it, so the buffers are free when the Work is gone.
  void on_drop() noexcept override {
    try {
      wait();
    } catch (...) {  // a timeout already orphaned the request; nothing else can be done here
    }
  }

 private:
  // The request stays in MPI's hands, completed when the communicator goes (once).
  void orphan() {
    if (orphaned_) return;
    orphaned_ = true;
    comm_->orphans.push_back(shared_from_this());
  }

  bool orphaned_ = false;
  std::shared_ptr<MpiCommState> comm_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const FlightRecorder> recorder_;
  bool done_ = false;
};

inline MPI_Datatype mpi_wire_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::u8:
      return MPI_UINT8_T;
    default:
      return MPI_UINT16_T;  // f16 / bf16 moved as 16-bit words
  }
}

inline MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

inline bool is_16bit(DType dtype) { return dtype == DType::f16 || dtype == DType::bf16; }

}  // namespace detail

class MpiCommunicator final : public Communicator {
 public:
  // A communicator over a duplicate of `comm` (our traffic never mixes with the caller's).
  // `session` keeps MPI initialised while this lives; `ctx` provides staging memory.
  MpiCommunicator(Context& ctx, std::shared_ptr<MpiSession> session, MPI_Comm comm = MPI_COMM_WORLD,
                  CommOptions options = {})
      : MpiCommunicator(ctx, std::move(session), duplicate(comm), options, Adopt{}) {}

  // All processes of the job (MPI_COMM_WORLD), starting MPI if needed.
  static std::unique_ptr<MpiCommunicator> world(Context& ctx, CommOptions options = {}) {
    return std::make_unique<MpiCommunicator>(ctx, std::make_shared<MpiSession>(), MPI_COMM_WORLD,
                                             options);
  }

  ~MpiCommunicator() override {
    // Orphaned requests complete when their late peers arrive: give them one more timeout (at
    // least a second). Freeing the communicator under a pending collective would let MPI
    // progress it on freed memory, so if one is still pending the handle and its staging
    // buffers are deliberately leaked -- the job is broken at that point anyway.
    const auto grace =
        std::max<std::chrono::milliseconds>(options().timeout, std::chrono::seconds(1));
    const auto start = std::chrono::steady_clock::now();
    bool pending = false;
    for (auto& orphan : state_->orphans) {
      try {
        while (!orphan->test()) {
          if (std::chrono::steady_clock::now() - start >= grace) {
            pending = true;
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      } catch (...) {  // destructor: the error was reported when the call timed out
      }
    }
    if (pending) {
      new std::shared_ptr<detail::MpiCommState>(state_);  // leaked on purpose, see above
      return;
    }
    if (state_->comm != MPI_COMM_NULL) (void)MPI_Comm_free(&state_->comm);
  }

  std::string_view backend() const override { return "mpi"; }
  MPI_Comm handle() const { return state_->comm; }
  const std::shared_ptr<MpiSession>& session() const { return session_; }

 protected:
  std::string aborted_reason() const override { return state_->aborted; }

  Work do_all_reduce(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    auto work = begin("all_reduce");
    auto [in, out, type] = stage_reduction(*work, send, recv, op, true);
    // Always the in-place form: MPI requires MPI_IN_PLACE at all processes or at none, and our
    // API lets each rank choose (NCCL's does); a rank that did not is copied into place here.
    if (in != out)  // (16-bit data travels as f32 copies)
      std::memcpy(out, in,
                  detail::is_16bit(send.dtype) ? send.count * sizeof(float) : send.nbytes());
    SK_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, out, int_count("all_reduce", send.count), type,
                                detail::mpi_op(op), state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_reduce(const Buffer& send, const Buffer& recv, int root, ReduceOp op) override {
    auto work = begin("reduce");
    const bool at_root = rank() == root;
    auto [in, out, type] = stage_reduction(*work, send, recv, op, at_root);
    const void* in_arg = at_root && in == out ? MPI_IN_PLACE : in;
    SK_MPI_CHECK(MPI_Ireduce(in_arg, at_root ? out : nullptr, int_count("reduce", send.count), type,
                             detail::mpi_op(op), root, state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_broadcast(const Buffer& data, int root) override {
    auto work = begin("broadcast");
    SK_MPI_CHECK(MPI_Ibcast(data.data, int_count("broadcast", data.count),
                            detail::mpi_wire_type(data.dtype), root, state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_all_gather(const Buffer& send, const Buffer& recv) override {
    auto work = begin("all_gather");
    const int count = int_count("all_gather", send.count);
    const MPI_Datatype type = detail::mpi_wire_type(send.dtype);
    // Always the in-place form, as all_reduce: a rank whose send is not its own segment of
    // recv (the two are disjoint then) is copied into it first.
    const Buffer own = recv.slice(send.count * static_cast<std::size_t>(rank()), send.count);
    if (!send.empty() && send.data != own.data) std::memcpy(own.data, send.data, send.nbytes());
    SK_MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv.data, count, type,
                                state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op) override {
    auto work = begin("reduce_scatter");
    auto [in, out, type] = stage_reduction(*work, send, recv, op, true, overlaps(send, recv));
    SK_MPI_CHECK(MPI_Ireduce_scatter_block(in, out, int_count("reduce_scatter", recv.count), type,
                                           detail::mpi_op(op), state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_all_gather_v(const Buffer& data, std::span<const std::size_t> counts) override {
    auto work = begin("all_gather_v");
    set_counts(*work, "all_gather_v", counts);
    SK_MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data.data, work->counts.data(),
                                 work->displacements.data(), detail::mpi_wire_type(data.dtype),
                                 state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  Work do_reduce_scatter_v(const Buffer& send, const Buffer& recv,
                           std::span<const std::size_t> counts, ReduceOp op) override {
    auto work = begin("reduce_scatter_v");
    set_counts(*work, "reduce_scatter_v", counts);
    auto [in, out, type] = stage_reduction(*work, send, recv, op, true, overlaps(send, recv));
    SK_MPI_CHECK(MPI_Ireduce_scatter(in, out, work->counts.data(), type, detail::mpi_op(op),
                                     state_->comm, &work->request));
    return Work(std::move(work), ctx_);
  }

  // MPI_Alltoallv: this rank sends segment r of `send` to rank r and receives every rank's
  // segment for it, counts[rank] each, in rank order.
  Work do_all_to_all_v(const Buffer& send, const Buffer& recv,
                       std::span<const std::size_t> counts) override {
    auto work = begin("all_to_all_v");
    set_counts(*work, "all_to_all_v", counts);
    const int own = work->counts[static_cast<std::size_t>(rank())];
    work->recv_counts.assign(static_cast<std::size_t>(size()), own);
    work->recv_displacements.resize(static_cast<std::size_t>(size()));
    for (int q = 0; q < size(); ++q)
      work->recv_displacements[static_cast<std::size_t>(q)] = q * own;
    const MPI_Datatype type = detail::mpi_wire_type(send.dtype);
    SK_MPI_CHECK(MPI_Ialltoallv(send.data, work->counts.data(), work->displacements.data(), type,
                                recv.data, work->recv_counts.data(),
                                work->recv_displacements.data(), type, state_->comm,
                                &work->request));
    return Work(std::move(work), ctx_);
  }

  void do_barrier() override {
    auto work = begin("barrier");
    SK_MPI_CHECK(MPI_Ibarrier(state_->comm, &work->request));
    work->wait();
  }

  // Host memory, in MPI's int counts (every offset lies inside a buffer, so it fits too).
  void do_check_buffers(std::string_view call, std::span<const Buffer> buffers) const override {
    for (const Buffer& b : buffers) {
      check(b.device.is_cpu(), where(call), ": buffers on ", b.device,
            "; the MPI backend moves host memory -- use NCCL for device memory "
            "(make_communicator on a CUDA context picks it)");
      (void)int_count(call, b.count);
    }
  }

  // The order check: every rank's fingerprint of this call, gathered under the timeout.
  void do_validate(const CallRecord& call) override {
    const auto mine = call.fingerprint();
    auto work = std::make_shared<detail::MpiWorkState>(
        state_,
        shardkit::detail::concat("the order check of ", call.describe(), " on rank ", rank(),
                                 " of ", size()),
        options().timeout, recorder());
    work->fingerprint.assign(mine.begin(), mine.end());
    work->fingerprints.resize(mine.size() * static_cast<std::size_t>(size()));
    SK_MPI_CHECK(MPI_Iallgather(work->fingerprint.data(), static_cast<int>(mine.size()),
                                MPI_UINT64_T, work->fingerprints.data(),
                                static_cast<int>(mine.size()), MPI_UINT64_T, state_->comm,
                                &work->request));
    work->wait();
    const auto& all = work->fingerprints;
    const int rank = first_mismatch(all, mine);
    if (rank >= 0)
      throw InvalidArgument(
          mismatch_message(where(call.name()).str(), call, rank, all, recorder()->recent()));
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override {
    // MPI_Comm_split blocks without a timeout: meet in a timed barrier first, so a missing rank
    // becomes a TimeoutError here instead of a hang there.
    auto work = begin("split");
    SK_MPI_CHECK(MPI_Ibarrier(state_->comm, &work->request));
    work->wait();
    MPI_Comm child = MPI_COMM_NULL;
    SK_MPI_CHECK(MPI_Comm_split(state_->comm, color < 0 ? MPI_UNDEFINED : color, key, &child));
    if (child == MPI_COMM_NULL) return nullptr;
    return std::unique_ptr<Communicator>(
        new MpiCommunicator(ctx_, session_, child, options(), Adopt{}));
  }

 private:
  struct Adopt {};

  MpiCommunicator(Context& ctx, std::shared_ptr<MpiSession> session, MPI_Comm adopted,
                  CommOptions options, Adopt)
      : Communicator(rank_of(adopted), size_of(adopted), options),
        ctx_(ctx),
        session_(std::move(session)),
        state_(std::make_shared<detail::MpiCommState>()) {
    state_->comm = adopted;
    SK_MPI_CHECK(MPI_Comm_set_errhandler(adopted, MPI_ERRORS_RETURN));
    agree_on_order_check();
  }

  // The ranks agree that they all check the order or none does: a rank that checks issues an
  // all-gather before each call, which would pair with another rank's real call -- the check
  // would cause the failure it is there to name. (The environment variable reaches another
  // host only where the launcher passes it: Open MPI's `mpirun -x`.) One all-reduce, here
  // where the communicator is made, collectively, anyway.
  void agree_on_order_check() {
    const int mine = options().validate_order ? 1 : 0;
    int extremes[2] = {mine, -mine};  // max of mine, and -min of mine
    int agreed[2] = {0, 0};
    SK_MPI_CHECK(MPI_Allreduce(extremes, agreed, 2, MPI_INT, MPI_MAX, state_->comm));
    if (agreed[0] == -agreed[1]) return;
    (void)MPI_Comm_free(&state_->comm);
    fail<InvalidArgument>(
        "MpiCommunicator of ", size(),
        " ranks: the order check (CommOptions::validate_order, "
        "SHARDKIT_VALIDATE_COLLECTIVES) is ",
        mine ? "on" : "off", " on rank ", rank(), " but ", mine ? "off" : "on",
        " on another rank; its exchange before each call would "
        "pair with that rank's real calls. Set it alike on every rank (pass the variable to "
        "every host: Open MPI's `mpirun -x SHARDKIT_VALIDATE_COLLECTIVES`)");
  }

  static MPI_Comm duplicate(MPI_Comm comm) {
    // Without MPI_ERRORS_RETURN on the parent, a failing dup would abort the job.
    SK_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MPI_Comm copy = MPI_COMM_NULL;
    SK_MPI_CHECK(MPI_Comm_dup(comm, &copy));
    return copy;
  }
  static int rank_of(MPI_Comm comm) {
    int rank = 0;
    SK_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    return rank;
  }
  static int size_of(MPI_Comm comm) {
    int size = 0;
    SK_MPI_CHECK(MPI_Comm_size(comm, &size));
    return size;
  }

  std::shared_ptr<detail::MpiWorkState> begin(std::string_view call) {
    return std::make_shared<detail::MpiWorkState>(
        state_,
        shardkit::detail::concat(call, " #", call_number(), " on rank ", rank(), " of ", size()),
        options().timeout, recorder());
  }

  int int_count(std::string_view call, std::size_t count) const {
    check(count <= static_cast<std::size_t>(INT_MAX), where(call), ": ", count,
          " elements exceed MPI's int counts; split the call into pieces below 2^31 elements");
    return static_cast<int>(count);
  }

  void set_counts(detail::MpiWorkState& work, std::string_view call,
                  std::span<const std::size_t> counts) const {
    std::size_t offset = 0;
    for (std::size_t c : counts) {
      work.counts.push_back(int_count(call, c));
      work.displacements.push_back(int_count(call, offset));
      offset += c;
    }
  }

  std::shared_ptr<Storage> staging(std::size_t bytes) {
    return std::make_shared<Storage>(ctx_.host_allocator_ptr(), bytes,
                                     MemoryCategory::communication);
  }

  struct Wire {
    void* in;
    void* out;
    MPI_Datatype type;
  };

  // The buffers MPI reduces: the caller's, or f32 copies for f16/bf16; an output of its own when
  // `separate_output` (MPI forbids the overlap of the in-place reduce_scatter forms). Sets up
  // what must happen after completion (narrowing, avg, copying the separate output back) on the
  // ranks that `deliver` a result.
  Wire stage_reduction(detail::MpiWorkState& work, const Buffer& send, const Buffer& recv,
                       ReduceOp op, bool deliver, bool separate_output = false) {
    const int n = size();
    if (detail::is_16bit(send.dtype)) {
      auto in = staging(send.count * sizeof(float));
      auto out = staging(std::max<std::size_t>(recv.count, 1) * sizeof(float));
      visit_dtype(send.dtype, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
          const T* src = static_cast<const T*>(send.data);
          float* wide = static_cast<float*>(in->data());
          for (std::size_t i = 0; i < send.count; ++i) wide[i] = widen(src[i]);
          if (deliver)
            work.finish = [out, recv, op, n] {
              const float* result = static_cast<const float*>(out->data());
              T* dst = static_cast<T*>(recv.data);
              for (std::size_t i = 0; i < recv.count; ++i)
                dst[i] = narrow<T>(finish(result[i], n, op));
            };
        }
      });
      work.staging = {in, out};
      return {in->data(), out->data(), MPI_FLOAT};
    }
    void* out = recv.data;
    std::shared_ptr<Storage> temporary;
    if (separate_output && deliver) {
      temporary = staging(recv.nbytes());
      out = temporary->data();
      work.staging = {temporary};
    }
    if (deliver && (op == ReduceOp::avg || temporary)) {
      work.finish = [temporary, recv, op, n] {
        visit_dtype(recv.dtype, [&](auto tag) {
          using T = decltype(tag);
          if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
            T* dst = static_cast<T*>(recv.data);
            if (temporary) std::memcpy(dst, temporary->data(), recv.nbytes());
            if (op == ReduceOp::avg)
              for (std::size_t i = 0; i < recv.count; ++i) dst[i] = finish(dst[i], n, op);
          }
        });
      };
    }
    return {send.data, out, detail::mpi_wire_type(send.dtype)};
  }

  Context& ctx_;
  std::shared_ptr<MpiSession> session_;
  std::shared_ptr<detail::MpiCommState> state_;
};

}  // namespace shardkit::comm

#endif  // SHARDKIT_WITH_MPI
