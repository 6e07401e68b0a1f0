// A VISSL-style configuration: a tree of YAML maps whose every key and value type is fixed by
// the defaults document (swav_defaults.hpp). A user file and command-line overrides
// (`config.OPTIMIZER.num_epochs=2`) are merged onto the defaults. Every problem of the merge is
// collected -- problems() -- and reported together with the reader's own (ConfigProblems), so
// one run tells a user every edit to make:
// a value of another type (named with the expected type), or a key the defaults do not have --
// with the nearest valid key when one is close (an edit-distance bound), else VISSL's meaning of
// the key when VISSL has it (vissl_keys.hpp). VISSL's keys that have no effect here (logging,
// monitors, loader plumbing, ...) are accepted and listed by ignored(); VISSL's old trunk schema
// (MODEL.TRUNK.TRUNK_PARAMS.RESNETS) reads as today's (MODEL.TRUNK.RESNETS). Lists replace the
// default list whole; their items are checked by whoever reads them.
#pragma once

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardkit/core/enum_names.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/function_ref.hpp"
#include "vissl_keys.hpp"

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

inline constexpr sk::EnumName<Kind> kKindNames[] = {{Kind::boolean, "a boolean (True/False)"},
                                                    {Kind::integer, "an integer"},
                                                    {Kind::number, "a number"},
                                                    {Kind::string, "a string"},
                                                    {Kind::list, "a list"},
                                                    {Kind::map, "a map of keys"},
                                                    {Kind::null, "null"}};

inline std::string_view kind_name(Kind k) { return sk::name_of(k, kKindNames); }

// Whether a user value of kind `given` may take the place of a default of kind `wanted`.
inline bool fits(Kind wanted, Kind given) {
  if (wanted == given || wanted == Kind::null) return true;
  if (wanted == Kind::number && given == Kind::integer) return true;  // 1 for 1.0
  if (wanted == Kind::string && given != Kind::map && given != Kind::list) return true;
  return false;
}

// How far a misspelt key may be from a valid one to be suggested: a quarter of its length, at
// least one edit and at most three (VERBOSE is not a misspelling of LOSS).
inline std::size_t suggestion_bound(const std::string& key) {
  return std::clamp<std::size_t>(key.size() / 4, 1, 3);
}

// The name among `candidates` nearest to `name` (the first of equals), when it is within the
// suggestion bound; else empty.
inline std::string nearest_name(const std::string& name,
                                const std::vector<std::string>& candidates) {
  std::string nearest;
  std::size_t best = suggestion_bound(name) + 1;
  for (const auto& candidate : candidates)
    if (const std::size_t d = edit_distance(name, candidate); d < best) {
      best = d;
      nearest = candidate;
    }
  return nearest;
}

// Whether a user's scalar is the one value an ignored key may have (booleans by meaning).
inline bool same_scalar(const YAML::Node& n, std::string_view wanted) {
  if (!n.IsScalar()) return n.IsNull() && wanted.empty();
  const std::string given = n.Scalar();
  if (is_bool_text(given) && is_bool_text(std::string(wanted))) {
    bool a = false, b = false;
    return YAML::convert<bool>::decode(n, a) &&
           YAML::convert<bool>::decode(YAML::Node(std::string(wanted)), b) && a == b;
  }
  return given == wanted;
}

inline std::string text_of(const YAML::Node& n) {
  YAML::Emitter out;
  out.SetMapFormat(YAML::Flow);
  out.SetSeqFormat(YAML::Flow);
  out << n;
  return out.c_str();
}

}  // namespace detail

