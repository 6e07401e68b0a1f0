// A VISSL-style configuration: a tree of YAML maps whose every key and value type is fixed by
// the defaults document (swav_defaults.hpp). A user file and command-line overrides
// (`config.OPTIMIZER.num_epochs=2`) are merged onto the defaults; a key the defaults do not
// have, or a value of another type, is an error that names the key, the value and the nearest
// valid key or the expected type. Lists replace the default list whole; their items are checked
// by whoever reads them.
#pragma once

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace swav {

namespace sk = shardkit;

struct ConfigError : sk::InvalidArgument {
  using sk::InvalidArgument::InvalidArgument;
};

namespace detail {

inline std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

enum class Kind { boolean, integer, number, string, list, map, null };

inline bool is_bool_text(const std::string& s) {
  static const char* const words[] = {"true", "True", "TRUE", "false", "False", "FALSE",
                                      "yes",  "Yes",  "no",   "No",    "on",    "off"};
  return std::find(std::begin(words), std::end(words), s) != std::end(words);
}

inline Kind kind_of(const YAML::Node& n) {
  if (n.IsMap()) return Kind::map;
  if (n.IsSequence()) return Kind::list;
  if (n.IsNull()) return Kind::null;
  const std::string s = n.Scalar();
  if (n.Tag() == "!") return Kind::string;  // quoted
  if (is_bool_text(s)) return Kind::boolean;
  long long i;
  if (YAML::convert<long long>::decode(n, i) && s.find_first_of(".eE") == std::string::npos)
    return Kind::integer;
  double d;
  if (YAML::convert<double>::decode(n, d)) return Kind::number;
  return Kind::string;
}

inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::boolean:
      return "a boolean (True/False)";
    case Kind::integer:
      return "an integer";
    case Kind::number:
      return "a number";
    case Kind::string:
      return "a string";
    case Kind::list:
      return "a list";
    case Kind::map:
      return "a map of keys";
    case Kind::null:
      return "null";
  }
  return "?";
}

// Whether a user value of kind `given` may take the place of a default of kind `wanted`.
inline bool fits(Kind wanted, Kind given) {
  if (wanted == given || wanted == Kind::null) return true;
  if (wanted == Kind::number && given == Kind::integer) return true;  // 1 for 1.0
  if (wanted == Kind::string && given != Kind::map && given != Kind::list) return true;
  return false;
}

inline std::string text_of(const YAML::Node& n) {
  YAML::Emitter out;
  out.SetMapFormat(YAML::Flow);
  out.SetSeqFormat(YAML::Flow);
  out << n;
  return out.c_str();
}

}  // namespace detail

class ConfigTree {
 public:
  explicit ConfigTree(const std::string& defaults_yaml) : root_(YAML::Load(defaults_yaml)) {}

  // Merges a user document (a VISSL config file: its keys under `config:` or at the top).
  void merge_file(const std::string& path) {
    std::ifstream in(path);
    if (!in)
      throw ConfigError("config file '" + path +
                        "' cannot be read; pass config=PATH to a YAML file (shipped ones are in "
                        "samples/swav/configs/)");
    YAML::Node doc;
    try {
      doc = YAML::LoadFile(path);
    } catch (const YAML::Exception& e) {
      throw ConfigError("config file '" + path + "' is not valid YAML: " + e.what());
    }
    if (doc.IsMap() && doc["config"]) doc = doc["config"];
    if (doc.IsNull()) return;
    if (!doc.IsMap())
      throw ConfigError("config file '" + path + "' must hold a map of keys (e.g. OPTIMIZER: ...)");
    merge(root_, doc, "");
  }

