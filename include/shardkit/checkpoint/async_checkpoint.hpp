// Step checkpoints written in the background, as torch.distributed.checkpoint's async_save:
//
//   AsyncCheckpointer saver(dir);                 one per rank
//   saver.save(step, state, {.layout = sharded});  collective; returns once this rank's state is
//                                                  copied into host staging memory
//   ... training goes on while the files are written ...
//   saver.finish();                                collective; before exit (the next save does it)
//
// A save copies this rank's pieces of the parameters and optimizer state (and rank 0 the
// replicated tensors) into host buffers kept between saves, so the blocking part is one copy of
// the rank's state; a background thread then writes the rank's file of the sharded layout
// (checksums, fsync, atomic rename) into the step's folder (DIR/step_<step>/, or its second
// folder when `latest` names that one: step_folders.hpp) and leaves an empty marker
// `.written.<rank>` beside it. Rank 0's thread waits for every rank's marker and then makes the
// step the latest, exactly as save_step_checkpoint does. No collective runs in the background,
// so the training's collectives never interleave with a save's; the markers are how the ranks
// agree that the files are down before finish(), which tells rank 0's thread so directly.
//
// What holds at every moment: `latest` names a complete checkpoint -- the previous one until
// every rank's file of the new one is committed, the new one after. A crash or a failed write
// (disk full) leaves the previous one in force. The next save, and finish(), first wait for the
// save in flight and make every rank learn its outcome: a rank whose save failed -- its copy
// into staging, `extra`, or the write -- throws its error, the others a PeerFailed naming it,
// so no rank trains on believing a save that was lost (save() itself throws only for bad
// options, on every rank alike). A second save therefore never
// overlaps the first. The destructor waits for this rank's write and publishes only a step every
// rank has finished; call finish() to be sure the newest save is published (a save the
// destructor finds failed or unpublished is said on stderr: it cannot throw).
//
// Only the sharded layout is written in the background: the full layout streams every piece to
// rank 0, which needs collectives (convert a sharded checkpoint with `shardkit-ckpt consolidate`).
// The staging costs one copy of the rank's state in host memory while a save is in flight.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/checkpoint/step_folders.hpp"

