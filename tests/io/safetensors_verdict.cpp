// For the differential test against the reference safetensors reader (safetensors_reference.py):
// reads each file named on the command line with shardkit's SafetensorsReader and prints one
// JSON line per file -- {"ok": true, "tensors": {name: {dtype, shape, hex}}, "metadata": {...}}
// or {"ok": false, "error": "..."}.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include "shardkit/checkpoint/safetensors.hpp"

int main(int argc, char** argv) {
  namespace checkpoint = shardkit::checkpoint;
  for (int i = 1; i < argc; ++i) {
    nlohmann::json out;
    try {
      checkpoint::SafetensorsReader reader(argv[i]);
      out["ok"] = true;
      out["metadata"] = reader.metadata();
      out["tensors"] = nlohmann::json::object();
      for (const auto& t : reader.tensors()) {
        const auto bytes = reader.read(t).bytes;
        std::string hex;
        for (auto b : bytes) {
          static const char* digits = "0123456789abcdef";
          hex += digits[std::to_integer<int>(b) >> 4];
          hex += digits[std::to_integer<int>(b) & 15];
        }
        out["tensors"][t.name] = {{"dtype", checkpoint::detail::safetensors_dtype(t.dtype)},
                                  {"shape", t.shape},
                                  {"hex", hex}};
      }
    } catch (const std::exception& e) {
      out = {{"ok", false}, {"error", e.what()}};
    }
    // (an error may quote the file's bytes: replace what is not UTF-8)
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  return 0;
}