  // `config.A.B=value` (VISSL's command-line form); the value is read as YAML (True, 0.1,
  // [0, 1], {"opt_level": "O1"}).
  void apply_override(const std::string& arg) {
    const auto eq = arg.find('=');
    const std::string prefix = "config.";
    if (eq == std::string::npos || arg.rfind(prefix, 0) != 0)
      throw ConfigError("argument '" + arg +
                        "' is not an override; write config.KEY.PATH=VALUE (e.g. "
                        "config.OPTIMIZER.num_epochs=2) or config=FILE");
    const std::string path = arg.substr(prefix.size(), eq - prefix.size());
    YAML::Node value;
    try {
      value = YAML::Load(arg.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      throw ConfigError("override '" + arg + "': the value is not valid YAML: " + e.what());
    }
    // Build {A: {B: value}} and merge it like a file.
    YAML::Node doc = value;
    std::vector<std::string> keys;
    std::stringstream ss(path);
    for (std::string k; std::getline(ss, k, '.');) keys.push_back(k);
    for (auto it = keys.rbegin(); it != keys.rend(); ++it) {
      YAML::Node wrap(YAML::NodeType::Map);
      wrap[*it] = doc;
      doc = wrap;
    }
    merge(root_, doc, "");
  }

  // The node at a dotted path ("OPTIMIZER.larc_config.clip"); it exists (the defaults have it).
  YAML::Node at(const std::string& path) const {
    YAML::Node n = YAML::Clone(root_);
    std::stringstream ss(path);
    for (std::string k; std::getline(ss, k, '.');) {
      if (!n.IsMap() || !n[k]) throw ConfigError("internal: no config key " + path);
      n = n[k];
    }
    return n;
  }
  template <class T>
  T get(const std::string& path) const {
    const YAML::Node n = at(path);
    try {
      return n.as<T>();
    } catch (const YAML::Exception&) {
      throw ConfigError("config." + path + " = " + detail::text_of(n) + " has the wrong type");
    }
  }
  // Sets a value the program infers (VISSL's infer_and_assert_hydra_config), bypassing checks.
  template <class T>
  void set(const std::string& path, const T& value) {
    std::vector<std::string> keys;
    std::stringstream ss(path);
    for (std::string k; std::getline(ss, k, '.');) keys.push_back(k);
    set_in(root_, keys, 0, YAML::Node(value));
  }
  std::string dump() const {
    YAML::Emitter out;
    out << root_;
    return out.c_str();
  }

 private:
  static void set_in(YAML::Node node, const std::vector<std::string>& keys, std::size_t i,
                     const YAML::Node& value) {
    if (i + 1 == keys.size()) {
      node[keys[i]] = value;
      return;
    }
    YAML::Node child = node[keys[i]];
    set_in(child, keys, i + 1, value);
  }

  static void merge(YAML::Node target, const YAML::Node& source, const std::string& where) {
    for (const auto& kv : source) {
      // Keys are names; YAML also allows a map or a list as a key (`? {a: 1}: ...`).
      if (!kv.first.IsScalar())
        throw ConfigError("config key " + detail::text_of(kv.first) +
                          (where.empty() ? "" : " under config." + where) +
                          " is not a name; config keys are names such as OPTIMIZER or num_epochs");
      const std::string key = kv.first.Scalar();
      const std::string path = where.empty() ? key : where + "." + key;
      bool known = false;
      for (const auto& t : target)
        if (t.first.as<std::string>() == key) known = true;
      if (!known) {
        std::string best;
        std::size_t best_distance = std::string::npos;
        for (const auto& t : target) {
          const std::string candidate = t.first.as<std::string>();
          const std::size_t d = detail::edit_distance(key, candidate);
          if (d < best_distance) {
            best_distance = d;
            best = candidate;
          }
        }
        std::string message =
            "unknown config key config." + path + " (= " + detail::text_of(kv.second) + ")";
        if (!best.empty())
          message +=
              "; the nearest valid key is config." + (where.empty() ? best : where + "." + best);
        throw ConfigError(message);
      }
      YAML::Node current = target[key];
      const detail::Kind wanted = detail::kind_of(current), given = detail::kind_of(kv.second);
      if (wanted == detail::Kind::map && given == detail::Kind::map) {
        merge(current, kv.second, path);
        continue;
      }
      if (!detail::fits(wanted, given))
        throw ConfigError("config." + path + " = " + detail::text_of(kv.second) + " is " +
                          detail::kind_name(given) + "; it must be " + detail::kind_name(wanted) +
                          " (default: " + detail::text_of(current) + ")");
      target[key] = YAML::Clone(kv.second);
    }
  }

  YAML::Node root_;
};

}  // namespace swav