namespace shardkit::checkpoint {

class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(std::string dir) : dir_(std::move(dir)) {}
  // Waits for this rank's write; a save that failed, or that rank 0 could not publish because
  // not every rank's file was down, is reported on stderr (a destructor cannot throw it, and
  // lost without a word the run would believe a checkpoint that is not there).
  ~AsyncCheckpointer() {
    abandoned_ = true;
    if (worker_.joinable()) worker_.join();
    if (!in_flight_ || !written_.valid()) return;
    std::string outcome;
    try {
      written_.get();
      if (publish_error_) std::rethrow_exception(publish_error_);
      if (publisher_ && !published_.load())
        outcome =
            "was not published: the saver was destroyed before every rank's file was "
            "down (call finish() before it goes)";
    } catch (const std::exception& e) {
      outcome = shardkit::detail::concat("failed: ", e.what());
    } catch (...) {
      outcome = "failed";
    }
    if (outcome.empty()) return;
    const std::string text = shardkit::detail::concat(
        "shardkit: the background checkpoint of step ", step_, " in '", dir_, "' ", outcome, "; '",
        dir_, "/latest' still names the one before\n");
    std::fwrite(text.data(), 1, text.size(), stderr);
    std::fflush(stderr);
  }
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Saves `state` as the step's folder in the background (see above) and returns the folder;
  // `extra(folder)` runs on every saving rank before this returns (per-rank files of the
  // caller's own, written synchronously). Under hybrid sharding the first group saves (the
  // other groups' ranks get an empty folder name: the first group prepares it meanwhile).
  // Collective.
  std::string save(std::int64_t step, parallel::TrainingState state,
                   const CheckpointOptions& options = {},
                   const std::function<void(const std::string&)>& extra = {}) {
    detail::check_state(state, "AsyncCheckpointer::save");
    check(options.layout == CheckpointLayout::sharded,
          "AsyncCheckpointer::save: the full layout streams every piece to rank 0 through "
          "collectives, which cannot run beside the training; save with the sharded layout "
          "(CheckpointOptions::layout = sharded) and consolidate later with `shardkit-ckpt "
          "consolidate` if one file is wanted");
    finish();
    comm_ = state.comm;
    replicas_ = state.replicas != nullptr && state.replicas->size() > 1 ? state.replicas : nullptr;
    ctx_ = &state.optimizer->context();
    step_ = step;
    in_flight_ = true;
    written_ = {};
    if (replicas_ != nullptr && replicas_->rank() != 0) return {};  // the first group saves
    state.replicas = nullptr;
    auto& comm = *comm_;
    // (shared: a thread that fails to start must not take the promise down with it)
    auto written = std::make_shared<std::promise<void>>();
    written_ = written->get_future();
    abandoned_ = false;
    all_written_ = false;
    published_ = false;
    publisher_ = comm.rank() == 0;
    std::string folder;
    std::shared_ptr<detail::ShardSnapshot> snapshot;
    try {
      folder = detail::begin_step_folder(*ctx_, comm, dir_, step);  // (agreed: all or none)
      const std::string id = detail::agree_on_checkpoint_id(*ctx_, comm);
      snapshot = std::make_shared<detail::ShardSnapshot>(
          detail::snapshot_shard(folder, state, id, options, std::move(staging_)));
      state.optimizer->spill_state();  // (offload to NVMe: what the snapshot read, out of RAM)
      if (extra) extra(folder);
    } catch (...) {
      // This rank's part failed before its write began (rank 0 could not prepare the folder,
      // no host memory for the staging, a full disk under `extra`): its outcome, which finish()
      // makes every rank learn, the other replica groups too -- thrown here, it would leave the
      // other ranks' finish() believing the save and rank 0's thread waiting for this rank's
      // marker.
      written->set_exception(std::current_exception());
      return folder;
    }
    try {
      worker_ =
          std::thread([this, snapshot, folder, rank = comm.rank(), world = comm.size(), written] {
            write_and_publish(*snapshot, folder, rank, world, *written);
          });
    } catch (...) {
      // No thread (the process's thread limit): this rank's write failed, which finish() makes
      // every rank learn -- thrown here, on this rank alone, the others would train on.
      staging_ = std::move(snapshot->values);
      written->set_exception(std::current_exception());
    }
    return folder;
  }

 private:
  // The background thread's work: this rank's file and marker, then (rank 0) the switch.
  void write_and_publish(detail::ShardSnapshot& snapshot, const std::string& folder, int rank,
                         int world, std::promise<void>& written) {
    std::exception_ptr error;
    try {
      detail::write_shard(snapshot);
      touch(marker(folder, rank));
    } catch (...) {
      error = std::current_exception();
    }
    staging_ = std::move(snapshot.values);  // kept for the next save
    if (error) {
      written.set_exception(error);
      return;
    }
    written.set_value();
    if (rank == 0) publish_when_written(folder, world);
  }

