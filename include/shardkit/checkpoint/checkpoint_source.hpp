// A saved training checkpoint opened for reading, whatever its layout (io/checkpoint.hpp
// writes both):
//
//   full     model.safetensors      every trainable parameter whole (PyTorch state-dict names,
//                                   what torch's load_state_dict takes) and the replicated
//                                   tensors (buffers, frozen parameters);
//            optimizer.safetensors  every state buffer whole ("<param>.<buffer>", PyTorch's
//                                   buffer names), the optimizer kind, step count and
//                                   parameter list.
//   sharded  shard-RRRRR-of-NNNNN.safetensors, one per saving rank: that rank's pieces of the
//            parameters and of their state, named "<param>[begin:end]" and
//            "<param>.<buffer>[begin:end]", described in the metadata (which parameter,
//            which buffer, which elements of the flattened tensor); rank 0's file also holds
//            the replicated tensors whole.
//
// Every file carries the checkpoint's id (random per save) and step count: files of two
// different saves are refused, naming both. What remains is pieces: for a parameter (or one
// of its state buffers) the elements [begin, end) of its flattened values, in some file. A
// rank that loads asks for exactly the elements it holds and reads only those bytes, so any
// layout loads into any stage and any world size.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardkit/checkpoint/optimizer_state_file.hpp"
#include "shardkit/checkpoint/safetensors.hpp"

namespace shardkit::checkpoint {

enum class CheckpointLayout { full, sharded };

inline std::string_view checkpoint_layout_name(CheckpointLayout layout) {
  return layout == CheckpointLayout::full ? "full" : "sharded";
}

inline constexpr std::string_view kShardedCheckpointFormat = "shardkit.sharded_checkpoint.v1";
inline constexpr const char* kFullModelFile = "model.safetensors";
inline constexpr const char* kFullOptimizerFile = "optimizer.safetensors";

inline std::string shard_file_name(int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-of-%05d.safetensors", rank, world_size);
  return name;
}

// True when `name` is shard_file_name(rank, world) of some rank and world size.
inline bool parse_shard_file_name(const std::string& name, int& rank, int& world) {
  char tail = 0;
  return std::sscanf(name.c_str(), "shard-%d-of-%d.safetensor%c", &rank, &world, &tail) == 3 &&
         tail == 's' && rank >= 0 && world > 0 && name == shard_file_name(rank, world);
}

// Metadata keys a checkpoint keeps for itself; a caller's metadata may use any other.
inline bool is_reserved_checkpoint_key(const std::string& key) {
  return key == "format" || key == "optimizer" || key == "steps" || key == "parameters" ||
         key == "pieces" || key.rfind("shardkit.", 0) == 0;
}

namespace detail {

inline void remove_quietly(const std::filesystem::path& path) {
  std::error_code ignored;
  std::filesystem::remove(path, ignored);
}

// After a complete save: files of the other layout or of other world sizes in the folder are
// stale; remove them so the folder holds one checkpoint.
inline void remove_stale_files(const std::string& dir, CheckpointLayout kept, int world) {
  namespace fs = std::filesystem;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    int rank = -1, shard_world = -1;
    if (parse_shard_file_name(name, rank, shard_world)) {
      if (kept == CheckpointLayout::full || shard_world != world) stale.push_back(entry.path());
    } else if (kept == CheckpointLayout::sharded &&
               (name == kFullModelFile || name == kFullOptimizerFile)) {
      stale.push_back(entry.path());
    }
  }
  for (const auto& path : stale) remove_quietly(path);
  if (stale.empty()) return;
  try {  // (the removals made durable: files back after a crash would mix two saves)
    sync_folder(dir);
  } catch (const IoError&) {  // (quietly, as the removals: the save itself is complete)
  }
}

}  // namespace detail

// A shard file's tensor of elements [begin, end) of `param`'s flattened values (`buffer`
// empty) or of one of its state buffers: its name, and its entry in the file's "pieces"
// metadata (what CheckpointSource reads back).
inline std::string piece_tensor_name(const std::string& param, const std::string& buffer,
                                     std::int64_t begin, std::int64_t end) {
  return param + (buffer.empty() ? "" : "." + buffer) + "[" + std::to_string(begin) + ":" +
         std::to_string(end) + "]";
}
inline nlohmann::json piece_entry(const std::string& param, const std::string& buffer,
                                  std::int64_t begin, std::int64_t end) {
  return {{"tensor", piece_tensor_name(param, buffer, begin, end)},
          {"param", param},
          {"buffer", buffer},
          {"begin", begin},
          {"end", end}};
}

