// Communicator: the one interface every backend (local threads, MPI processes, NCCL GPUs)
// implements. Public calls check what this rank can check (dtype, sizes, root, aliasing), count
// the traffic, then hand normalised buffers to the backend.
//
// Every rank of a communicator must issue the same calls in the same order with the same
// counts, dtypes, roots and ops (NCCL's rule). The local backend checks that across ranks on
// every call; MPI and NCCL do with CommOptions::validate_order (call_record.hpp), at the cost
// of one small all-gather per call (MPI waits for it; NCCL queues it on the stream and compares
// later: nccl_order_check.hpp); without it a mismatch is undefined (MPI usually reports a
// truncation error, NCCL may hang until the timeout). Every communicator records its last calls
// for timeouts' messages.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/comm/buffer.hpp"
#include "shardkit/comm/call_record.hpp"
#include "shardkit/comm/calls_differ.hpp"
#include "shardkit/comm/comm_stats.hpp"
#include "shardkit/comm/reduction.hpp"
#include "shardkit/comm/work.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

// A communicator gave up (a timeout, or a failure on another rank); it cannot be used again.
class CommunicatorAborted : public StateError {
 public:
  using StateError::StateError;
};

// Thrown on the ranks whose own part of a collective operation succeeded when another rank's
// part failed (e.g. a rank that could not read its piece of a checkpoint): a consequence, like
// an abort, so run_ranks reports the failing rank's own error first.
class PeerFailed : public CommunicatorAborted {
 public:
  using CommunicatorAborted::CommunicatorAborted;
};

// The order check's default: SHARDKIT_VALIDATE_COLLECTIVES=1 or 0 in the environment (the MPI
// suites of the tests set 1), so a job that hangs can be rerun with the check without a
// rebuild; unset, on in an unoptimised debug build (meson's buildtype=debug) and off otherwise.
inline bool validate_order_default() {
  const char* value = std::getenv("SHARDKIT_VALIDATE_COLLECTIVES");
  if (value != nullptr) return std::string_view(value) == "1";
#if defined(__OPTIMIZE__) || defined(NDEBUG)
  return false;
#else
  return true;
#endif
}

struct CommOptions {
  // How long a call may wait for the other ranks before it throws sk::TimeoutError and the
  // communicator is aborted. Covers the wait for peers, not the local data movement. One over
  // kLongestTimeout (milliseconds::max() for "never") counts as that: the deadlines are
  // reckoned in nanoseconds, where a longer one would wrap and expire at once.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  static constexpr std::chrono::milliseconds kLongestTimeout = std::chrono::hours(24 * 365 * 100);
  // Before each call, the ranks compare its fingerprint (call_record.hpp) and refuse a
  // mismatch with both calls named, before it can hang or move the wrong bytes: one all-gather
  // of 48 bytes per rank per call, which also makes each call wait until every rank has issued
  // it. MPI and NCCL (which queues the exchange on the stream and compares its result without
  // waiting, so the refusal comes at a later call or wait); the local backend checks every call
  // anyway.
  bool validate_order = validate_order_default();
};

class Communicator;

// Batches the calls made while it lives (NCCL group semantics: one launch for many calls; the
// v-collectives use it internally). Other backends already run calls asynchronously.
class GroupScope {
 public:
  explicit GroupScope(Communicator& comm);
  GroupScope(const GroupScope&) = delete;
  GroupScope& operator=(const GroupScope&) = delete;
  // Ends the group; throws the backend's error. The destructor ends it too, but swallows
  // errors while an exception is already propagating.
  void end();
  ~GroupScope() noexcept(false);

