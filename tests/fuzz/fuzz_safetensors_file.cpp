// libFuzzer target: a whole safetensors file (length, header, data) through SafetensorsReader,
// then every tensor read whole and in two halves (the checksum paths), and verify_all().
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_input.hpp"
#include "shardkit/checkpoint/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::MemoryFile file(data, size);
  try {
    const shardkit::checkpoint::SafetensorsReader reader(file.path());
    for (const auto& t : reader.tensors()) {
      const auto whole = reader.read(t);
      if (whole.bytes.size() != t.bytes()) __builtin_trap();
      std::vector<std::byte> half(static_cast<std::size_t>(t.bytes() / 2));
      reader.read(t, t.bytes() - half.size(), half.data(), half.size());
    }
    (void)reader.verify_all();
  } catch (const shardkit::Error&) {
    // A refusal with a typed error is the reader doing its job.
  }
  return 0;
}