// Elements [begin, end) of a tensor's flattened values, stored as tensor `tensor` of `file`
// (whole tensors: begin 0, end numel).
struct PieceSource {
  const SafetensorsReader* file = nullptr;
  const TensorInfo* tensor = nullptr;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

class CheckpointSource {
 public:
  // Opens the checkpoint in `dir`: the sharded set if shard files are there, else the full
  // pair. Everything the files claim is checked here, before anything is loaded.
  explicit CheckpointSource(std::string dir) : dir_(std::move(dir)) {
    namespace fs = std::filesystem;
    check<IoError>(fs::is_directory(dir_), "no checkpoint folder '", dir_, "'");
    std::map<int, std::vector<std::pair<int, std::string>>> shards;  // world size -> rank, file
    for (const auto& entry : fs::directory_iterator(dir_)) {
      int rank = -1, world = -1;
      const auto name = entry.path().filename().string();
      if (parse_shard_file_name(name, rank, world)) shards[world].emplace_back(rank, name);
    }
    // (a save into this folder under the other layout removes these files after its own are
    // in place: both there means it was cut short in between, and which one is in force is
    // not for a load to guess -- the older one was taken before)
    check<IoError>(shards.empty() || !fs::exists(fs::path(dir_) / kFullModelFile), "'", dir_,
                   "' holds both a full checkpoint (", kFullModelFile,
                   ") and shard files of a sharded one: a save into this folder in the other "
                   "layout was cut short before it removed the older files; remove the older "
                   "save's files (step folders of save_step_checkpoint never mix)");
    if (!shards.empty()) {
      check<IoError>(shards.size() == 1, "'", dir_, "' holds sharded checkpoints of ",
                     shards.size(), " world sizes (", shards.begin()->first, " and ",
                     shards.rbegin()->first,
                     "); keep one set per folder (remove the stale shard files)");
      open_sharded(shards.begin()->first, shards.begin()->second);
    } else {
      check<IoError>(fs::exists(fs::path(dir_) / kFullModelFile), "'", dir_,
                     "' holds no checkpoint: neither ", kFullModelFile, " nor shard-*-of-*",
                     ".safetensors files");
      open_full();
    }
  }

  const std::string& dir() const { return dir_; }
  CheckpointLayout layout() const { return layout_; }
  const std::string& id() const { return id_; }
  std::int64_t steps() const { return steps_; }
  int world_size() const { return world_size_; }
  const std::string& stage() const { return stage_; }
  optim::OptimizerKind optimizer_kind() const { return kind_; }
  // The trainable parameters, by name and shape, in the order they were saved.
  const ParamShapes& params() const { return params_; }
  // The loss scaler's state at save time (scale 0: the run had no scaler).
  double loss_scale() const { return loss_scale_; }
  std::int64_t growth_tracker() const { return growth_tracker_; }
  // The caller's metadata given at save time.
  const std::map<std::string, std::string>& metadata() const { return user_; }
  // All metadata of the model file (full) or rank 0's shard (sharded), reserved keys included.
  const std::map<std::string, std::string>& saved_metadata() const {
    return files_.front()->metadata();
  }
  // The files, model before optimizer (full) or by rank (sharded).
  const std::vector<std::unique_ptr<SafetensorsReader>>& files() const { return files_; }

  // Where a parameter's values (`buffer` empty) or one of its state buffers are; empty when
  // the checkpoint has none.
  const std::vector<PieceSource>& pieces(const std::string& param,
                                         const std::string& buffer = {}) const {
    static const std::vector<PieceSource> kNone;
    const auto found = pieces_.find({param, buffer});
    return found == pieces_.end() ? kNone : found->second;
  }
  // Whether any state buffer `buffer` is saved (for any parameter).
  bool has_state_buffer(const std::string& buffer) const {
    for (const auto& [key, list] : pieces_)
      if (key.second == buffer && !list.empty()) return true;
    return false;
  }
  // Replicated tensors (buffers, frozen parameters), by name.
  const std::map<std::string, PieceSource>& replicated() const { return whole_; }

  // True when `list` holds every element of [begin, end).
  static bool covers(std::vector<PieceSource> list, std::int64_t begin, std::int64_t end) {
    std::sort(list.begin(), list.end(),
              [](const PieceSource& a, const PieceSource& b) { return a.begin < b.begin; });
    std::int64_t at = begin;
    for (const auto& p : list)
      if (p.begin <= at && p.end > at) at = p.end;
    return at >= end;
  }
  // Reads elements [begin, end) (f32) from the pieces into dst (covers() must hold).
  static void read_range(const std::vector<PieceSource>& list, std::int64_t begin, std::int64_t end,
                         float* dst) {
    for (const auto& p : list) {
      const std::int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
      if (lo >= hi) continue;
      p.file->read(*p.tensor, static_cast<std::uint64_t>(lo - p.begin) * sizeof(float),
                   dst + (lo - begin), static_cast<std::size_t>(hi - lo) * sizeof(float));
    }
  }