 private:
  Communicator* comm_;
  int uncaught_at_start_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string_view backend() const = 0;
  const CommOptions& options() const { return options_; }
  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_.reset(); }

  // data <- reduction of every rank's data.
  Work all_reduce(const Buffer& data, ReduceOp op = ReduceOp::sum) {
    return all_reduce(data, data, op);
  }
  // recv (>= send.count elements) <- reduction of every rank's send. recv may be send.
  Work all_reduce(const Buffer& send, const Buffer& recv, ReduceOp op = ReduceOp::sum) {
    const std::string_view call = "all_reduce";
    check_call(call, send, Reduces::yes);
    check_pair(call, send, recv, send.count, "send.count");
    const Buffer out = recv.first(send.count);
    check_same_or_disjoint(call, send, out);
    return counted(call, record(CollectiveKind::all_reduce, send, send.count, -1, op),
                   send.nbytes(), {send, out}, [&] { return do_all_reduce(send, out, op); });
  }
  // At `root`, recv <- reduction of every rank's send; other ranks may pass an empty recv.
  Work reduce(const Buffer& send, const Buffer& recv, int root, ReduceOp op = ReduceOp::sum) {
    const std::string_view call = "reduce";
    check_call(call, send, Reduces::yes);
    check_root(call, root);
    Buffer out;
    if (rank_ == root) {
      check_pair(call, send, recv, send.count, "send.count");
      out = recv.first(send.count);
      check_same_or_disjoint(call, send, out);
    } else {
      out = Buffer();
      out.dtype = send.dtype;
      out.device = send.device;
    }
    return counted(call, record(CollectiveKind::reduce, send, send.count, root, op), send.nbytes(),
                   {send, out}, [&] { return do_reduce(send, out, root, op); });
  }
  // data <- root's data, on every rank.
  Work broadcast(const Buffer& data, int root) {
    const std::string_view call = "broadcast";
    check_call(call, data, Reduces::no);
    check_root(call, root);
    return counted(call, record(CollectiveKind::broadcast, data, data.count, root), data.nbytes(),
                   {data}, [&] { return do_broadcast(data, root); });
  }
  // recv[r*count, (r+1)*count) <- rank r's send (count = send.count). In place when
  // send is exactly recv's segment of this rank (NCCL's form).
  Work all_gather(const Buffer& send, const Buffer& recv) {
    const std::string_view call = "all_gather";
    check_call(call, send, Reduces::no);
    const std::size_t total = times_ranks(call, send.count, "send.count");
    check_pair(call, send, recv, total, "size() x send.count");
    const Buffer out = recv.first(total);
    check_in_place_or_disjoint(call, send, out, send.count, "send", "recv");
    return counted(call, record(CollectiveKind::all_gather, send, total), out.nbytes(), {send, out},
                   [&] { return do_all_gather(send, out); });
  }
  // recv (count = recv.count) <- reduction over ranks of their send[rank*count, (rank+1)*count).
  // In place when recv is exactly send's segment of this rank (NCCL's form).
  Work reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op = ReduceOp::sum) {
    const std::string_view call = "reduce_scatter";
    check_call(call, recv, Reduces::yes);
    const std::size_t total = times_ranks(call, recv.count, "recv.count");
    check_pair(call, recv, send, total, "size() x recv.count", "send");
    const Buffer in = send.first(total);
    check_in_place_or_disjoint(call, recv, in, recv.count, "recv", "send");
    return counted(call, record(CollectiveKind::reduce_scatter, recv, total, -1, op), in.nbytes(),
                   {in, recv}, [&] { return do_reduce_scatter(in, recv, op); });
  }
  // Per-owner broadcast of an unevenly partitioned buffer: data holds sum(counts) elements,
  // rank r owns the segment of counts[r] elements after counts[0..r); afterwards every rank
  // holds every owner's segment. (ZeRO-1 parameter sync over a size-balanced partition.)
  Work all_gather_v(const Buffer& data, std::span<const std::size_t> counts) {
    const std::string_view call = "all_gather_v";
    const std::size_t total = check_segments(call, data, "data", counts, Reduces::no);
    const Buffer whole = data.first(total);
    auto uneven = record(CollectiveKind::all_gather_v, data, total);
    uneven.counts_hash = comm::counts_hash(counts);
    return counted(call, std::move(uneven), whole.nbytes(), {whole},
                   [&] { return do_all_gather_v(whole, counts); });
  }
  // Per-owner reduce of an unevenly partitioned buffer: send holds sum(counts) elements; rank r
  // receives the reduction of every rank's segment r into recv (>= counts[rank] elements). In
  // place when recv is exactly send's own segment. (ZeRO-2 gradient reduce to owners.)
  Work reduce_scatter_v(const Buffer& send, const Buffer& recv, std::span<const std::size_t> counts,
                        ReduceOp op = ReduceOp::sum) {
    const std::string_view call = "reduce_scatter_v";
    const std::size_t total = check_segments(call, send, "send", counts, Reduces::yes);
    const std::size_t own = counts[static_cast<std::size_t>(rank_)];
    check_pair(call, send, recv, own, "counts[rank]");
    const Buffer in = send.first(total), out = recv.first(own);
    const std::size_t offset =
        std::accumulate(counts.begin(), counts.begin() + rank_, std::size_t{0});
    if (overlaps(in, out))
      check(out.data == in.slice(offset, own).data, where(call),
            ": recv overlaps send but is not this rank's segment (element ", offset,
            " of send); pass disjoint buffers, or recv = send + offset for the in-place form");
    auto uneven = record(CollectiveKind::reduce_scatter_v, send, total, -1, op);
    uneven.counts_hash = comm::counts_hash(counts);
    return counted(call, std::move(uneven), in.nbytes(), {in, out},
                   [&] { return do_reduce_scatter_v(in, out, counts, op); });
  }
  // Per-owner segments moved to their owner, not reduced (the all-to-all of a quantised
  // reduce-scatter: the owner combines what arrives itself). send holds sum(counts) elements in
  // owner segments, as reduce_scatter_v's; recv (>= size() x counts[rank] elements) receives
  // rank q's segment for this rank at q x counts[rank]. Any movable dtype; no in-place form.
  Work all_to_all_v(const Buffer& send, const Buffer& recv, std::span<const std::size_t> counts) {
    const std::string_view call = "all_to_all_v";
    const std::size_t total = check_segments(call, send, "send", counts, Reduces::no);
    const std::size_t gathered =
        times_ranks(call, counts[static_cast<std::size_t>(rank_)], "counts[rank]");
    check_pair(call, send, recv, gathered, "size() x counts[rank]");
    const Buffer in = send.first(total), out = recv.first(gathered);
    check(!overlaps(in, out), where(call), ": send and recv overlap; pass disjoint buffers");
    auto uneven = record(CollectiveKind::all_to_all_v, send, total);
    uneven.counts_hash = comm::counts_hash(counts);
    return counted(call, std::move(uneven), in.nbytes(), {in, out},
                   [&] { return do_all_to_all_v(in, out, counts); });
  }
  // Returns when every rank has reached the barrier (throws TimeoutError otherwise).
  void barrier() {
    check_usable("barrier");
    check<StateError>(
        group_depth_ == 0, where("barrier"),
        ": a barrier inside a group scope would wait for itself; end the group first");
    begin_call(record(CollectiveKind::barrier, Buffer(), 0));
    in_step([&] { do_barrier(); });
    stats_.record(CollectiveKind::barrier, 0, size_);
  }

  GroupScope group() { return GroupScope(*this); }

  // Collective over all ranks: ranks passing the same colour form a new communicator, ranked by
  // (key, old rank). A negative colour takes no part and gets nullptr. The child keeps this
  // communicator's options and counts its own traffic.
  std::unique_ptr<Communicator> split(int color, int key) {
    check_usable("split");
    check<StateError>(group_depth_ == 0, where("split"),
                      ": split inside a group scope cannot complete; end the group first");
    auto split_call = record(CollectiveKind::barrier, Buffer(), 0);
    split_call.is_split = true;
    begin_call(std::move(split_call));
    return in_step([&] { return do_split(color, key); });
  }

  // What issues the calls while it lives ("fsdp unit 3: gather for forward"): part of each
  // call's fingerprint and of the flight recorder's entries, so a mismatch or a timeout names
  // the caller. Scopes nest; the innermost names the call. `text` must outlive the scope (a
  // literal, or a string its owner keeps): a scope costs no allocation on the hot path.
  class Label {
   public:
    Label(Communicator& comm, std::string_view text)
        : comm_(&comm), previous_(std::exchange(comm.label_, text)) {}
    ~Label() { comm_->label_ = previous_; }
    Label(const Label&) = delete;
    Label& operator=(const Label&) = delete;

   private:
    Communicator* comm_;
    std::string_view previous_;
  };
  Label label(std::string_view text) { return Label(*this, text); }
  // The innermost Label's text (empty outside every scope).
  std::string_view current_label() const { return label_; }

  // This rank's last calls, oldest first (what a timeout's message lists).
  std::string recent_calls() const { return recorder_->recent(); }

  // Keeps `owner` alive as long as this communicator (e.g. the MPI session it was built on).
  void attach(std::shared_ptr<void> owner) { attached_.push_back(std::move(owner)); }

 protected:
  Communicator(int rank, int size, CommOptions options)
      : rank_(rank), size_(size), options_(options) {
    check(size >= 1 && rank >= 0 && rank < size, "communicator rank ", rank,
          " is outside a world of ", size, " ranks");
    check(options.timeout.count() > 0, "communicator timeout must be positive, got ",
          options.timeout.count(), " ms");
    options_.timeout = std::min(options_.timeout, CommOptions::kLongestTimeout);
    RecorderRegistry::instance().add(recorder_,
                                     shardkit::detail::concat("rank ", rank, " of ", size));
  }

  // "all_reduce on rank 2 of 4 (local)": the prefix of every message about a call. A message
  // part, formatted only when a failed check streams it (every call runs its checks).
  class CallSite {
   public:
    CallSite(const Communicator& comm, std::string_view call) : comm_(&comm), call_(call) {}
    friend std::ostream& operator<<(std::ostream& out, const CallSite& site) {
      return out << site.call_ << " on rank " << site.comm_->rank() << " of " << site.comm_->size()
                 << " (" << site.comm_->backend() << ")";
    }
    std::string str() const { return shardkit::detail::concat(*this); }

   private:
    const Communicator* comm_;
    std::string_view call_;
  };
  CallSite where(std::string_view call) const { return CallSite(*this, call); }

  // count x size(), refused where it wraps: a wrapped total would pass the buffers' size checks
  // and the call would move `count` elements per rank.
  std::size_t times_ranks(std::string_view call, std::size_t count, const char* what) const {
    std::size_t total = 0;
    check(!__builtin_mul_overflow(count, static_cast<std::size_t>(size_), &total), where(call),
          ": ", what, " = ", count, " times ", size_, " ranks overflows; pass counts that fit");
    return total;
  }

  // Non-empty when the communicator was aborted; calls then throw CommunicatorAborted.
  virtual std::string aborted_reason() const { return {}; }

  // The backend's own refusals of a call's buffers (the memory it moves, its count limits),
  // asked before the call is numbered, recorded and exchanged by the order check: a call
  // refused here never began, on this rank or any other, so the ranks stay in step. A
  // backend's failure after that point puts the communicator out of step (see in_step).
  virtual void do_check_buffers(std::string_view call, std::span<const Buffer> buffers) const {
    (void)call;
    (void)buffers;
  }

  // The number of the call being issued (CallRecord::seq): what the backends' messages name
  // it by, as the flight recorder and the order check do.
  std::uint64_t call_number() const { return calls_ - 1; }

  virtual Work do_all_reduce(const Buffer& send, const Buffer& recv, ReduceOp op) = 0;
  virtual Work do_reduce(const Buffer& send, const Buffer& recv, int root, ReduceOp op) = 0;
  virtual Work do_broadcast(const Buffer& data, int root) = 0;
  virtual Work do_all_gather(const Buffer& send, const Buffer& recv) = 0;
  virtual Work do_reduce_scatter(const Buffer& send, const Buffer& recv, ReduceOp op) = 0;
  virtual Work do_all_gather_v(const Buffer& data, std::span<const std::size_t> counts) = 0;
  virtual Work do_reduce_scatter_v(const Buffer& send, const Buffer& recv,
                                   std::span<const std::size_t> counts, ReduceOp op) = 0;
  virtual Work do_all_to_all_v(const Buffer& send, const Buffer& recv,
                               std::span<const std::size_t> counts) = 0;
  virtual void do_barrier() = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;
  virtual void do_group_start() {}
  virtual void do_group_end() {}
  // With CommOptions::validate_order: compare `call`'s fingerprint with every rank's and throw
  // InvalidArgument naming both calls on a mismatch (NCCL: at a later call or wait, once the GPU
  // ran the exchange). The local backend, whose posts meet and are compared anyway, only adds
  // the call's label to its post.
  virtual void do_validate(const CallRecord& call) { (void)call; }

  std::shared_ptr<const FlightRecorder> recorder() const { return recorder_; }

  int group_depth() const { return group_depth_; }

 private:
  CallRecord record(CollectiveKind kind, const Buffer& main, std::size_t count,
                    std::int64_t root = -1, std::optional<ReduceOp> op = std::nullopt) const {
    CallRecord call;
    call.kind = kind;
    call.dtype = main.dtype;
    call.count = count;
    call.root = root;
    call.reduces = op.has_value();
    call.op = op.value_or(ReduceOp::sum);
    return call;
  }

  // Numbers the call, records it, and checks it against the other ranks' when asked.
  void begin_call(CallRecord call) {
    call.seq = calls_++;
    call.label = label_;
    recorder_->add(call);
    if (options_.validate_order && size_ > 1) do_validate(call);
  }

  // Checks `buffers` with the backend, begins the call and counts it once the backend accepted
  // it (a rejected call moved nothing).
  template <class Issue>
  Work counted(std::string_view name, CallRecord call, std::size_t payload_bytes,
               std::initializer_list<Buffer> buffers, Issue&& issue) {
    do_check_buffers(name, std::span<const Buffer>(buffers.begin(), buffers.size()));
    const CollectiveKind kind = call.kind;
    begin_call(std::move(call));
    Work work = in_step(std::forward<Issue>(issue));
    stats_.record(kind, payload_bytes, size_);
    return work;
  }

  // Issues a begun call. Once begun, the other ranks count on this rank's part of it (and with
  // the order check they have exchanged its fingerprint): a backend that fails to issue it
  // leaves them in a call this rank skipped, and this rank's next call would pair with it -- a
  // wrong pairing, not a refusal. So such a failure makes every later call refuse.
  template <class Issue>
  auto in_step(Issue&& issue) -> decltype(issue()) {
    try {
      return issue();
    } catch (const CallsDiffer&) {  // (refused on every rank alike: still in step)
      throw;
    } catch (const std::exception& e) {
      if (size_ > 1 && out_of_step_.empty())
        out_of_step_ =
            shardkit::detail::concat(recorder_->describe(call_number()), " failed on rank ", rank_,
                                     " after it began (", e.what(), ")");
      throw;
    }
  }

  friend class GroupScope;

  void check_usable(std::string_view call) const {
    const std::string reason = aborted_reason();
    if (!reason.empty())
      fail<CommunicatorAborted>(where(call), ": the communicator was aborted (", reason,
                                "); create a new one");
    if (!out_of_step_.empty())
      fail<CommunicatorAborted>(where(call), ": the ranks are out of step (", out_of_step_,
                                "; the others wait in it or will time out); create a new "
                                "communicator");
  }

  // Whether a call combines values (and so needs a dtype it can add) or only moves them.
  enum class Reduces { no, yes };

  void check_call(std::string_view call, const Buffer& main, Reduces reduces) const {
    check_usable(call);
    if (reduces == Reduces::yes)
      check(is_comm_dtype(main.dtype), where(call), ": dtype ", dtype_name(main.dtype),
            " is not supported; reductions combine f32, f64, f16 or bf16");
    else
      check(is_movable_dtype(main.dtype), where(call), ": dtype ", dtype_name(main.dtype),
            " is not supported; collectives move f32, f64, f16, bf16 or u8 (bytes)");
  }

  void check_root(std::string_view call, int root) const {
    check(root >= 0 && root < size_, where(call), ": root ", root,
          " is out of range; pass a rank in [0, ", size_, ")");
  }

  // `other` must match `main`'s dtype and device and hold at least `needed` elements.
  void check_pair(std::string_view call, const Buffer& main, const Buffer& other,
                  std::size_t needed, std::string_view needed_name,
                  std::string_view other_name = "recv") const {
    check(other.dtype == main.dtype, where(call), ": ", other_name, " is ", dtype_name(other.dtype),
          " but the data is ", dtype_name(main.dtype), "; pass buffers of one dtype");
    check(other.device == main.device, where(call), ": ", other_name, " is on ", other.device,
          " but the data is on ", main.device, "; pass buffers on one device");
    check(other.count >= needed, where(call), ": ", other_name, " holds ", other.count, " ",
          dtype_name(other.dtype), " elements but needs ", needed_name, " = ", needed,
          "; pass a bigger buffer");
  }

  void check_same_or_disjoint(std::string_view call, const Buffer& a, const Buffer& b) const {
    check(a.data == b.data || !overlaps(a, b), where(call),
          ": send and recv partly overlap; pass the same buffer (in place) or disjoint ones");
  }

  // The in-place form: `part` is exactly segment `rank` (of `part_count`) of `whole`.
  void check_in_place_or_disjoint(std::string_view call, const Buffer& part, const Buffer& whole,
                                  std::size_t part_count, std::string_view part_name,
                                  std::string_view whole_name) const {
    if (!overlaps(part, whole)) return;
    const Buffer own = whole.slice(part_count * static_cast<std::size_t>(rank_), part_count);
    check(part.data == own.data, where(call), ": ", part_name, " overlaps ", whole_name,
          " but is not this rank's segment (element ", part_count * static_cast<std::size_t>(rank_),
          "); pass disjoint buffers, or ", part_name, " = ", whole_name,
          " + rank x count for the "
          "in-place form");
  }

  // The total of the per-rank `counts` of an uneven collective, once `buffer` (the argument
  // called `name`) is checked to cover every owner's segment.
  std::size_t check_segments(std::string_view call, const Buffer& buffer, const char* name,
                             std::span<const std::size_t> counts, Reduces reduces) const {
    check_call(call, buffer, reduces);
    check(counts.size() == static_cast<std::size_t>(size_), where(call), ": ", counts.size(),
          " counts given for ", size_, " ranks; pass one count per rank");
    // (a count near SIZE_MAX wrapped the sum into a small one, which the buffer passed, and
    // the copies then ran off its end)
    std::size_t total = 0;
    bool wraps = false;
    for (const std::size_t count : counts)
      wraps = wraps || __builtin_add_overflow(total, count, &total);
    check(!wraps && buffer.count >= total, where(call), ": ", name, " holds ", buffer.count, " ",
          dtype_name(buffer.dtype), " elements but the counts add up to ",
          wraps ? std::string("more than 2^64") : std::to_string(total),
          "; pass a buffer covering every owner's segment");
    return total;
  }

  int rank_;
  int size_;
  CommOptions options_;
  CommStats stats_;
  int group_depth_ = 0;
  std::uint64_t calls_ = 0;
  std::string_view label_;   // the innermost Label's text
  std::string out_of_step_;  // why the ranks' calls no longer pair (in_step); empty while they do
  std::shared_ptr<FlightRecorder> recorder_ = std::make_shared<FlightRecorder>();
  std::vector<std::shared_ptr<void>> attached_;
};

inline GroupScope::GroupScope(Communicator& comm)
    : comm_(&comm), uncaught_at_start_(std::uncaught_exceptions()) {
  comm.check_usable("group");
  comm.do_group_start();
  ++comm.group_depth_;
}

inline void GroupScope::end() {
  if (comm_ == nullptr) return;
  Communicator* comm = std::exchange(comm_, nullptr);
  --comm->group_depth_;
  comm->do_group_end();
}

inline GroupScope::~GroupScope() noexcept(false) {
  if (comm_ == nullptr) return;
  if (std::uncaught_exceptions() > uncaught_at_start_) {
    try {
      end();
    } catch (...) {  // the exception already propagating says more
    }
    return;
  }
  end();
}

}  // namespace shardkit::comm
