// Checkpoints as step folders behind one pointer: DIR/step_000000123/ holds one complete save
// (save_checkpoint's files in either layout, plus whatever per-rank files the caller adds), and
// DIR/latest names the newest complete folder. A save writes a fresh folder; only when every
// rank has finished it does rank 0 replace `latest` (temporary file, fsync, rename, folder
// fsync) and then remove the older folders. A crash at any moment leaves `latest` naming a
// complete checkpoint -- the previous one until the switch, the new one after it -- so a run
// killed mid-save resumes from the last good save instead of refusing a torn pair. The folder
// `latest` names is never removed or rewritten before the switch: a second save of the same
// step (a trainer's epoch-end save right after that iteration's) goes to the step's other
// folder, step_000000123.resaved, and the two alternate. A failure on any rank (a full disk)
// is refused on every rank -- its own error there, a PeerFailed naming it elsewhere -- and
// leaves `latest` as it was.
#pragma once

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include "shardkit/checkpoint/training_checkpoint.hpp"

namespace shardkit::checkpoint {

inline std::string step_folder_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%09lld", static_cast<long long>(step));
  return name;
}

// `text` as the file `path`, replacing it atomically.
inline void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  try {  // (a full disk fails here: the temporary does not stay behind to fill it further)
    detail::PosixFile file(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
    file.write_at(0, text.data(), text.size());
    file.sync_and_close();
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    check<IoError>(!error, "replacing '", path, "' failed: ", error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
  detail::sync_folder(std::filesystem::path(path).parent_path());
}

namespace detail {

// The folder name DIR/latest holds, or nothing when there is none. Only a missing file means
// none: a `latest` that cannot be read (no file descriptors left, an I/O error, a stale network
// handle) is refused, for taken as none it would start the run afresh, and its first save would
// then remove the checkpoint that `latest` names.
inline std::optional<std::string> latest_folder_name(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "latest").string();
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (status.type() == std::filesystem::file_type::not_found) return std::nullopt;
  check<IoError>(!error, "could not look at '", path, "' (", error.message(),
                 "), which names the checkpoint in force; fix the cause and run again");
  check<IoError>(status.type() == std::filesystem::file_type::regular, "'", path,
                 "' is not a file: it is not the pointer a save writes; restore it, or remove it "
                 "to start afresh");
  PosixFile file(path, O_RDONLY | O_CLOEXEC);  // (refuses, naming errno, what it cannot open)
  const std::uint64_t size = file.size();
  check<IoError>(size <= 4096, "'", path, "' holds ", size,
                 " bytes: it is not the one-line pointer a save writes; restore it, or remove it "
                 "to start afresh");
  std::string text(static_cast<std::size_t>(size), '\0');
  file.read_at(0, text.data(), text.size(), "the checkpoint's name");
  const std::string name = text.substr(0, text.find('\n'));
  check<IoError>(!name.empty(), "'", path,
                 "' names no folder (a save writes it whole: it was changed by hand); restore it, "
                 "or remove it to start afresh");
  return name;
}

}  // namespace detail

// The folder `DIR/latest` names, or nothing when there is no complete checkpoint in `dir`.
inline std::optional<std::string> latest_checkpoint(const std::string& dir) {
  const auto name = detail::latest_folder_name(dir);
  if (!name) return std::nullopt;
  const auto folder = std::filesystem::path(dir) / *name;
  check<IoError>(std::filesystem::is_directory(folder), "'", dir, "/latest' names '", *name,
                 "', which is missing; the checkpoint folder was changed by hand -- restore it "
                 "or remove '",
                 dir, "/latest' to start afresh");
  return folder.string();
}

namespace detail {

// A step's second folder, for a save of the step `latest` names already.
inline std::string resaved_folder_name(std::int64_t step) {
  return step_folder_name(step) + ".resaved";
}

// Rank 0, before a save of `step` into DIR/`name`: an empty folder (a save of it that a crash
// left unfinished is removed), and no temporary of an interrupted pointer update.
inline void prepare_step_folder(const std::string& dir, const std::string& name) {
  const auto folder = std::filesystem::path(dir) / name;
  std::filesystem::create_directories(dir);
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().rfind("latest.tmp.", 0) == 0)
      std::filesystem::remove(entry.path());
}

// Collective: rank 0 picks the folder a save of `step` writes -- the step's name, or its second
// name where `latest` names the first, so that the checkpoint in force is never touched -- and
// prepares it; every rank learns the folder, or rank 0's failure (its error there, PeerFailed
// elsewhere). Returns the folder's path.
inline std::string begin_step_folder(Context& ctx, comm::Communicator& comm, const std::string& dir,
                                     std::int64_t step) {
  std::exception_ptr error;
  float choice = 0;  // 0: the step's name; 1: its second name; -1: rank 0 failed
  if (comm.rank() == 0) try {
      choice = latest_folder_name(dir) == step_folder_name(step) ? 1.0f : 0.0f;
      prepare_step_folder(dir, choice > 0 ? resaved_folder_name(step) : step_folder_name(step));
    } catch (...) {
      error = std::current_exception();
      choice = -1;
    }
  Tensor t = from_vector(ctx, std::vector<float>{choice}, {1});
  comm.broadcast(t, 0).wait();
  choice = to_vector<float>(ctx, t)[0];
  if (error) std::rethrow_exception(error);
  if (choice < 0)
    throw comm::PeerFailed(shardkit::detail::concat(
        "rank 0 could not prepare the folder of step ", step, "'s checkpoint in '", dir,
        "' (its error says why); '", dir, "/latest' still names the one before"));
  const std::string name = choice > 0 ? resaved_folder_name(step) : step_folder_name(step);
  return (std::filesystem::path(dir) / name).string();
}

// What the ranks that did their part of a save of `step` throw (PeerFailed) when rank(s)
// `ranks` failed to do `what`: agree_on_outcome's message, for the foreground and background
// saves alike. `latest` says what DIR/latest names then.
inline auto step_failure(const std::string& dir, std::int64_t step, const char* what,
                         const char* latest) {
  return [dir, step, what, latest](const std::string& ranks) {
    return shardkit::detail::concat("the checkpoint of step ", step, " in '", dir, "' failed to ",
                                    what, " on rank(s) ", ranks, " (their errors say why); '", dir,
                                    "/latest' ", latest);
  };
}

// Rank 0, once every rank's files in `folder` (a path begin_step_folder returned) are committed:
// `latest` names it (replaced atomically), then every other step folder goes. What cannot be
// removed stays for the next publish to remove: the save itself is in force by then.
inline void publish_step_folder(const std::string& dir, const std::string& folder) {
  const std::string name = std::filesystem::path(folder).filename().string();
  write_text_atomically((std::filesystem::path(dir) / "latest").string(), name + "\n");
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ignored)) {
    const std::string other = entry.path().filename().string();
    if (entry.is_directory(ignored) && other.rfind("step_", 0) == 0 && other != name)
      std::filesystem::remove_all(entry.path(), ignored);
  }
}

}  // namespace detail

