// VISSL's command line (tools/run_distributed_engines.py, read by Hydra), as the trainer takes it:
//
//   config=NAME               the config: a YAML file's path (".yaml" may be left out), or a
//                             name looked up where VISSL's and ours live (config_roots)
//   +config/GROUP=NAME        a config group's file composed on top, in the order given
//                             (VISSL's configs/config/GROUP/NAME.yaml: models, transforms, ...)
//   config.KEY.PATH=VALUE     an override; Hydra's `+config.KEY.PATH=VALUE` (add a key) alike
//   hydra.KEY=VALUE           Hydra's own settings (hydra.verbose=true): no effect here
//
// so that the command a VISSL user types, e.g.
//
//   swav config=pretrain/swav/swav_8node_resnet +config/pretrain/swav/models=resnet18
//        config.DATA.TRAIN.DATA_PATHS=[/data/train]   (one line)
//
// run from their VISSL checkout, reads what VISSL would read.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "config_tree.hpp"

namespace swav {

// Where a config's name is looked up, in order: as a path (from the working directory), under
// VISSL's config root in the working directory (a VISSL checkout's configs/config, where
// VISSL's Hydra plugin finds them), and among the shipped configs (`config=quick_cpu`).
inline std::vector<std::filesystem::path> config_roots(const std::filesystem::path& shipped) {
  return {".", "configs/config", shipped};
}

// The file a config name stands for: NAME or NAME.yaml under the first root that has it, or a
// ConfigError that says where it looked.
inline std::string find_config(const std::string& name,
                               const std::vector<std::filesystem::path>& roots) {
  namespace fs = std::filesystem;
  std::string looked;
  const bool absolute = fs::path(name).is_absolute();
  for (const auto& root : roots) {
    for (const std::string& candidate : {name, name + ".yaml"}) {
      const fs::path path = absolute ? fs::path(candidate) : root / candidate;
      std::error_code ec;
      if (fs::is_regular_file(path, ec)) return path.lexically_normal().string();
    }
    looked += (looked.empty() ? "" : ", ") + (absolute ? name : (root / name).string()) + "[.yaml]";
    if (absolute) break;
  }
  throw ConfigError("config file '" + name + "' not found (looked for " + looked +
                    "); pass config=PATH to a YAML file, or a VISSL config's name "
                    "(config=pretrain/swav/swav_8node_resnet) from a VISSL checkout");
}

// The arguments sorted into the config files (the config, then each group's file, in order), the
// overrides and Hydra's settings.
struct CommandLine {
  std::vector<std::string> files, overrides, hydra;
};

inline CommandLine read_command_line(const std::vector<std::string>& args,
                                     const std::vector<std::filesystem::path>& roots) {
  CommandLine line;
  std::vector<std::string> groups;
  for (const auto& arg : args) {
    if (arg.rfind("config=", 0) == 0) {
      line.files.push_back(find_config(arg.substr(7), roots));
    } else if (arg.rfind("+config/", 0) == 0) {
      const auto eq = arg.find('=');
      if (eq == std::string::npos || eq + 1 == arg.size())
        throw ConfigError("'" + arg +
                          "' is not a config group override; write "
                          "+config/GROUP=NAME, e.g. +config/pretrain/swav/models=resnet18");
      groups.push_back(find_config(arg.substr(8, eq - 8) + "/" + arg.substr(eq + 1), roots));
    } else if (arg.rfind("+config.", 0) == 0) {
      line.overrides.push_back(arg.substr(1));
    } else if (arg.rfind("hydra.", 0) == 0 || arg.rfind("+hydra.", 0) == 0) {
      line.hydra.push_back(arg.substr(0, arg.find('=')));
    } else {
      line.overrides.push_back(arg);
    }
  }
  // Hydra composes the groups onto the primary config, whatever the order on the line.
  line.files.insert(line.files.end(), groups.begin(), groups.end());
  return line;
}

}  // namespace swav
