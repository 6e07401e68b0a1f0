// Training checkpoints of any stage, loadable into any stage and any world size:
//
//   save_checkpoint(dir, state, {.layout = full})     rank 0 writes model.safetensors (every
//       parameter whole in f32 -- under mixed precision the f32 master, so a checkpoint does
//       not depend on the precision it was trained in --, with PyTorch's state-dict names,
//       plus buffers) and
//       optimizer.safetensors (every state buffer whole). The owners' pieces stream to rank
//       0's writer chunk by chunk (optim::stream_pieces), each written straight to its place in
//       the file: no rank ever holds more than one chunk beyond its own shards -- the
//       full-state-dict OOM that FairScale and PyTorch users report cannot happen here.
//   save_checkpoint(dir, state, {.layout = sharded})  every rank writes its own pieces to its
//       own file, with the metadata needed to put them back (checkpoint_source.hpp); no
//       traffic beyond agreeing on the checkpoint's id.
//   load_checkpoint(dir, state)  either layout: every rank reads exactly the elements it holds
//       (its pieces of the parameters and of their state, and the replicated tensors) from
//       whichever files hold them; everything is read and checked on every rank before
//       anything is written, and the ranks then agree on the outcome: a rank that met a corrupt
//       or missing piece throws its error, every other rank a PeerFailed naming it -- none
//       trains on, and none has written anything (its state is as before the call).
//
// Every file is written atomically (temporary file, fsync, rename, folder fsync) and carries
// the checkpoint's id, so files of two saves never load together. Collective: every rank calls
// both functions. `state` comes from DataParallel, FsdpEngine or ShardedModule's
// training_state().
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardkit/checkpoint/checkpoint_source.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/parallel/training_state.hpp"

