// libFuzzer target: the safetensors header alone. The input's first two bytes give the size of
// a data section of patterned bytes, the rest is the JSON header; the target frames them as a
// file (8-byte length, header, data), so mutations go into the JSON rather than into the
// length field, which the whole-file target covers.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_input.hpp"
#include "shardkit/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t data_bytes = data[0] | (std::size_t{data[1]} << 8);
  const std::string header(reinterpret_cast<const char*>(data + 2), size - 2);
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[static_cast<std::size_t>(i)] =
        static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  bytes += header;
  for (std::size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<char>(i * 37 + 11));
  const fuzz::MemoryFile file(bytes.data(), bytes.size());
  try {
    const shardkit::checkpoint::SafetensorsReader reader(file.path());
    // What was accepted must be self-consistent: ranges tile the data, sizes match shapes.
    std::uint64_t covered = 0;
    for (const auto& t : reader.tensors()) {
      std::uint64_t numel = 1;
      for (const auto d : t.shape) numel *= static_cast<std::uint64_t>(d);
      if (t.bytes() != numel * shardkit::dtype_size(t.dtype)) __builtin_trap();
      covered += t.bytes();
    }
    if (covered != data_bytes) __builtin_trap();
  } catch (const shardkit::Error&) {
  }
  return 0;
}
