// VISSL's command line (tools/run_distributed_engines.py, read by Hydra), as the trainer takes it:
//
//   config=NAME               the config: a YAML file's path (".yaml" may be left out), or a
//                             name looked up where VISSL's and ours live (config_roots)
//   +config/GROUP=NAME        a config group's file composed on top, in the order given
//                             (VISSL's configs/config/GROUP/NAME.yaml: models, transforms, ...)
//   config.KEY.PATH=VALUE     an override; Hydra's +config.KEY.PATH=VALUE (add a key) and
//                             ++config.KEY.PATH=VALUE alike
//   hydra.KEY=VALUE           Hydra's own settings (hydra.verbose=true, hydra/job_logging=...):
//                             no effect here, listed with the ignored keys
//
// so that the command a VISSL user types, e.g.
//
//   swav config=pretrain/swav/swav_8node_resnet +config/pretrain/swav/models=resnet18
//        config.DATA.TRAIN.DATA_PATHS=[/data/train]   (one line)
//
// run from their VISSL checkout, reads the files VISSL would read (this trainer's defaults
// standing in for VISSL's where they are silent: docs/swav.md).
#pragma once

#include <algorithm>
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
// overrides, Hydra's settings and the problems of the line itself (a name found nowhere, a
// malformed group), which join the config's report.
struct CommandLine {
  std::vector<std::string> files, overrides, hydra, problems;
};

// `roots` as config_roots gives them: the first is the working directory, where config= may name
// a path; a group is a name on the config path only (Hydra's), so its files are looked up in the
// other roots.
inline CommandLine read_command_line(const std::vector<std::string>& args,
                                     const std::vector<std::filesystem::path>& roots) {
  CommandLine line;
  std::vector<std::string> groups;
  const std::vector<std::filesystem::path> config_path(roots.begin() + (roots.empty() ? 0 : 1),
                                                       roots.end());
  const auto find = [&](const std::string& name, const std::vector<std::filesystem::path>& where,
                        std::vector<std::string>& into) {
    try {
      into.push_back(find_config(name, where));
    } catch (const ConfigError& e) {
      line.problems.emplace_back(e.what());
    }
  };
  for (const auto& arg : args) {
    // Hydra's + (add) and ++ (add or override) prefixes change nothing here.
    const std::string bare = arg.substr(std::min(arg.find_first_not_of('+'), arg.size()));
    const auto eq = bare.find('=');
    if (bare.rfind("config=", 0) == 0) {
      if (bare.size() == 7)
        line.problems.emplace_back("'" + arg + "' names no file; pass config=PATH to a YAML file");
      else
        find(bare.substr(7), roots, line.files);
    } else if (bare.rfind("config/", 0) == 0) {
      const std::string group = eq == std::string::npos ? "" : bare.substr(7, eq - 7);
      const std::string name = eq == std::string::npos ? "" : bare.substr(eq + 1);
      if (group.empty() || name.empty())
        line.problems.emplace_back(
            "'" + arg +
            "' is not a config group override; write +config/GROUP=NAME, e.g. "
            "+config/pretrain/swav/models=resnet18");
      else
        find(group + "/" + name, config_path, groups);
    } else if (bare.rfind("config.", 0) == 0) {
      line.overrides.push_back(bare);
    } else if (bare.rfind("hydra.", 0) == 0 || bare.rfind("hydra/", 0) == 0) {
      line.hydra.push_back(bare.substr(0, eq));
    } else {
      line.overrides.push_back(arg);  // (the tree refuses it, saying what an override is)
    }
  }
  // Hydra composes the groups onto the primary config, whatever the order on the line.
  line.files.insert(line.files.end(), groups.begin(), groups.end());
  return line;
}

}  // namespace swav
