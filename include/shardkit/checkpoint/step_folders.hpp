// Checkpoints as step folders behind one pointer: DIR/step_000000123/ holds one complete save
// (save_checkpoint's files in either layout, plus whatever per-rank files the caller adds), and
// DIR/latest names the newest complete folder. A save writes a fresh folder; only when every
// rank has finished it does rank 0 replace `latest` (temporary file, fsync, rename, folder
// fsync) and then remove the older folders. A crash at any moment leaves `latest` naming a
// complete checkpoint -- the previous one until the switch, the new one after it -- so a run
// killed mid-save resumes from the last good save instead of refusing a torn pair.
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
  {
    detail::PosixFile file(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC);
    file.write_at(0, text.data(), text.size());
    file.sync_and_close();
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  check<IoError>(!error, "replacing '", path, "' failed: ", error.message());
  const auto folder = std::filesystem::path(path).parent_path();
  const int dir = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

// The folder `DIR/latest` names, or nothing when there is no complete checkpoint in `dir`.
inline std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::ifstream in(std::filesystem::path(dir) / "latest");
  std::string name;
  if (!in || !std::getline(in, name) || name.empty()) return std::nullopt;
  const auto folder = std::filesystem::path(dir) / name;
  check<IoError>(std::filesystem::is_directory(folder), "'", dir, "/latest' names '", name,
                 "', which is missing; the checkpoint folder was changed by hand -- restore it "
                 "or remove '",
                 dir, "/latest' to start afresh");
  return folder.string();
}

namespace detail {

// Rank 0, before a save of `step`: an empty DIR/step_<step>/ (a save of this step that a crash
// left unfinished is removed), and no temporary of an interrupted pointer update.
inline void prepare_step_folder(const std::string& dir, std::int64_t step) {
  const auto folder = std::filesystem::path(dir) / step_folder_name(step);
  std::filesystem::create_directories(dir);
  std::filesystem::remove_all(folder);
  std::filesystem::create_directories(folder);
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().rfind("latest.tmp.", 0) == 0)
      std::filesystem::remove(entry.path());
}

// Rank 0, once every rank's files of `step` are committed: `latest` names it (replaced
// atomically), then every other step folder goes.
inline void publish_step_folder(const std::string& dir, std::int64_t step) {
  write_text_atomically((std::filesystem::path(dir) / "latest").string(),
                        step_folder_name(step) + "\n");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("step_", 0) == 0 && name != step_folder_name(step))
      std::filesystem::remove_all(entry.path());
  }
}

}  // namespace detail

// Saves `state` as DIR/step_<step>/ and makes it the latest. `extra(folder)` runs on every rank
// after the collective save and before the switch (per-rank files of the caller's own); under
// hybrid sharding only the first group saves, `extra` included.
// Collective.
inline std::string save_step_checkpoint(const std::string& dir, std::int64_t step,
                                        parallel::TrainingState& state,
                                        const CheckpointOptions& options = {},
                                        const std::function<void(const std::string&)>& extra = {}) {
  if (state.replicas != nullptr && state.replicas->size() > 1) {  // the first group saves
    parallel::TrainingState group_state = state;
    group_state.replicas = nullptr;
    detail::save_in_first_group(state.optimizer->context(), state.replicas, [&] {
      (void)save_step_checkpoint(dir, step, group_state, options, extra);
    });
    return (std::filesystem::path(dir) / step_folder_name(step)).string();
  }
  auto& comm = *state.comm;
  const auto folder = std::filesystem::path(dir) / step_folder_name(step);
  if (comm.rank() == 0) detail::prepare_step_folder(dir, step);
  comm.barrier();
  save_checkpoint(folder.string(), state, options);
  if (extra) extra(folder.string());
  comm.barrier();  // every rank's files are committed
  if (comm.rank() == 0) detail::publish_step_folder(dir, step);
  comm.barrier();
  return folder.string();
}

}  // namespace shardkit::checkpoint