 public:
  // Waits for the save in flight: every rank's file written, the step published, and every
  // rank told the outcome (throws as described above). No-op without a save in flight.
  // Collective.
  void finish() {
    if (!in_flight_) return;
    in_flight_ = false;
    std::exception_ptr failure;
    if (replicas_ == nullptr || replicas_->rank() == 0) {
      auto failed_on = [&](const char* what, const char* latest) {
        return detail::step_failure(dir_, step_, what, latest);
      };
      std::exception_ptr error;
      try {
        if (written_.valid()) written_.get();
      } catch (...) {
        error = std::current_exception();
      }
      try {
        detail::agree_on_outcome(*ctx_, *comm_, error,
                                 failed_on("write", "still names the one before"));
        // Every file and marker is down: rank 0's thread publishes the step and ends (without
        // looking for the markers again: a network file system may be slow to show them).
        all_written_ = true;
        std::exception_ptr publish_error;
        try {
          join();
        } catch (...) {
          publish_error = std::current_exception();
        }
        detail::agree_on_outcome(
            *ctx_, *comm_, publish_error,
            failed_on("publish",
                      "names the one before, or this one where its switch was not flushed"));
      } catch (...) {
        failure = std::current_exception();
        abandon();  // rank 0's thread stops waiting for markers that will not come
      }
    }
    const bool first_group_failed = share_with_replicas(failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    if (first_group_failed)
      throw comm::PeerFailed(shardkit::detail::concat(
          "the checkpoint of step ", step_, " in '", dir_,
          "' failed in the first group of ranks, which saves it (its errors are on its ranks)"));
  }

  bool in_flight() const { return in_flight_; }

 private:
  static std::string marker(const std::string& folder, int rank) {
    return (std::filesystem::path(folder) / (".written." + std::to_string(rank))).string();
  }

  // The marker: an empty file whose existence is the signal (the shard it follows was synced
  // and renamed into place before it), so it needs no fsync of its own.
  static void touch(const std::string& path) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    check<IoError>(fd >= 0, "cannot create the marker '", path, "': ", std::strerror(errno));
    ::close(fd);
  }

  // Rank 0's thread: once every rank's marker is there (or finish() has learnt that every rank
  // wrote), the step becomes the latest and the markers go; given up when abandon() says so (a
  // rank failed, or the object is destroyed -- then only a step that is already complete is
  // published). Its errors are finish()'s to report: none leaves the thread.
  void publish_when_written(const std::string& folder, int world) {
    try {
      auto all_written = [&] {
        if (all_written_.load()) return true;
        for (int r = 0; r < world; ++r)
          if (!std::filesystem::exists(marker(folder, r))) return false;
        return true;
      };
      while (!all_written()) {
        if (abandoned_.load()) {
          if (!all_written()) return;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      detail::publish_step_folder(dir_, folder);
      published_ = true;
    } catch (...) {
      publish_error_ = std::current_exception();
      return;
    }
    std::error_code ignored;  // (the step is in force: a marker left is removed with its folder)
    for (int r = 0; r < world; ++r) std::filesystem::remove(marker(folder, r), ignored);
  }

  void join() {
    if (worker_.joinable()) worker_.join();
    if (publish_error_) std::rethrow_exception(std::exchange(publish_error_, nullptr));
  }

  void abandon() {
    abandoned_ = true;
    if (worker_.joinable()) worker_.join();
    publish_error_ = nullptr;
  }

  // Hybrid sharding: the other groups learn whether the first group's save failed (max of the
  // flags over the replica groups). Returns whether it did.
  bool share_with_replicas(bool failed) {
    if (replicas_ == nullptr) return false;
    Tensor flag = from_vector(*ctx_, std::vector<float>{failed ? 1.0f : 0.0f}, {1});
    replicas_->all_reduce(flag, comm::ReduceOp::max).wait();
    return to_vector<float>(*ctx_, flag)[0] > 0.0f;
  }

  std::string dir_;
  comm::Communicator* comm_ = nullptr;
  comm::Communicator* replicas_ = nullptr;
  Context* ctx_ = nullptr;
  std::int64_t step_ = 0;
  bool in_flight_ = false;
  std::future<void> written_;
  std::thread worker_;
  std::atomic<bool> abandoned_{false};
  std::atomic<bool> all_written_{false};  // finish() learnt that every rank's file is down
  std::atomic<bool> published_{false};    // rank 0's thread made the save in flight the latest
  bool publisher_ = false;                // this rank's thread publishes (rank 0 of the savers)
  std::exception_ptr publish_error_;
  std::vector<NamedBytes> staging_;  // the last snapshot's buffers, reused by the next
};

}  // namespace shardkit::checkpoint
