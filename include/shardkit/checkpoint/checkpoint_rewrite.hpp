// Rewriting a saved checkpoint without its model or its ranks (the work of tools/shardkit-ckpt):
//
//   consolidate_checkpoint(from, to)         any layout -> the full pair (model.safetensors,
//                                            optimizer.safetensors) in `to`
//   reshard_checkpoint(from, to, world)      any layout -> `world` shard files in `to`, cut as
//                                            FSDP cuts one flat unit: the parameters' elements
//                                            in saved order, in `world` near-equal ranges
//   export_torch_state(from, model, opt)     a PyTorch state dict (parameters and buffers, as
//                                            load_state_dict takes it) and, optionally, the
//                                            optimizer state as "<param>.<buffer>" tensors
//   checkpoint_from_torch(model, opt, to)    back: a full checkpoint that load_checkpoint takes
//
// The rewritten checkpoints keep the save's id, step count, stage, loss-scaler state and the
// caller's metadata, so a resumed run cannot tell them from a direct save (save in `world`
// ranks: the world size becomes `world`). Everything is read through CheckpointSource, so the
// source's consistency and every checksum are verified on the way; values are copied in
// bounded chunks, never a whole parameter at once, and each written file is atomic. `to` must
// be another folder than `from`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardkit/checkpoint/checkpoint_source.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"