 private:
  const SafetensorsReader& open_file(const std::string& name) {
    files_.push_back(
        std::make_unique<SafetensorsReader>((std::filesystem::path(dir_) / name).string()));
    return *files_.back();
  }
  PieceSource whole(const SafetensorsReader& file, const TensorInfo& t) {
    return PieceSource{&file, &t, 0, shape_numel(t.shape)};
  }

  void open_full() {
    layout_ = CheckpointLayout::full;
    const auto& model = open_file(kFullModelFile);
    const auto& optimizer = open_file(kFullOptimizerFile);
    id_ = model.meta("shardkit.checkpoint", "it was not written by checkpoint::save_checkpoint");
    const std::string& optimizer_id =
        optimizer.meta("shardkit.checkpoint", "it was not written by checkpoint::save_checkpoint");
    const auto info = parse_optimizer_metadata(optimizer);
    steps_ = parse_count(model, "shardkit.steps");
    check<IoError>(optimizer_id == id_ && info.steps == steps_, "the checkpoint in '", dir_,
                   "' is torn: ", kFullModelFile, " is from save ", id_, " (step ", steps_, "), ",
                   kFullOptimizerFile, " from save ", optimizer_id, " (step ", info.steps,
                   "); resume from a complete checkpoint");
    world_size_ = static_cast<int>(parse_count(model, "shardkit.world_size"));
    stage_ = model.meta("shardkit.stage", "it was not written by checkpoint::save_checkpoint");
    kind_ = info.kind;
    params_ = info.params;
    std::map<std::string, bool> trainable;
    for (const auto& [name, shape] : params_) {
      trainable[name] = true;
      const TensorInfo* t = model.find(name);
      check<IoError>(t != nullptr, "'", model.path(), "' lacks parameter '", name,
                     "' that its optimizer state lists: the files do not belong together");
      check<IoError>(t->dtype == DType::f32 && t->shape == shape, "'", model.path(), "': '", name,
                     "' is ", dtype_name(t->dtype), shape_text(t->shape), "; expected f32",
                     shape_text(shape));
      pieces_[{name, ""}].push_back(whole(model, *t));
      for (const auto buffer : optim::possible_state_buffers(kind_)) {
        const TensorInfo* s = optimizer.find(name + "." + std::string(buffer));
        if (s == nullptr) continue;
        check<IoError>(s->dtype == DType::f32 && s->shape == shape, "'", optimizer.path(), "': '",
                       s->name, "' is ", dtype_name(s->dtype), shape_text(s->shape),
                       "; expected f32", shape_text(shape));
        pieces_[{name, std::string(buffer)}].push_back(whole(optimizer, *s));
      }
    }
    for (const auto& t : model.tensors())
      if (!trainable.count(t.name)) whole_.emplace(t.name, whole(model, t));
    for (const auto& [key, value] : model.metadata())
      if (!is_reserved_checkpoint_key(key)) user_[key] = value;
    read_scaler(model);
  }