// The problems a config has, gathered to be reported together: each independent part of the
// reading runs in attempt(), which keeps its ConfigError and lets the reading go on.
class ConfigProblems {
 public:
  ConfigProblems() = default;
  explicit ConfigProblems(std::vector<std::string> first) : messages_(std::move(first)) {}
  // Runs read(); false (the problem kept) when it threw a ConfigError, another refusal of a
  // value (sk::InvalidArgument), a refusal of a file or folder that the config names
  // (sk::IoError: its data) or yaml-cpp's refusal of a value's shape (unexpected_shape).
  // (read is a FunctionRef, so that the catching is compiled once rather than for each of the
  // readers' ~60 lambdas.)
  [[gnu::noinline]] bool attempt(sk::detail::FunctionRef<void()> read) {
    try {
      read();
      return true;
    } catch (const sk::InvalidArgument& e) {  // ConfigError, or a setting's own validate()
      messages_.emplace_back(e.what());
      return false;
    } catch (const sk::IoError& e) {  // a file or folder the config names (the data's)
      messages_.emplace_back(e.what());
      return false;
    } catch (const std::filesystem::filesystem_error& e) {  // ... that may not be read
      messages_.emplace_back(e.what());
      return false;
    } catch (const YAML::BadSubscript& e) {
      messages_.emplace_back(unexpected_shape(e));
      return false;
    } catch (const YAML::BadConversion& e) {
      messages_.emplace_back(unexpected_shape(e));
      return false;
    }
  }
  // A value of a shape the reading did not foresee (a subscript of a scalar, a list read as a
  // number): still a refusal with yaml-cpp's account of it, never an escaped exception. The
  // readers check the shapes they know and name the key; this is the net under them. (Other
  // yaml-cpp exceptions, such as a read of a key the defaults lack, are the program's errors
  // and go on up.)
  static std::string unexpected_shape(const YAML::Exception& e) {
    return std::string("config: a value of an unexpected shape (") + e.what() +
           "); compare it with the same key in the defaults";
  }
  // Throws one ConfigError with every problem, numbered (one alone as it is).
  void check() const {
    if (messages_.empty()) return;
    if (messages_.size() == 1) throw ConfigError(messages_.front());
    std::string message = "the config has " + std::to_string(messages_.size()) +
                          " problems (all of them, so that one round of edits fixes the config):";
    for (std::size_t i = 0; i < messages_.size(); ++i)
      message += "\n  " + std::to_string(i + 1) + ". " + messages_[i];
    throw ConfigError(message);
  }

