// libFuzzer target: an IDX file (plain or gzip: zlib decides) through read_idx. Accepted
// arrays must hold exactly the product of their dimensions.
#include <cstddef>
#include <cstdint>

#include "fuzz_input.hpp"
#include "shardkit/data/idx_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::MemoryFile file(data, size);
  try {
    const auto array = shardkit::data::read_idx(file.path());
    std::uint64_t numel = 1;
    for (const auto d : array.dims) numel *= static_cast<std::uint64_t>(d);
    if (array.data.size() != numel) __builtin_trap();
  } catch (const shardkit::Error&) {
  }
  return 0;
}