  void read_scaler(const SafetensorsReader& file) {
    const auto scale = file.metadata().find("shardkit.loss_scale");
    if (scale == file.metadata().end()) return;
    std::size_t used = 0;
    try {
      loss_scale_ = std::stod(scale->second, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    // (a scale that is no positive finite number was taken as "no scaler", silently)
    check<IoError>(used == scale->second.size() && std::isfinite(loss_scale_) && loss_scale_ > 0,
                   "'", file.path(), "': metadata 'shardkit.loss_scale' is '", scale->second,
                   "', not a positive finite number");
    growth_tracker_ = parse_count(file, "shardkit.growth_tracker");
  }

  void open_sharded(int world, std::vector<std::pair<int, std::string>> files) {
    layout_ = CheckpointLayout::sharded;
    world_size_ = world;
    std::sort(files.begin(), files.end());
    for (int r = 0; r < world; ++r)
      check<IoError>(
          r < static_cast<int>(files.size()) && files[static_cast<std::size_t>(r)].first == r,
          "the sharded checkpoint in '", dir_, "' lacks ", shard_file_name(r, world), " (",
          files.size(), " of ", world, " shard files are there)");
    for (const auto& [rank, name] : files) {
      const auto& file = open_file(name);
      const std::string& format =
          file.meta("format", "it was not written by checkpoint::save_checkpoint");
      check<IoError>(format == kShardedCheckpointFormat, "'", file.path(), "' holds '", format,
                     "', not a shard of a shardkit checkpoint (", kShardedCheckpointFormat, ")");
      const std::string& id = file.meta("shardkit.checkpoint", "its writer was interrupted?");
      const std::int64_t steps = parse_count(file, "shardkit.steps");
      if (rank == 0) {
        id_ = id;
        steps_ = steps;
        stage_ = file.meta("shardkit.stage", "it was not written by checkpoint::save_checkpoint");
        const auto info = parse_optimizer_metadata(file);
        kind_ = info.kind;
        params_ = info.params;
        for (const auto& [key, value] : file.metadata())
          if (!is_reserved_checkpoint_key(key)) user_[key] = value;
        read_scaler(file);
      }
      check<IoError>(id == id_ && steps == steps_, "the sharded checkpoint in '", dir_,
                     "' mixes two saves: ", shard_file_name(0, world), " is from save ", id_,
                     " (step ", steps_, "), ", name, " from save ", id, " (step ", steps,
                     "); resume from a complete checkpoint");
      add_pieces(file);
    }
  }

  // A shard file's "pieces" metadata: [{"tensor", "param", "buffer", "begin", "end"}] for pieces
  // and [{"tensor", "whole": true}] for replicated tensors.
  void add_pieces(const SafetensorsReader& file) {
    std::map<std::string, Shape> shapes(params_.begin(), params_.end());
    std::size_t at = 0;  // the entry being read, for a message
    try {
      for (const auto& entry : nlohmann::json::parse(
               file.meta("pieces", "it was not written by checkpoint::save_checkpoint"))) {
        ++at;
        const auto tensor = entry.at("tensor").get<std::string>();
        const TensorInfo* t = file.find(tensor);
        check<IoError>(t != nullptr, "'", file.path(), "' lists piece '", tensor,
                       "' but holds no such tensor");
        if (entry.value("whole", false)) {
          whole_.emplace(tensor, whole(file, *t));
          continue;
        }
        const auto param = entry.at("param").get<std::string>();
        const auto buffer = entry.at("buffer").get<std::string>();
        // (integers only: get<int64_t> would truncate 2.7 and make 1e300 undefined)
        auto element = [&](const char* field) {
          const auto& value = entry.at(field);
          check<IoError>(value.is_number_unsigned() &&
                             value.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX),
                         "'", file.path(), "': piece '", tensor, "' has ", field, " ", value.dump(),
                         ", not an element index (the file was damaged or not written by "
                         "checkpoint::save_checkpoint)");
          return static_cast<std::int64_t>(value.get<std::uint64_t>());
        };
        const auto begin = element("begin");
        const auto end = element("end");
        const auto shape = shapes.find(param);
        check<IoError>(shape != shapes.end(), "'", file.path(), "': piece '", tensor,
                       "' belongs to '", param, "', which the parameter list lacks");
        check<IoError>(t->dtype == DType::f32 && 0 <= begin && begin <= end &&
                           end <= shape_numel(shape->second) &&
                           shape_numel(t->shape) == end - begin,
                       "'", file.path(), "': piece '", tensor, "' (", dtype_name(t->dtype),
                       shape_text(t->shape), ") does not hold elements [", begin, ", ", end,
                       ") of '", param, "' ", shape_text(shape->second));
        pieces_[{param, buffer}].push_back(PieceSource{&file, t, begin, end});
      }
    } catch (const nlohmann::json::exception& e) {
      fail<IoError>("'", file.path(), "': metadata 'pieces' is malformed",
                    at == 0 ? std::string() : shardkit::detail::concat(" at its entry ", at), ": ",
                    e.what());
    }
  }

  std::string dir_;
  CheckpointLayout layout_ = CheckpointLayout::full;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::string id_;
  std::int64_t steps_ = 0;
  int world_size_ = 0;
  std::string stage_;
  optim::OptimizerKind kind_ = optim::OptimizerKind::sgd;
  ParamShapes params_;
  std::map<std::pair<std::string, std::string>, std::vector<PieceSource>> pieces_;
  std::map<std::string, PieceSource> whole_;
  std::map<std::string, std::string> user_;
  double loss_scale_ = 0;
  std::int64_t growth_tracker_ = 0;
};

}  // namespace shardkit::checkpoint