 private:
  std::vector<std::string> messages_;
};

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
    if (doc.IsMap() && doc["config"]) {
      // (VISSL's files hold everything under config:; a key beside it -- an indentation slip --
      // was dropped without a word)
      for (const auto& kv : doc)
        if (!kv.first.IsScalar() || kv.first.Scalar() != "config")
          problems_.push_back("config file '" + path + "': the key " + detail::text_of(kv.first) +
                              " stands beside config: at the top, where it is not read; indent "
                              "it under config:");
      doc = doc["config"];
    }
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
    if (eq == std::string::npos || arg.rfind(prefix, 0) != 0) {
      problems_.push_back("argument '" + arg +
                          "' is not an override; write config.KEY.PATH=VALUE (e.g. "
                          "config.OPTIMIZER.num_epochs=2) or config=FILE");
      return;
    }
    const std::string path = arg.substr(prefix.size(), eq - prefix.size());
    YAML::Node value;
    try {
      value = YAML::Load(arg.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      problems_.push_back("override '" + arg + "': the value is not valid YAML: " + e.what());
      return;
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

  // The problems the merged files and overrides had (unknown keys, wrong types): the reader
  // reports them first, with its own (the merge kept the defaults in their place).
  const std::vector<std::string>& problems() const { return problems_; }
  // VISSL's keys that were given and are accepted without effect here, in the order met.
  const std::vector<std::string>& ignored() const { return ignored_; }
  // Lists a setting of the command line that has no effect here (Hydra's own) with the ignored.
  void ignore(const std::string& setting) { ignored_.push_back(setting); }
  // A problem of the command line (a config name found nowhere), reported with the merge's.
  void add_problem(const std::string& problem) { problems_.push_back(problem); }
  // Whether a file or an override gave `path` (a key, or a section holding a given key) -- where
  // the default stands in for what the user left out, and that matters (DATA.TEST).
  bool given(const std::string& path) const { return holds(given_, path); }
  // Whether a file or an override gave `path` (or a key in that section) a value of the wrong
  // type, which the default then stands in for: what reads it reads the default.
  bool refused(const std::string& path) const { return holds(refused_, path); }
  // Whether the merge refused the value of `path` itself (not only one below it).
  bool refused_exactly(const std::string& path) const { return refused_.count(path) != 0; }

  // The node at a dotted path ("OPTIMIZER.larc_config.clip"); it exists (the defaults have it).
  // A view of the tree, read-only: const, so a subscript of it is yaml-cpp's const one, which
  // never inserts a key. The walk binds each step's node to a new name, because assigning one
  // yaml-cpp Node to another overwrites the node it refers to (the tree) rather than rebinding
  // it -- and cloning the whole tree per read instead copied the config at every lookup.
  const YAML::Node at(const std::string& path) const { return walk(root_, path, 0); }
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
  // The node at `path`'s keys from `from` on, below `node`.
  static const YAML::Node walk(const YAML::Node& node, const std::string& path, std::size_t from) {
    if (from > path.size()) return node;
    const std::size_t dot = std::min(path.find('.', from), path.size());
    const std::string key = path.substr(from, dot - from);
    if (!node.IsMap() || !node[key]) throw ConfigError("internal: no config key " + path);
    return walk(node[key], path, dot + 1);
  }
  static void set_in(YAML::Node node, const std::vector<std::string>& keys, std::size_t i,
                     const YAML::Node& value) {
    if (i + 1 == keys.size()) {
      node[keys[i]] = value;
      return;
    }
    YAML::Node child = node[keys[i]];
    set_in(child, keys, i + 1, value);
  }

  void merge(YAML::Node target, const YAML::Node& source, const std::string& where) {
    for (const auto& kv : source) {
      // Keys are names; YAML also allows a map or a list as a key (`? {a: 1}: ...`).
      if (!kv.first.IsScalar()) {
        problems_.push_back(
            "config key " + detail::text_of(kv.first) +
            (where.empty() ? "" : " under config." + where) +
            " is not a name; config keys are names such as OPTIMIZER or num_epochs");
        continue;
      }
      const std::string key = kv.first.Scalar();
      const std::string path = where.empty() ? key : where + "." + key;
      bool known = false;
      for (const auto& t : target)
        if (t.first.as<std::string>() == key) known = true;
      if (!known) {
        // VISSL before 0.1.6 put the trunk's blocks under TRUNK_PARAMS.
        if (path == "MODEL.TRUNK.TRUNK_PARAMS" && kv.second.IsMap())
          merge(target, kv.second, where);
        else
          unknown(path, kv.second, &target);
        continue;
      }
      YAML::Node current = target[key];
      const detail::Kind wanted = detail::kind_of(current), given = detail::kind_of(kv.second);
      if (wanted == detail::Kind::map && given == detail::Kind::map) {
        merge(current, kv.second, path);
        continue;
      }
      given_.insert(path);
      if (!detail::fits(wanted, given)) {
        problems_.push_back("config." + path + " = " + detail::text_of(kv.second) + " is " +
                            std::string(detail::kind_name(given)) + "; it must be " +
                            std::string(detail::kind_name(wanted)) +
                            " (default: " + detail::text_of(current) + ")");
        refused_.insert(path);
        continue;
      }
      // An empty value for a text key (`config.METRICS.JSONL=`, `KEY: ~`) is the empty text, as
      // Hydra reads `key=`: read as YAML's null it became the text "null" (a file ./null).
      if (wanted == detail::Kind::string && given == detail::Kind::null)
        target[key] = std::string();
      else
        target[key] = YAML::Clone(kv.second);
    }
  }

  // Whether `keys` holds `path` or a key in the section `path`.
  static bool holds(const std::set<std::string>& keys, const std::string& path) {
    if (keys.count(path) != 0) return true;
    const auto below = keys.lower_bound(path + ".");
    return below != keys.end() && below->rfind(path + ".", 0) == 0;
  }

  // The valid key among `siblings` (null: none) nearest to the last part of `path`, when it is
  // within the suggestion bound; else empty.
  static std::string nearest_key(const std::string& path, const YAML::Node* siblings) {
    if (siblings == nullptr) return {};
    const auto dot = path.rfind('.');
    const std::string key = dot == std::string::npos ? path : path.substr(dot + 1);
    const std::string where = dot == std::string::npos ? "" : path.substr(0, dot + 1);
    std::vector<std::string> keys;
    for (const auto& t : *siblings) keys.push_back(t.first.as<std::string>());
    const std::string nearest = detail::nearest_name(key, keys);
    return nearest.empty() ? nearest : where + nearest;
  }

  // A key the defaults do not have: ignored when it is VISSL's and has no effect here, else a
  // problem -- naming the nearest valid key when one is close (a misspelt section is reported
  // once, as a section), else VISSL's meaning. An unknown section of keys is walked key by key:
  // a few of a section's keys matter in one value and not in another. `siblings` (null inside
  // an unknown section) holds the valid keys beside it.
  void unknown(const std::string& path, const YAML::Node& value, const YAML::Node* siblings) {
    const bool section = value.IsMap() && value.size() > 0;
    const IgnoredVisslKey* rule = section ? nullptr : ignored_vissl_key(path);
    const std::string shown = "config." + path + " (= " + detail::text_of(value) + ")";
    // A misspelling of a valid key is reported as one, even inside a section whose other keys
    // VISSL lets this trainer ignore (DATA.TEST.*); a key a rule names exactly is VISSL's.
    if (rule == nullptr || rule->path != path) {
      if (const std::string nearest = nearest_key(path, siblings); !nearest.empty()) {
        problems_.push_back("unknown config key " + shown + "; the nearest valid key is config." +
                            nearest);
        return;
      }
    }
    if (rule != nullptr) {
      if (rule->only.data() == nullptr || detail::same_scalar(value, rule->only)) {
        ignored_.push_back(path);
        return;
      }
      const std::string wanted = rule->only.empty() ? "\"\"" : std::string(rule->only);
      const std::string_view meaning = vissl_meaning(path);
      problems_.push_back(
          shown +
          ": this trainer has no such setting and can follow VISSL's config only where it is " +
          wanted + (meaning.empty() ? "" : " (VISSL's meaning: " + std::string(meaning) + ")") +
          "; set it to " + wanted + " or remove it");
      return;
    }
    const auto dot = path.rfind('.');
    const std::string where = dot == std::string::npos ? "" : path.substr(0, dot);
    if (section) {
      for (const auto& kv : value) {
        if (kv.first.IsScalar())
          unknown(path + "." + kv.first.Scalar(), kv.second, nullptr);
        else
          problems_.push_back("config key " + detail::text_of(kv.first) + " under config." + path +
                              " is not a name");
      }
      return;
    }
    const std::string_view meaning = vissl_meaning(path);
    if (!meaning.empty()) {
      problems_.push_back(
          shown + " is not a key of this trainer; VISSL's meaning: " + std::string(meaning));
      return;
    }
    std::string message = "unknown config key " + shown + ": neither this trainer nor VISSL has it";
    if (siblings != nullptr && siblings->size() <= 16) {
      message += where.empty() ? "; the keys are" : "; the keys under config." + where + " are";
      const char* separator = " ";
      for (const auto& t : *siblings) {
        message += separator + t.first.as<std::string>();
        separator = ", ";
      }
    }
    problems_.push_back(message);
  }

  YAML::Node root_;
  std::vector<std::string> problems_;  // every problem of the merges, for check()
  std::vector<std::string> ignored_;   // VISSL's keys accepted without effect
  std::set<std::string> given_;        // the keys the files and overrides set
  std::set<std::string> refused_;      // ... with a value of the wrong type
};

}  // namespace swav
