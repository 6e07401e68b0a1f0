// libFuzzer target: a VISSL-style YAML config file through the SwAV trainer's loader (the
// merge over the defaults, with its unknown-key and type checks) and the reading of every
// setting (ranges, supported combinations). A refusal is a ConfigError or another typed error.
#include <cstddef>
#include <cstdint>

#include "config_tree.hpp"
#include "fuzz_input.hpp"
#include "swav_config.hpp"
#include "swav_defaults.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::MemoryFile file(data, size);
  try {
    swav::ConfigTree tree(swav::kDefaultsYaml);
    tree.merge_file(file.path());
    const int world = swav::configured_ranks(tree);
    (void)swav::read_swav_config(tree, world);
  } catch (const shardkit::Error&) {
  }
  return 0;
}