// Saves `state` as DIR/step_<step>/ (or, saving the step `latest` names again, as its second
// folder: see above) and makes it the latest; returns the folder. `extra(folder)` runs on every
// rank after the collective save and before the switch (per-rank files of the caller's own);
// under hybrid sharding only the first group saves, `extra` included. A failure on any rank
// (the save's files, `extra`, the switch) throws on every rank and leaves `latest` as it was.
// Collective.
inline std::string save_step_checkpoint(const std::string& dir, std::int64_t step,
                                        parallel::TrainingState& state,
                                        const CheckpointOptions& options = {},
                                        const std::function<void(const std::string&)>& extra = {}) {
  detail::check_state(state, "save_step_checkpoint");
  Context& ctx = state.optimizer->context();
  if (state.replicas != nullptr && state.replicas->size() > 1) {  // the first group saves
    parallel::TrainingState group_state = state;
    group_state.replicas = nullptr;
    std::string folder;
    detail::save_in_first_group(ctx, state.replicas, [&] {
      folder = save_step_checkpoint(dir, step, group_state, options, extra);
    });
    // The other groups learn which of the step's two folders the first group wrote.
    const bool second = !folder.empty() && std::filesystem::path(folder).filename().string() ==
                                               detail::resaved_folder_name(step);
    Tensor flag = from_vector(ctx, std::vector<float>{second ? 1.0f : 0.0f}, {1});
    state.replicas->all_reduce(flag, comm::ReduceOp::max).wait();
    const bool resaved = to_vector<float>(ctx, flag)[0] > 0.0f;
    return (std::filesystem::path(dir) /
            (resaved ? detail::resaved_folder_name(step) : step_folder_name(step)))
        .string();
  }
  auto& comm = *state.comm;
  const std::string folder = detail::begin_step_folder(ctx, comm, dir, step);
  save_checkpoint(folder, state, options);  // (the ranks agree on its outcome)
  std::exception_ptr error;
  if (extra) try {
      extra(folder);
    } catch (...) {
      error = std::current_exception();
    }
  auto failed_on = [&](const char* what, const char* latest) {
    return detail::step_failure(dir, step, what, latest);
  };
  detail::agree_on_outcome(ctx, comm, error,
                           failed_on("write the caller's files", "still names the one before"));
  if (comm.rank() == 0) try {
      detail::publish_step_folder(dir, folder);
    } catch (...) {
      error = std::current_exception();
    }
  detail::agree_on_outcome(
      ctx, comm, error,
      failed_on("publish", "names the one before, or this one where its switch was not flushed"));
  return folder;
}

}  // namespace shardkit::checkpoint