namespace shardkit::checkpoint {

namespace detail {

inline constexpr std::int64_t kRewriteChunk = std::int64_t{1} << 22;  // elements per copy

inline void check_other_folder(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  std::error_code ignored;
  check(!(fs::exists(to) && fs::equivalent(from, to, ignored)), "rewriting the checkpoint in '",
        from, "' into the same folder would overwrite what it reads; give another folder");
  fs::create_directories(to);
}

// The save's own metadata (id, steps, stage, scaler, precision) and the caller's, for a
// rewritten file of a checkpoint of `world` ranks.
inline std::map<std::string, std::string> rewritten_metadata(const CheckpointSource& source,
                                                             int world) {
  std::map<std::string, std::string> meta = source.metadata();
  for (const auto& [key, value] : source.saved_metadata())
    if (key.rfind("shardkit.", 0) == 0 && key != "shardkit.rank") meta[key] = value;
  meta["shardkit.world_size"] = std::to_string(world);
  return meta;
}

// Elements [begin, end) of `list` (f32) into tensor `name` of `file`, from its element `at`.
inline void copy_elements(const std::vector<PieceSource>& list, std::int64_t begin,
                          std::int64_t end, SafetensorsWriter& file, const std::string& name,
                          std::int64_t at) {
  std::vector<float> chunk;
  for (std::int64_t lo = begin; lo < end; lo += kRewriteChunk) {
    const std::int64_t hi = std::min(end, lo + kRewriteChunk);
    chunk.resize(static_cast<std::size_t>(hi - lo));
    CheckpointSource::read_range(list, lo, hi, chunk.data());
    file.write(name, static_cast<std::uint64_t>(at + lo - begin) * sizeof(float), chunk.data(),
               chunk.size() * sizeof(float));
  }
}

// The state buffers the checkpoint holds, and a check that each covers all of its parameter.
inline std::vector<std::string> saved_buffers(const CheckpointSource& source) {
  std::vector<std::string> out;
  for (const auto buffer : optim::possible_state_buffers(source.optimizer_kind()))
    if (source.has_state_buffer(std::string(buffer))) out.emplace_back(buffer);
  for (const auto& [name, shape] : source.params()) {
    check<IoError>(CheckpointSource::covers(source.pieces(name), 0, shape_numel(shape)), "'",
                   source.dir(), "' lacks part of parameter '", name,
                   "' (a shard file is missing or damaged)");
    for (const auto& buffer : out)
      check<IoError>(CheckpointSource::covers(source.pieces(name, buffer), 0, shape_numel(shape)),
                     "'", source.dir(), "' lacks part of the ", buffer, " of '", name, "'");
  }
  return out;
}

// The full pair from `source`: parameters and replicated tensors into `model_path`, state
// buffers into `optimizer_path` (skipped when empty).
inline void write_full_files(const CheckpointSource& source, const std::string& model_path,
                             const std::map<std::string, std::string>& model_meta,
                             const std::string& optimizer_path,
                             const std::map<std::string, std::string>& optimizer_meta) {
  const auto buffers = saved_buffers(source);
  std::vector<TensorInfo> model_tensors, optimizer_tensors;
  for (const auto& [name, shape] : source.params()) {
    model_tensors.push_back(TensorInfo{name, DType::f32, shape});
    for (const auto& buffer : buffers)
      optimizer_tensors.push_back(TensorInfo{name + "." + buffer, DType::f32, shape});
  }
  for (const auto& [name, piece] : source.replicated())
    model_tensors.push_back(TensorInfo{name, piece.tensor->dtype, piece.tensor->shape});
  if (!optimizer_path.empty()) {
    SafetensorsWriter optimizer(optimizer_path, std::move(optimizer_tensors), optimizer_meta);
    for (const auto& [name, shape] : source.params())
      for (const auto& buffer : buffers)
        copy_elements(source.pieces(name, buffer), 0, shape_numel(shape), optimizer,
                      name + "." + buffer, 0);
    optimizer.commit();
  }
  SafetensorsWriter model(model_path, std::move(model_tensors), model_meta);
  for (const auto& [name, shape] : source.params())
    copy_elements(source.pieces(name), 0, shape_numel(shape), model, name, 0);
  for (const auto& [name, piece] : source.replicated())
    model.write(piece.file->read(*piece.tensor));
  model.commit();
}

inline std::map<std::string, std::string> optimizer_file_metadata(const CheckpointSource& source) {
  return optimizer_state_metadata(source.optimizer_kind(), source.steps(), source.params());
}

}  // namespace detail

inline void consolidate_checkpoint(const std::string& from, const std::string& to) {
  const CheckpointSource source(from);
  detail::check_other_folder(from, to);
  auto model_meta = detail::rewritten_metadata(source, source.world_size());
  model_meta["format"] = "pt";
  auto optimizer_meta = detail::optimizer_file_metadata(source);
  optimizer_meta["shardkit.checkpoint"] = source.id();
  const std::filesystem::path folder(to);
  detail::write_full_files(source, (folder / kFullModelFile).string(), model_meta,
                           (folder / kFullOptimizerFile).string(), optimizer_meta);
  detail::remove_stale_files(to, CheckpointLayout::full, 0);
}

inline void reshard_checkpoint(const std::string& from, const std::string& to, int world) {
  check(world >= 1, "reshard_checkpoint: world size ", world, "; give 1 or more ranks");
  const CheckpointSource source(from);
  detail::check_other_folder(from, to);
  const auto buffers = detail::saved_buffers(source);
  std::int64_t total = 0;
  for (const auto& [name, shape] : source.params()) total += shape_numel(shape);
  // Rank r's range of the flat parameters: near-equal, the first total % world one longer.
  auto range_start = [&](int r) {
    return (total / world) * r + std::min<std::int64_t>(r, total % world);
  };
  for (int r = 0; r < world; ++r) {
    const std::int64_t lo = range_start(r), hi = range_start(r + 1);
    // (parameter index, its elements [begin, end)) in this rank's range
    std::vector<std::tuple<std::size_t, std::int64_t, std::int64_t>> owned;
    std::int64_t offset = 0;
    for (std::size_t p = 0; p < source.params().size(); ++p) {
      const std::int64_t numel = shape_numel(source.params()[p].second);
      const std::int64_t b = std::max(lo, offset), e = std::min(hi, offset + numel);
      if (b < e) owned.emplace_back(p, b - offset, e - offset);
      offset += numel;
    }
    std::vector<TensorInfo> tensors;
    nlohmann::json listed = nlohmann::json::array();
    std::vector<std::string> kinds{""};
    kinds.insert(kinds.end(), buffers.begin(), buffers.end());
    for (const auto& [p, b, e] : owned)
      for (const auto& buffer : kinds) {
        const auto& param = source.params()[p].first;
        tensors.push_back(TensorInfo{piece_tensor_name(param, buffer, b, e), DType::f32, {e - b}});
        listed.push_back(piece_entry(param, buffer, b, e));
      }
    if (r == 0)
      for (const auto& [name, piece] : source.replicated()) {
        tensors.push_back(TensorInfo{name, piece.tensor->dtype, piece.tensor->shape});
        listed.push_back({{"tensor", name}, {"whole", true}});
      }
    auto meta = detail::rewritten_metadata(source, world);
    for (auto& [key, value] : detail::optimizer_file_metadata(source)) meta[key] = value;
    meta["format"] = std::string(kShardedCheckpointFormat);
    meta["shardkit.rank"] = std::to_string(r);
    meta["pieces"] = listed.dump();
    SafetensorsWriter file((std::filesystem::path(to) / shard_file_name(r, world)).string(),
                           std::move(tensors), meta);
    for (const auto& [p, b, e] : owned)
      for (const auto& buffer : kinds) {
        const auto& param = source.params()[p].first;
        detail::copy_elements(source.pieces(param, buffer), b, e, file,
                              piece_tensor_name(param, buffer, b, e), 0);
      }
    if (r == 0)
      for (const auto& [name, piece] : source.replicated())
        file.write(piece.file->read(*piece.tensor));
    file.commit();
  }
  detail::remove_stale_files(to, CheckpointLayout::sharded, world);
}

// A PyTorch state dict of the checkpoint's model at `model_path` (parameters in f32 and the
// buffers, PyTorch's names, metadata {"format": "pt"}: safetensors.torch.load_file and
// load_state_dict take it) and, when `optimizer_path` is given, its optimizer state there
// (load_optimizer_state's format: "<param>.<buffer>" with PyTorch's buffer names, the kind,
// step count and parameter list in the metadata).
inline void export_torch_state(const std::string& from, const std::string& model_path,
                               const std::string& optimizer_path = {}) {
  const CheckpointSource source(from);
  // (an export into one of the checkpoint's own files replaced it with a file that is no
  // checkpoint's: the checkpoint could not be loaded again)
  // (nor into its folder: a model file beside shard files made the folder hold both layouts,
  // which every later load refuses; nor both outputs one file, the model renamed over the
  // optimizer's)
  namespace fs = std::filesystem;
  std::error_code ignored;
  for (const auto& out : {model_path, optimizer_path}) {
    if (out.empty()) continue;
    const fs::path folder = fs::weakly_canonical(fs::absolute(out)).parent_path();
    check(!fs::equivalent(folder, from, ignored), "exporting the checkpoint in '", from, "' to '",
          out, "' would write into the checkpoint's own folder; give a path outside it");
  }
  check(optimizer_path.empty() || fs::weakly_canonical(fs::absolute(model_path)) !=
                                      fs::weakly_canonical(fs::absolute(optimizer_path)),
        "export_torch_state: the model and the optimizer state would both go to '", model_path,
        "'; give two paths");
  detail::write_full_files(source, model_path, {{"format", "pt"}}, optimizer_path,
                           detail::optimizer_file_metadata(source));
}

struct FromTorchOptions {
  // Without an optimizer file: the optimizer the checkpoint is for (a fresh start: step 0, no
  // state), and which floating-point tensors are buffers rather than parameters (besides
  // batch norm's running_mean, running_var and num_batches_tracked).
  optim::OptimizerKind kind = optim::OptimizerKind::sgd;
  std::vector<std::string> buffers;
};

// A full checkpoint in `to` from a PyTorch state dict file (safetensors.torch.save_file of
// model.state_dict()) and, optionally, an optimizer-state file as export_torch_state writes it
// (its parameter list says which tensors are parameters). Parameters must be float32.
inline void checkpoint_from_torch(const std::string& model_path, const std::string& optimizer_path,
                                  const std::string& to, const FromTorchOptions& options = {}) {
  const SafetensorsReader model(model_path);
  std::optional<SafetensorsReader> optimizer;
  OptimizerFileInfo info;
  info.kind = options.kind;
  if (!optimizer_path.empty()) {
    optimizer.emplace(optimizer_path);
    info = parse_optimizer_metadata(*optimizer);
  } else {
    auto is_buffer = [&](const std::string& name) {
      for (const char* suffix : {".running_mean", ".running_var", ".num_batches_tracked"})
        if (name.size() >= std::strlen(suffix) &&
            name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
          return true;
      return std::find(options.buffers.begin(), options.buffers.end(), name) !=
             options.buffers.end();
    };
    for (const auto& t : model.tensors())
      if (!is_buffer(t.name) && (t.dtype == DType::f32 || t.dtype == DType::f16 ||
                                 t.dtype == DType::bf16 || t.dtype == DType::f64))
        info.params.emplace_back(t.name, t.shape);
  }
  std::map<std::string, bool> is_param;
  for (const auto& [name, shape] : info.params) {
    const TensorInfo* t = model.find(name);
    check<IoError>(t != nullptr, "'", model_path, "' lacks parameter '", name,
                   "' that the optimizer file lists; give the state dict of the same model");
    check<IoError>(t->dtype == DType::f32 && t->shape == shape, "'", model_path, "': parameter '",
                   name, "' is ", dtype_name(t->dtype), shape_text(t->shape), "; expected float32",
                   shape_text(shape), " (convert with .float() before saving)");
    is_param[name] = true;
  }
  std::filesystem::create_directories(to);
  std::random_device device;
  char id[32];
  std::snprintf(id, sizeof id, "%08x%08x", device(), device());
  std::map<std::string, std::string> meta{{"format", "pt"},
                                          {"shardkit.checkpoint", id},
                                          {"shardkit.steps", std::to_string(info.steps)},
                                          {"shardkit.stage", "torch"},
                                          {"shardkit.world_size", "1"}};
  auto optimizer_meta = optimizer_state_metadata(info.kind, info.steps, info.params);
  optimizer_meta["shardkit.checkpoint"] = id;
  std::vector<TensorInfo> optimizer_tensors;
  std::vector<const TensorInfo*> state;
  if (optimizer)
    for (const auto& [name, shape] : info.params)
      for (const auto buffer : optim::possible_state_buffers(info.kind))
        if (const TensorInfo* s = optimizer->find(name + "." + std::string(buffer))) {
          check<IoError>(s->dtype == DType::f32 && s->shape == shape, "'", optimizer_path, "': '",
                         s->name, "' is ", dtype_name(s->dtype), shape_text(s->shape),
                         "; expected float32", shape_text(shape));
          optimizer_tensors.push_back(TensorInfo{s->name, s->dtype, s->shape});
          state.push_back(s);
        }
  const std::filesystem::path folder(to);
  {
    SafetensorsWriter file((folder / kFullOptimizerFile).string(), std::move(optimizer_tensors),
                           optimizer_meta);
    for (const TensorInfo* s : state) file.write(optimizer->read(*s));
    file.commit();
  }
  std::vector<TensorInfo> model_tensors;
  for (const auto& t : model.tensors())
    model_tensors.push_back(TensorInfo{t.name, t.dtype, t.shape});
  SafetensorsWriter file((folder / kFullModelFile).string(), std::move(model_tensors), meta);
  for (const auto& t : model.tensors()) file.write(model.read(t));
  file.commit();
  detail::remove_stale_files(to, CheckpointLayout::full, 0);
}

}  // namespace shardkit::checkpoint
