// shardkit-ckpt: inspect, verify and rewrite shardkit checkpoints without the model or its ranks.
//
//   shardkit-ckpt inspect DIR                      what the checkpoint holds
//   shardkit-ckpt verify DIR                       every file consistent, every checksum right
//   shardkit-ckpt consolidate DIR OUT              any layout -> the full pair
//   shardkit-ckpt reshard DIR OUT --world-size M   any layout -> M shard files
//   shardkit-ckpt to-torch DIR MODEL.safetensors [--optimizer OPT.safetensors]
//   shardkit-ckpt from-torch MODEL.safetensors OUT [--optimizer OPT.safetensors]
//                            [--optimizer-kind sgd|larc_sgd|adam|adamw] [--buffer NAME ...]
//
// DIR is a checkpoint folder (save_checkpoint's) or a folder of step checkpoints with a
// `latest` pointer (save_step_checkpoint's; the latest is taken). Errors are one line on stderr
// and exit status 1 (2 for bad arguments).
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "shardkit/checkpoint/checkpoint_rewrite.hpp"
#include "shardkit/checkpoint/step_folders.hpp"

namespace sk = shardkit;
namespace checkpoint = shardkit::checkpoint;

namespace {

// A step-checkpoint root resolves to its latest complete step folder.
std::string checkpoint_folder(const std::string& dir) {
  if (std::filesystem::exists(std::filesystem::path(dir) / "latest")) {
    if (const auto latest = checkpoint::latest_checkpoint(dir)) return *latest;
  }
  return dir;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

void inspect(const std::string& dir) {
  const checkpoint::CheckpointSource source(checkpoint_folder(dir));
  std::printf("checkpoint  %s\n", source.dir().c_str());
  std::printf("layout      %s, %zu files\n",
              std::string(checkpoint::checkpoint_layout_name(source.layout())).c_str(),
              source.files().size());
  std::printf("save        id %s, step %lld, stage %s, world size %d\n", source.id().c_str(),
              static_cast<long long>(source.steps()), source.stage().c_str(), source.world_size());
  std::printf("optimizer   %s\n",
              std::string(sk::optim::optimizer_kind_name(source.optimizer_kind())).c_str());
  if (source.loss_scale() > 0)
    std::printf("scaler      scale %g, growth tracker %lld\n", source.loss_scale(),
                static_cast<long long>(source.growth_tracker()));
  for (const auto& [key, value] : source.metadata())
    std::printf("metadata    %s = %s\n", key.c_str(), value.c_str());
  std::size_t tensors = 0, with_checksum = 0;
  for (const auto& file : source.files()) {
    std::uint64_t bytes = 0;
    for (const auto& t : file->tensors()) {
      ++tensors;
      with_checksum += t.crc32.has_value();
      bytes += t.bytes();
    }
    std::printf("file        %s: %zu tensors, %s\n",
                std::filesystem::path(file->path()).filename().c_str(), file->tensors().size(),
                human_bytes(static_cast<double>(bytes)).c_str());
  }
  std::printf("checksums   %zu of %zu tensors record a CRC32 (verify checks them)\n", with_checksum,
              tensors);
  std::vector<std::string> buffers;
  for (const auto buffer : sk::optim::possible_state_buffers(source.optimizer_kind()))
    if (source.has_state_buffer(std::string(buffer))) buffers.emplace_back(buffer);
  std::int64_t elements = 0;
  for (const auto& [name, shape] : source.params()) elements += sk::shape_numel(shape);
  std::printf("parameters  %zu, %lld elements; state buffers:", source.params().size(),
              static_cast<long long>(elements));
  for (const auto& b : buffers) std::printf(" %s", b.c_str());
  std::printf("%s\n", buffers.empty() ? " none" : "");
  for (const auto& [name, shape] : source.params())
    std::printf("  %-48s f32%-20s %zu piece%s\n", name.c_str(), sk::shape_str(shape).c_str(),
                source.pieces(name).size(), source.pieces(name).size() == 1 ? "" : "s");
  std::printf("replicated  %zu\n", source.replicated().size());
  for (const auto& [name, piece] : source.replicated())
    std::printf("  %-48s %s%s\n", name.c_str(),
                std::string(sk::dtype_name(piece.tensor->dtype)).c_str(),
                sk::shape_str(piece.tensor->shape).c_str());
}

void verify(const std::string& dir) {
  const checkpoint::CheckpointSource source(checkpoint_folder(dir));
  std::size_t tensors = 0, checked = 0;
  for (const auto& file : source.files()) {
    tensors += file->tensors().size();
    checked += file->verify_all();
  }
  std::printf("ok: %s (%s, step %lld): %zu files, %zu tensors, %zu checksums verified%s\n",
              source.dir().c_str(),
              std::string(checkpoint::checkpoint_layout_name(source.layout())).c_str(),
              static_cast<long long>(source.steps()), source.files().size(), tensors, checked,
              checked < tensors ? " (the others were written without one)" : "");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardkit-ckpt: inspect, verify and rewrite shardkit checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, model, optimizer, kind = "sgd";
  int world = 0;
  std::vector<std::string> buffers;

  auto* inspect_cmd = app.add_subcommand("inspect", "what a checkpoint holds");
  inspect_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  auto* verify_cmd = app.add_subcommand("verify", "check consistency and every checksum");
  verify_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  auto* consolidate_cmd = app.add_subcommand("consolidate", "any layout -> the full pair");
  consolidate_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  consolidate_cmd->add_option("OUT", out, "folder to write")->required();
  auto* reshard_cmd = app.add_subcommand("reshard", "any layout -> M shard files");
  reshard_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  reshard_cmd->add_option("OUT", out, "folder to write")->required();
  reshard_cmd->add_option("--world-size", world, "ranks of the new layout")
      ->required()
      ->check(CLI::Range(1, 1 << 20));
  auto* to_torch_cmd = app.add_subcommand("to-torch", "a PyTorch state dict (and optimizer state)");
  to_torch_cmd->add_option("DIR", dir, "checkpoint folder")->required();
  to_torch_cmd->add_option("MODEL", model, "state dict file to write (.safetensors)")->required();
  to_torch_cmd->add_option("--optimizer", optimizer, "optimizer state file to write");
  auto* from_torch_cmd = app.add_subcommand("from-torch", "a PyTorch state dict -> a checkpoint");
  from_torch_cmd->add_option("MODEL", model, "state dict (safetensors.torch.save_file)")
      ->required()
      ->check(CLI::ExistingFile);
  from_torch_cmd->add_option("OUT", out, "folder to write")->required();
  from_torch_cmd->add_option("--optimizer", optimizer, "optimizer state (to-torch's format)")
      ->check(CLI::ExistingFile);
  from_torch_cmd->add_option("--optimizer-kind", kind, "without --optimizer: the optimizer")
      ->check(CLI::IsMember({"sgd", "larc_sgd", "adam", "adamw"}));
  from_torch_cmd->add_option("--buffer", buffers,
                             "a float tensor that is a buffer, not a parameter");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "shardkit-ckpt: %s (see shardkit-ckpt --help)\n", e.what());
    return 2;
  }

  try {
    if (*inspect_cmd) {
      inspect(dir);
    } else if (*verify_cmd) {
      verify(dir);
    } else if (*consolidate_cmd) {
      checkpoint::consolidate_checkpoint(checkpoint_folder(dir), out);
      std::printf("wrote %s (full)\n", out.c_str());
    } else if (*reshard_cmd) {
      checkpoint::reshard_checkpoint(checkpoint_folder(dir), out, world);
      std::printf("wrote %s (%d shard files)\n", out.c_str(), world);
    } else if (*to_torch_cmd) {
      checkpoint::export_torch_state(checkpoint_folder(dir), model, optimizer);
      std::printf("wrote %s%s%s\n", model.c_str(), optimizer.empty() ? "" : " and ",
                  optimizer.c_str());
    } else if (*from_torch_cmd) {
      checkpoint::FromTorchOptions options;
      options.kind = sk::optim::parse_optimizer_kind(kind);
      options.buffers = buffers;
      checkpoint::checkpoint_from_torch(model, optimizer, out, options);
      std::printf("wrote %s (full)\n", out.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-ckpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