namespace shardkit::checkpoint {

struct CheckpointOptions {
  CheckpointLayout layout = CheckpointLayout::full;
  // The caller's metadata (epoch, sampler position, ...), returned by load_checkpoint. Keys
  // "format", "optimizer", "steps", "parameters", "pieces" and "shardkit.*" are reserved.
  std::map<std::string, std::string> metadata;
  std::int64_t chunk_numel = std::int64_t{1} << 22;  // full layout: elements per streamed chunk
};

// What load_checkpoint found.
struct LoadedCheckpoint {
  CheckpointLayout layout = CheckpointLayout::full;
  int world_size = 0;  // of the run that saved it
  std::string stage;   // of the run that saved it
  std::int64_t steps = 0;
  std::map<std::string, std::string> metadata;  // the caller's, as given to save_checkpoint
};

namespace detail {

// A random id that every rank agrees on (rank 0's, broadcast as two exact 32-bit halves).
inline std::string agree_on_checkpoint_id(Context& ctx, comm::Communicator& comm) {
  std::vector<double> halves(2, 0.0);
  if (comm.rank() == 0) {
    std::random_device device;
    halves = {static_cast<double>(device()), static_cast<double>(device())};
  }
  Tensor t = from_vector(ctx, halves, {2});
  comm.broadcast(t, 0).wait();
  halves = to_vector<double>(ctx, t);
  char id[32];
  std::snprintf(id, sizeof id, "%08x%08x", static_cast<unsigned>(halves[0]),
                static_cast<unsigned>(halves[1]));
  return id;
}

// Which ranks of `comm` failed (this one if `failed`): one all-reduce of a flag per rank.
inline std::vector<float> failed_ranks(Context& ctx, comm::Communicator& comm, bool failed) {
  std::vector<float> flags(static_cast<std::size_t>(comm.size()), 0.0f);
  flags[static_cast<std::size_t>(comm.rank())] = failed ? 1.0f : 0.0f;
  Tensor t = from_vector(ctx, flags, {comm.size()});
  comm.all_reduce(t).wait();
  return to_vector<float>(ctx, t);
}

// "0, 2": the indices whose flag is set.
inline std::string listed(const std::vector<float>& flags) {
  std::string out;
  for (std::size_t r = 0; r < flags.size(); ++r)
    if (flags[r] != 0.0f) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// After each rank's part of a collective piece of work: every rank learns which ranks failed,
// so no rank trains on while another lost its part. A rank that failed rethrows its own error;
// the others throw PeerFailed with failed_on(ranks).
template <class Message>
void agree_on_outcome(Context& ctx, comm::Communicator& comm, const std::exception_ptr& error,
                      Message&& failed_on) {
  const std::string ranks = listed(failed_ranks(ctx, comm, error != nullptr));
  if (error) std::rethrow_exception(error);
  if (!ranks.empty()) throw comm::PeerFailed(failed_on(ranks));
}

inline ParamShapes trainable_params(const parallel::TrainingState& state) {
  ParamShapes out;
  for (const auto& p : state.optimizer->table().params()) out.emplace_back(p.name, p.shape);
  return out;
}

inline void check_state(const parallel::TrainingState& state, const char* call) {
  check(state.optimizer != nullptr && state.comm != nullptr, call,
        ": the training state has no optimizer or communicator; take it from training_state()");
}

inline std::map<std::string, std::string> common_metadata(const parallel::TrainingState& state,
                                                          const std::string& id,
                                                          const CheckpointOptions& options) {
  std::map<std::string, std::string> meta;
  for (const auto& [key, value] : options.metadata) {
    check(!is_reserved_checkpoint_key(key), "save_checkpoint: metadata key '", key,
          "' is reserved; name it otherwise (e.g. 'train.", key, "')");
    meta[key] = value;
  }
  meta["shardkit.checkpoint"] = id;
  meta["shardkit.steps"] = std::to_string(state.optimizer->steps());
  meta["shardkit.stage"] = state.stage;
  meta["shardkit.world_size"] = std::to_string(state.comm->size());
  meta["shardkit.precision"] = std::string(dtype_name(state.optimizer->compute_dtype()));
  if (state.scaler != nullptr) {
    char scale[32];
    std::snprintf(scale, sizeof scale, "%.17g", state.scaler->scale());
    meta["shardkit.loss_scale"] = scale;
    meta["shardkit.growth_tracker"] = std::to_string(state.scaler->growth_tracker());
  }
  return meta;
}

inline void save_full(const std::string& dir, parallel::TrainingState& state, const std::string& id,
                      const CheckpointOptions& options) {
  auto& optimizer = *state.optimizer;
  auto& comm = *state.comm;
  Context& ctx = optimizer.context();
  const auto& table = optimizer.table();
  const bool writer = comm.rank() == 0;
  const auto& buffers = optimizer.state_buffers();
  std::unique_ptr<SafetensorsWriter> model_file, optimizer_file;
  // Rank 0's first error (its files cannot be made, a write fails: a full disk). The streams
  // go on without writing, so every rank's collectives complete and the ranks then agree on the
  // outcome (save_checkpoint) instead of waiting for a writer that left.
  std::exception_ptr error;
  if (writer) try {
      std::vector<TensorInfo> model_tensors, optimizer_tensors;
      for (const auto& p : table.params()) {
        model_tensors.push_back(TensorInfo{p.name, DType::f32, p.shape});
        for (const auto& buffer : buffers)
          optimizer_tensors.push_back(
              TensorInfo{p.name + "." + std::string(buffer.name), DType::f32, p.shape});
      }
      for (const auto& [name, t] : state.replicated)
        model_tensors.push_back(TensorInfo{name, t.dtype(), t.shape()});
      auto model_meta = common_metadata(state, id, options);
      model_meta["format"] = "pt";  // what safetensors.torch expects of a state dict
      auto optimizer_meta = optimizer_state_metadata(optimizer.config().kind, optimizer.steps(),
                                                     trainable_params(state));
      optimizer_meta["shardkit.checkpoint"] = id;
      const std::filesystem::path folder(dir);
      model_file = std::make_unique<SafetensorsWriter>((folder / kFullModelFile).string(),
                                                       std::move(model_tensors), model_meta);
      optimizer_file = std::make_unique<SafetensorsWriter>(
          (folder / kFullOptimizerFile).string(), std::move(optimizer_tensors), optimizer_meta);
    } catch (...) {
      error = std::current_exception();
    }
  auto sink_into = [&](SafetensorsWriter* file, const std::string& suffix) {
    return [&table, &error, file, suffix](const shard::StatePiece& piece, std::int64_t offset,
                                          const float* values, std::int64_t count) {
      if (error) return;
      try {
        file->write(table.params()[piece.param].name + suffix,
                    static_cast<std::uint64_t>(piece.param_begin + offset) * sizeof(float), values,
                    static_cast<std::size_t>(count) * sizeof(float));
      } catch (...) {
        error = std::current_exception();
      }
    };
  };
  optim::stream_pieces(ctx, comm, table, optimizer.master_params(), 0,
                       sink_into(model_file.get(), ""), options.chunk_numel);
  for (const auto& buffer : buffers)
    optim::stream_pieces(ctx, comm, table, optim::state_views(optimizer.pieces(), buffer.values), 0,
                         sink_into(optimizer_file.get(), "." + std::string(buffer.name)),
                         options.chunk_numel);
  if (!writer) return;
  if (error) std::rethrow_exception(error);
  for (const auto& [name, t] : state.replicated) model_file->write(host_bytes(ctx, name, t));
  optimizer_file->commit();
  model_file->commit();
}

// One rank's file of a sharded checkpoint: its tensors, the metadata, and where each tensor's
// values are in the training state (`sources`, in the order of `tensors`). Made from the
// state's shapes alone; what reads the values is the save (save_sharded: straight into the
// file) or a snapshot (snapshot_shard: into host memory, for a save in the background).
struct ShardLayout {
  std::string path;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<Tensor> sources;
};

inline ShardLayout shard_layout(const std::string& dir, parallel::TrainingState& state,
                                const std::string& id, const CheckpointOptions& options) {
  auto& optimizer = *state.optimizer;
  auto& comm = *state.comm;
  const auto& table = optimizer.table();
  // Each element once: a replicated table (DDP) is saved by rank 0 alone.
  const bool saves_pieces = !table.replicated() || comm.rank() == 0;
  const auto& pieces = optimizer.pieces();
  ShardLayout out;
  nlohmann::json listed = nlohmann::json::array();
  auto add = [&](TensorInfo info, const Tensor& t) {
    out.tensors.push_back(std::move(info));
    out.sources.push_back(t);
  };
  auto add_piece = [&](const shard::StatePiece& piece, const std::string& buffer,
                       const Tensor& view) {
    if (piece.numel() == 0) return;  // (ddp's piece of an empty parameter: nothing to hold)
    const auto& param = table.params()[piece.param].name;
    listed.push_back(piece_entry(param, buffer, piece.param_begin, piece.param_end));
    add(TensorInfo{piece_tensor_name(param, buffer, piece.param_begin, piece.param_end),
                   DType::f32,
                   {piece.numel()}},
        view);
  };
  if (saves_pieces) {
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      add_piece(pieces[k], "", optimizer.master_params()[k]);
      for (const auto& buffer : optimizer.state_buffers()) {
        const Tensor& b = buffer.values;
        add_piece(pieces[k], std::string(buffer.name),
                  b.slice(0, pieces[k].state_offset, pieces[k].state_offset + pieces[k].numel()));
      }
    }
  }
  if (comm.rank() == 0)
    for (const auto& [name, t] : state.replicated) {
      listed.push_back({{"tensor", name}, {"whole", true}});
      add(TensorInfo{name, t.dtype(), t.shape()}, t);
    }
  out.metadata = common_metadata(state, id, options);
  for (auto& [key, value] : optimizer_state_metadata(optimizer.config().kind, optimizer.steps(),
                                                     trainable_params(state)))
    out.metadata[key] = value;
  out.metadata["format"] = std::string(kShardedCheckpointFormat);
  out.metadata["shardkit.rank"] = std::to_string(comm.rank());
  out.metadata["pieces"] = listed.dump();
  out.path = (std::filesystem::path(dir) / shard_file_name(comm.rank(), comm.size())).string();
  return out;
}

// One rank's file of a sharded checkpoint, in host memory. Taking it (snapshot_shard) is the
// only part of a background save that reads the training state; writing it (write_shard)
// needs neither the state nor the other ranks, so an async save (async_checkpoint.hpp) does
// that in the background.
struct ShardSnapshot {
  std::string path;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<NamedBytes> values;  // in the order of `tensors`
};

// `staging`: an earlier snapshot's values, whose buffers are reused in order.
inline ShardSnapshot snapshot_shard(const std::string& dir, parallel::TrainingState& state,
                                    const std::string& id, const CheckpointOptions& options,
                                    std::vector<NamedBytes> staging = {}) {
  ShardLayout layout = shard_layout(dir, state, id, options);
  Context& ctx = state.optimizer->context();
  ShardSnapshot out{std::move(layout.path), std::move(layout.tensors), std::move(layout.metadata),
                    std::move(staging)};
  out.values.resize(out.tensors.size());
  for (std::size_t k = 0; k < out.tensors.size(); ++k)
    host_bytes_into(ctx, out.values[k], out.tensors[k].name, layout.sources[k]);
  return out;
}

// The snapshot as its file, written atomically (checksums, fsync, rename).
inline void write_shard(const ShardSnapshot& snapshot) {
  SafetensorsWriter file(snapshot.path, snapshot.tensors, snapshot.metadata);
  for (const auto& v : snapshot.values) file.write(v);
  file.commit();
}

// A save in the foreground writes each tensor straight from the state where it is host memory
// (the CPU path; offloaded state, in RAM or in files): no copy of the rank's state is made, so
// the save needs no RAM beyond the state itself (the state's size again, with a snapshot). A
// tensor elsewhere (a GPU) goes through one host buffer, reused: the largest piece's size.
inline void save_sharded(const std::string& dir, parallel::TrainingState& state,
                         const std::string& id, const CheckpointOptions& options) {
  const ShardLayout layout = shard_layout(dir, state, id, options);
  Context& ctx = state.optimizer->context();
  SafetensorsWriter file(layout.path, layout.tensors, layout.metadata);
  NamedBytes bounce;
  ctx.synchronize();  // (what the device may still be writing into host memory)
  for (std::size_t k = 0; k < layout.tensors.size(); ++k) {
    const Tensor& t = layout.sources[k];
    if (t.device().is_cpu() && t.is_contiguous()) {
      SK_ASSERT(t.dtype() == layout.tensors[k].dtype &&
                t.numel() == shape_numel(layout.tensors[k].shape));
      file.write(layout.tensors[k].name, 0, t.data_ptr(), t.nbytes());
    } else {
      host_bytes_into(ctx, bounce, layout.tensors[k].name, t);
      file.write(bounce);
    }
  }
  file.commit();
}

// Hybrid sharding: every group holds the same states, so the first group saves and the others
// wait for its outcome -- and fail with it, so no rank trains on past a save that was lost.
// Without replicas, just save().
template <class Save>
void save_in_first_group(Context& ctx, comm::Communicator* replicas, Save&& save) {
  if (replicas == nullptr || replicas->size() == 1) return save();
  std::exception_ptr error;
  if (replicas->rank() == 0) {
    try {
      save();
    } catch (...) {
      error = std::current_exception();
    }
  }
  Tensor failed = from_vector(ctx, std::vector<float>{error ? 1.0f : 0.0f}, {1});
  replicas->all_reduce(failed, comm::ReduceOp::max).wait();
  if (error) std::rethrow_exception(error);
  if (to_vector<float>(ctx, failed)[0] > 0.0f)
    throw comm::PeerFailed(
        "save_checkpoint: the first group of ranks failed to save (its error is on its ranks); "
        "nothing was committed by this save");
}

}  // namespace detail

inline void save_checkpoint(const std::string& dir, parallel::TrainingState state,
                            const CheckpointOptions& options = {}) {
  detail::check_state(state, "save_checkpoint");
  if (state.replicas != nullptr && state.replicas->size() > 1) {
    comm::Communicator* replicas = std::exchange(state.replicas, nullptr);
    return detail::save_in_first_group(state.optimizer->context(), replicas,
                                       [&] { save_checkpoint(dir, state, options); });
  }
  auto& comm = *state.comm;
  Context& ctx = state.optimizer->context();
  // A rank's error is kept until every rank has done its part, and the ranks then agree on the
  // outcome: a rank that failed (a full disk) throws its error and every other rank a
  // PeerFailed naming it, where a barrier would wait forever for the rank that left.
  std::exception_ptr error;
  if (comm.rank() == 0) try {
      std::filesystem::create_directories(dir);
    } catch (...) {
      error = std::current_exception();
    }
  const std::string id = detail::agree_on_checkpoint_id(ctx, comm);  // (after the folder exists)
  // (every rank saves even after an error: the full layout's stream is collective, and its
  // writer, failing to open its files, lets it go on without writing)
  try {
    if (options.layout == CheckpointLayout::full)
      detail::save_full(dir, state, id, options);
    else
      detail::save_sharded(dir, state, id, options);
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  auto failed_on = [&](const char* what) {
    return [&dir, what](const std::string& ranks) {
      return shardkit::detail::concat("save_checkpoint into '", dir, "' failed to ", what,
                                      " on rank(s) ", ranks,
                                      " (their errors say why); the files of this save that "
                                      "were committed do not load without theirs");
    };
  };
  detail::agree_on_outcome(ctx, comm, error, failed_on("write its files"));
  try {
    if (comm.rank() == 0) detail::remove_stale_files(dir, options.layout, comm.size());
    state.optimizer->spill_state();  // (offload to NVMe: what the save read, out of RAM again)
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree_on_outcome(
      ctx, comm, error,
      failed_on("finish (remove an earlier save's files, or put offloaded state back out of RAM)"));
}

namespace detail {

// A load's agreement, before any rank writes: over the rank's group and, under hybrid sharding
// (`replicas`: the ranks of the other groups that load the same pieces), over the groups, so a
// failure in one group writes nothing in any.
inline void agree_on_load(Context& ctx, comm::Communicator& comm, comm::Communicator* replicas,
                          const std::exception_ptr& error, const std::string& dir) {
  const std::vector<float> in_group = failed_ranks(ctx, comm, error != nullptr);
  std::string groups;
  if (replicas != nullptr && replicas->size() > 1) {
    const bool group_failed =
        std::any_of(in_group.begin(), in_group.end(), [](float f) { return f != 0.0f; });
    std::vector<float> failed_groups = failed_ranks(ctx, *replicas, group_failed);
    failed_groups[static_cast<std::size_t>(replicas->rank())] = 0.0f;  // this group: by rank
    groups = listed(failed_groups);
  }
  if (error) std::rethrow_exception(error);
  const std::string ranks = listed(in_group);
  if (ranks.empty() && groups.empty()) return;
  throw comm::PeerFailed(shardkit::detail::concat(
      "loading the checkpoint in '", dir, "' failed on ",
      ranks.empty() ? "" : "rank(s) " + ranks + (groups.empty() ? "" : " of this group and "),
      groups.empty() ? "" : "the replica group(s) " + groups,
      " (their errors say why); this rank's state is unchanged, as is theirs"));
}

// What a load writes into this rank's state, read from the files and verified (checksums,
// coverage) before anything is written: a load refused on any rank then writes on none.
struct StagedLoad {
  Context host;  // owns the host tensors of `replicated` (declared first: it outlives them)
  LoadedCheckpoint loaded;
  std::vector<std::pair<Tensor, std::vector<float>>> values;  // f32 masters and state pieces
  std::vector<Tensor> zeroed;  // state buffers the checkpoint has none of (saved before a step)
  // Replicated tensors, in host tensors of their targets' dtypes (an f32 tensor saved for an
  // f16/bf16 one is rounded here), so that writing them is a copy.
  std::vector<std::pair<Tensor, Tensor>> replicated;
  double loss_scale = 0;  // 0: none saved
  std::int64_t growth_tracker = 0;
};

// This rank's part of load_checkpoint before the ranks agree: reads and checks what it holds
// into `staged`.
inline void stage_this_rank(const std::string& dir, parallel::TrainingState& state,
                            StagedLoad& staged) {
  auto& optimizer = *state.optimizer;
  const CheckpointSource source(dir);
  const auto& config = optimizer.config();
  const std::string where = "the checkpoint in '" + dir + "'";
  check<IoError>(source.optimizer_kind() == config.kind, where, " is for ",
                 optim::optimizer_kind_name(source.optimizer_kind()), " but this optimizer is ",
                 optim::optimizer_kind_name(config.kind),
                 "; build the optimizer the checkpoint was written with");
  optimizer.check_steps(source.steps());  // (set_steps comes after the agreement)

  // Names and shapes: the trainable parameters, then the replicated tensors.
  auto joined = [](const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", " : "") + names[i];
    if (names.size() > 8) out += ", ... (" + std::to_string(names.size()) + " in all)";
    return out;
  };
  std::map<std::string, Shape> saved(source.params().begin(), source.params().end());
  std::vector<std::string> missing, unexpected;
  for (const auto& p : optimizer.table().params()) {
    const auto found = saved.find(p.name);
    if (found == saved.end()) {
      missing.push_back(p.name);
      continue;
    }
    check<IoError>(found->second == p.shape, where, ": parameter '", p.name, "' is ",
                   shape_text(found->second), " there but ", shape_text(p.shape),
                   " here; build the model the checkpoint was written from");
    saved.erase(found);
  }
  for (const auto& [name, shape] : saved) unexpected.push_back(name);
  std::map<std::string, PieceSource> whole = source.replicated();
  for (const auto& [name, t] : state.replicated) {
    const auto found = whole.find(name);
    if (found == whole.end()) {
      missing.push_back(name);
      continue;
    }
    const TensorInfo& info = *found->second.tensor;
    // An f32 tensor loads into an f16/bf16 one (a run of another precision): rounded, as the
    // compute copies are.
    const bool converts =
        info.dtype == DType::f32 && (t.dtype() == DType::f16 || t.dtype() == DType::bf16);
    check<IoError>((info.dtype == t.dtype() || converts) && info.shape == t.shape(), where, ": '",
                   name, "' is ", dtype_name(info.dtype), shape_text(info.shape), " there but ",
                   dtype_name(t.dtype()), shape_text(t.shape()),
                   " here; build the model the checkpoint was written from");
    whole.erase(found);
  }
  for (const auto& [name, source_piece] : whole) unexpected.push_back(name);
  check<IoError>(missing.empty() && unexpected.empty(), where,
                 " does not fit this model: missing [", joined(missing), "], unexpected [",
                 joined(unexpected), "]; build the model the checkpoint was written from");

  // Every element this rank holds must be there (state buffers may be absent before the
  // first step: they are zeros then).
  const auto& buffers = optimizer.state_buffers();
  for (const auto buffer : optim::possible_state_buffers(config.kind)) {
    const bool kept = std::any_of(buffers.begin(), buffers.end(),
                                  [&](const optim::StateBuffer& b) { return b.name == buffer; });
    check<IoError>(kept || !source.has_state_buffer(std::string(buffer)), where, " has ", buffer,
                   " state but this optimizer keeps none (momentum 0?); configure it as when it "
                   "was saved");
  }
  const auto& table = optimizer.table();
  for (const auto& piece : optimizer.pieces()) {
    const auto& name = table.params()[piece.param].name;
    check<IoError>(
        CheckpointSource::covers(source.pieces(name), piece.param_begin, piece.param_end), where,
        " lacks elements [", piece.param_begin, ", ", piece.param_end, ") of '", name,
        "' (a shard file is missing or damaged)");
    for (const auto& buffer : buffers) {
      const auto& list = source.pieces(name, std::string(buffer.name));
      check<IoError>((list.empty() && source.steps() == 0) ||
                         CheckpointSource::covers(list, piece.param_begin, piece.param_end),
                     where, " lacks ", buffer.name, " elements [", piece.param_begin, ", ",
                     piece.param_end, ") of '", name, "'");
    }
  }

  // Read: this rank's pieces, their state, the replicated tensors.
  auto read = [&](const std::vector<PieceSource>& list, const shard::StatePiece& piece,
                  const Tensor& target) {
    std::vector<float> host(static_cast<std::size_t>(piece.numel()));
    CheckpointSource::read_range(list, piece.param_begin, piece.param_end, host.data());
    staged.values.emplace_back(target, std::move(host));
  };
  const auto& pieces = optimizer.pieces();
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const auto& name = table.params()[pieces[k].param].name;
    read(source.pieces(name), pieces[k], optimizer.master_params()[k]);
    for (const auto& buffer : buffers) {
      const Tensor target = buffer.values.slice(0, pieces[k].state_offset,
                                                pieces[k].state_offset + pieces[k].numel());
      const auto& list = source.pieces(name, std::string(buffer.name));
      if (list.empty())
        staged.zeroed.push_back(target);
      else
        read(list, pieces[k], target);
    }
  }
  for (const auto& [name, t] : state.replicated) {
    const PieceSource& p = source.replicated().at(name);
    const NamedBytes bytes = p.file->read(*p.tensor);
    Tensor saved = empty(staged.host, t.shape(), bytes.dtype);
    copy_to_tensor(staged.host, bytes, saved);
    if (bytes.dtype != t.dtype()) {  // f32 -> f16/bf16, rounded by the copy
      Tensor narrow = empty(staged.host, t.shape(), t.dtype());
      copy(staged.host, narrow, saved);
      saved = narrow;
    }
    staged.replicated.emplace_back(t, saved);
  }
  staged.loss_scale = source.loss_scale();
  staged.growth_tracker = source.growth_tracker();
  if (state.scaler != nullptr && staged.loss_scale > 0)
    state.scaler->check_loadable(staged.loss_scale, staged.growth_tracker);
  staged.loaded = LoadedCheckpoint{source.layout(), source.world_size(), source.stage(),
                                   source.steps(), source.metadata()};
}

// Writes what every rank read and checked into this rank's state.
inline void apply_staged(StagedLoad& staged, parallel::TrainingState& state) {
  auto& optimizer = *state.optimizer;
  Context& ctx = optimizer.context();
  for (auto& [target, host] : staged.values) {
    auto borrowed = Storage::borrow(host.data(), host.size() * sizeof(float), Device::cpu());
    copy(ctx, target, Tensor(borrowed, {target.numel()}, DType::f32));
  }
  for (const Tensor& target : staged.zeroed) fill(ctx, target, 0.0);
  for (const auto& [t, saved] : staged.replicated) copy(ctx, t, saved);
  optimizer.set_steps(staged.loaded.steps);
  optimizer.copy_masters_to_params();  // mixed precision: the compute copies follow
  // The loss scaler's state, when both the checkpoint and this run have one (a run without
  // loss scaling has none to save; a run that gains one starts from its initial scale).
  if (state.scaler != nullptr && staged.loss_scale > 0)
    state.scaler->load(staged.loss_scale, staged.growth_tracker);
}

}  // namespace detail

inline LoadedCheckpoint load_checkpoint(const std::string& dir, parallel::TrainingState state) {
  detail::check_state(state, "load_checkpoint");
  detail::StagedLoad staged;
  std::exception_ptr error;
  try {
    detail::stage_this_rank(dir, state, staged);
  } catch (const comm::CommunicatorAborted&) {
    throw;  // the world is gone: nothing left to agree on
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree_on_load(state.optimizer->context(), *state.comm, state.replicas, error, dir);
  detail::apply_staged(staged, state);
  if (state.forget_trajectory) state.forget_trajectory();
  if (state.after_load) state.after_load();
  state.optimizer->spill_state();  // (offload to NVMe: out of RAM; after every collective)
  return staged.loaded;
}

}  // namespace shardkit::checkpoint
