// safetensors: round trips of every dtype, a file written by hand exactly as the format's
// specification lays it out (as other tools write it), atomic replacement, corrupt files, and
// the per-tensor checksums that catch a flipped bit.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardkit/checkpoint/safetensors.hpp"

namespace sk = shardkit;
namespace fs = std::filesystem;
using sk::checkpoint::NamedBytes;

namespace {

// A directory of this process's, emptied at its first use (the pid may be an earlier run's,
// whose files would otherwise be found by the checks that nothing was written yet) and removed
// when the process ends.
struct ScratchDir {
  fs::path path =
      fs::temp_directory_path() / ("shardkit_safetensors_" + std::to_string(::getpid()));
  ScratchDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

fs::path scratch(const std::string& name) {
  static const ScratchDir dir;
  return dir.path / name;
}

void write_raw(const fs::path& path, const std::string& header,
               const std::vector<unsigned char>& data) {
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

std::vector<unsigned char> bytes_of(const std::vector<float>& values) {
  std::vector<unsigned char> out(values.size() * 4);
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::string load_error(const fs::path& path) {
  try {
    (void)sk::checkpoint::load_safetensors(path.string());
  } catch (const sk::IoError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("every dtype round-trips with its shape, in file order, with metadata") {
  const auto path = scratch("round_trip.safetensors");
  std::vector<NamedBytes> tensors = {
      NamedBytes::of<float>("z.weight", {2, 3}, {0.5f, -1.25f, 3e-8f, 7.0f, -0.0f, 1e30f}),
      NamedBytes::of<double>("a.f64", {2}, {3.141592653589793, -2.5e-300}),
      NamedBytes::of<std::int64_t>("steps", {1}, {1234567890123}),
      NamedBytes::of<std::int32_t>("i32", {3}, {-1, 0, 2147483647}),
      NamedBytes::of<std::uint8_t>("labels", {4}, {0, 9, 255, 3}),
      NamedBytes::of<float>("empty", {0, 4}, {}),
      NamedBytes::of<float>("scalar", {}, {42.0f}),
  };
  NamedBytes half{
      "h",
      sk::DType::f16,
      {2},
      std::vector<std::byte>{std::byte{0x00}, std::byte{0x3c}, std::byte{0x00}, std::byte{0xc0}}};
  tensors.push_back(half);
  sk::checkpoint::save_safetensors(path.string(), tensors, {{"format", "pt"}, {"note", "hello"}});
  const auto back = sk::checkpoint::load_safetensors(path.string());
  REQUIRE(back.tensors.size() == tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    CHECK(back.tensors[i].name == tensors[i].name);
    CHECK(back.tensors[i].dtype == tensors[i].dtype);
    CHECK(back.tensors[i].shape == tensors[i].shape);
    CHECK(back.tensors[i].bytes == tensors[i].bytes);
  }
  CHECK(back.metadata.at("note") == "hello");
  CHECK(back.find("steps")->values<std::int64_t>() == std::vector<std::int64_t>{1234567890123});
  // The header is padded so the data starts 8-byte aligned, as the format recommends.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  CHECK(n % 8 == 0);
  // Nothing temporary is left beside the file.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(path.parent_path()))
    files += entry.path().filename().string().find("round_trip") != std::string::npos;
  CHECK(files == 1);
}

TEST_CASE("a file laid out by hand as the specification says (as other tools write it) loads") {
  const auto path = scratch("by_hand.safetensors");
  // Keys in writer order (not sorted), dtype before shape, no padding: all allowed.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("a":{"dtype":"F32","shape":[1,1],"data_offsets":[8,12]}})";
  write_raw(path, header, bytes_of({1.5f, -2.0f, 0.25f}));
  const auto file = sk::checkpoint::load_safetensors(path.string());
  REQUIRE(file.tensors.size() == 2);
  CHECK(file.tensors[0].name == "b");  // data order
  CHECK(file.tensors[0].values<float>() == std::vector<float>{1.5f, -2.0f});
  CHECK(file.find("a")->shape == sk::Shape{1, 1});
  CHECK(file.find("a")->values<float>() == std::vector<float>{0.25f});
  CHECK(file.metadata.at("format") == "pt");
}

TEST_CASE(
    "the schema's optional fields: __metadata__ absent or null; unknown tensor keys ignored") {
  const auto path = scratch("optional_fields.safetensors");
  const auto data = bytes_of({1.5f, -2.0f});
  // null is how a writer with an Option<metadata> that is empty may serialise it.
  for (const char* metadata : {"", R"("__metadata__":null,)", R"("__metadata__":{},)"}) {
    CAPTURE(metadata);
    write_raw(path,
              std::string("{") + metadata +
                  R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"note":null}})",
              data);
    const auto file = sk::checkpoint::load_safetensors(path.string());
    REQUIRE(file.tensors.size() == 1);
    CHECK(file.tensors[0].values<float>() == std::vector<float>{1.5f, -2.0f});
    CHECK(file.metadata.empty());
  }
  // The required fields stay required: null is not a dtype, a shape or a pair of offsets.
  // (By message: a loader that took a null shape as [] would still fail, on the bytes.)
  const std::pair<const char*, const char*> nulls[] = {
      {R"({"dtype":null,"shape":[2],"data_offsets":[0,8]})", "tensor 'w' has dtype null"},
      {R"({"dtype":"F32","shape":null,"data_offsets":[0,8]})",
       "tensor 'w' has a shape that is not a list"},
      {R"({"dtype":"F32","shape":[2],"data_offsets":null})",
       "tensor 'w' has data_offsets null; expected [begin, end]"}};
  for (const auto& [entry, message] : nulls) {
    CAPTURE(entry);
    write_raw(path, std::string(R"({"w":)") + entry + "}", data);
    CHECK_THROWS_WITH_AS(sk::checkpoint::load_safetensors(path.string()),
                         doctest::Contains(message), sk::IoError);
  }
}

TEST_CASE("saving replaces an existing file whole, and a failed save leaves nothing behind") {
  const auto path = scratch("replace.safetensors");
  sk::checkpoint::save_safetensors(path.string(), {NamedBytes::of<float>("w", {3}, {1, 2, 3})});
  sk::checkpoint::save_safetensors(path.string(), {NamedBytes::of<float>("v", {2}, {4, 5})});
  const auto file = sk::checkpoint::load_safetensors(path.string());
  REQUIRE(file.tensors.size() == 1);
  CHECK(file.tensors[0].name == "v");

  const auto missing_dir = scratch("no_such_dir") / "x.safetensors";
  CHECK_THROWS_WITH_AS(sk::checkpoint::save_safetensors(missing_dir.string(),
                                                        {NamedBytes::of<float>("w", {1}, {1})}),
                       doctest::Contains("cannot open"), sk::IoError);
  CHECK_THROWS_WITH_AS(
      sk::checkpoint::save_safetensors(path.string(), {NamedBytes::of<float>("w", {1}, {1}),
                                                       NamedBytes::of<float>("w", {1}, {2})}),
      doctest::Contains("tensor name 'w' appears twice"), sk::InvalidArgument);
  CHECK(sk::checkpoint::load_safetensors(path.string()).tensors[0].name ==
        "v");  // the old file survives
}

TEST_CASE("corrupt or foreign files get errors that name the file and the problem") {
  const auto path = scratch("corrupt.safetensors");
  sk::checkpoint::save_safetensors(path.string(), {NamedBytes::of<float>("w", {4}, {1, 2, 3, 4})});
  const auto good_size = fs::file_size(path);
  fs::resize_file(path, good_size - 3);
  CHECK(load_error(path).find("data_offsets outside") != std::string::npos);

  write_raw(path, "{not json", {});
  CHECK(load_error(path).find("not valid JSON") != std::string::npos);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", bytes_of({1, 2}));
  CHECK(load_error(path).find("covers 8 bytes but its shape [3] of f32 needs 12") !=
        std::string::npos);
  write_raw(
      path,
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      bytes_of({1, 2}));
  CHECK(load_error(path).find("overlapping or holed") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", bytes_of({1, 2}));
  CHECK(load_error(path).find("the tensors cover 4 of 8 data bytes") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", bytes_of({1, 2}));
  CHECK(load_error(path).find("dtype 'C64'") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", bytes_of({1}));
  CHECK(load_error(path).find("the header's entry 'a' is malformed: ") != std::string::npos);
  CHECK(load_error(path).find("'shape' not found") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":null,"shape":[1],"data_offsets":[0,4]}})", bytes_of({1}));
  CHECK(load_error(path).find("tensor 'a' has dtype null, not a string") != std::string::npos);
  {
    std::ofstream out(path, std::ios::binary);
    out << "\xff\xff\xff\xff\xff\xff\xff\x7f{}";
  }
  CHECK(load_error(path).find("its header claims") != std::string::npos);
  CHECK(load_error(scratch("absent.safetensors")).find("cannot open") != std::string::npos);
  // What the reference reader refuses, refused too (tests/io/safetensors_reference.py checks
  // every verdict against it): a byte-order mark, NUL padding, numbers that are not
  // non-negative integers, a byte count that overflows, metadata that is not strings.
  write_raw(path, "\xEF\xBB\xBF{}", {});
  CHECK(load_error(path).find("byte-order mark") != std::string::npos);
  write_raw(path, std::string("{}\0\0", 4), {});
  CHECK(load_error(path).find("holds a NUL byte at 2") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", bytes_of({1, 2}));
  CHECK(load_error(path).find("tensor 'a' has shape entry 2.0, which is not a non-negative "
                              "integer") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1e1]}})", bytes_of({1, 2}));
  CHECK(load_error(path).find("data_offsets entry 10.0") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F32","shape":[4611686018427387904,4,4],"data_offsets":[0,0]}})",
            {});
  CHECK(load_error(path).find("element count overflows 64 bits") != std::string::npos);
  write_raw(path, R"({"a":{"dtype":"F64","shape":[2305843009213693952,2],"data_offsets":[0,0]}})",
            {});
  CHECK(load_error(path).find("byte count overflows 64 bits") != std::string::npos);
  // The element count first, as the reference: huge sizes before a 0 hold no bytes.
  write_raw(path, R"({"a":{"dtype":"F32","shape":[4611686018427387904,2,0],"data_offsets":[0,0]}})",
            {});
  CHECK(load_error(path) == "no error");
  write_raw(path, R"({"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})", {});
  CHECK(load_error(path).find("shape entry -0, which is not") != std::string::npos);
  // A field named twice inside a tensor's entry, or a second __metadata__: refused (two readers
  // would see two files); a tensor or a metadata key named twice is the last, as there.
  write_raw(path, R"({"a":{"dtype":"F32","shape":[1],"shape":[2],"data_offsets":[0,8]}})",
            bytes_of({1, 2}));
  CHECK(load_error(path).find("names 'shape' twice in one tensor's entry") != std::string::npos);
  write_raw(path,
            R"({"__metadata__":{"a":"1"},"__metadata__":{"a":"2"},)"
            R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            bytes_of({1, 2}));
  CHECK(load_error(path).find("names '__metadata__' twice, which") != std::string::npos);
  write_raw(path,
            R"({"__metadata__":{"a":"1","a":"2"},"w":{"dtype":"F32","shape":[1],)"
            R"("data_offsets":[0,4]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            bytes_of({1, 2}));
  {
    const auto file = sk::checkpoint::load_safetensors(path.string());
    CHECK(file.metadata.at("a") == "2");
    REQUIRE(file.tensors.size() == 1);
    CHECK(file.tensors[0].values<float>() == std::vector<float>{1, 2});
  }
  write_raw(path, R"({"__metadata__":{"step":1}})", {});
  CHECK(load_error(path).find("__metadata__ 'step' is 1, not a string") != std::string::npos);
}

TEST_CASE("the streaming writer takes any tensor's bytes in any order; the reader any range") {
  const auto path = scratch("stream.safetensors");
  {
    sk::checkpoint::SafetensorsWriter writer(
        path.string(),
        {{"a", sk::DType::f32, {4}}, {"empty", sk::DType::f32, {0}}, {"b", sk::DType::i64, {2}}},
        {{"format", "pt"}});
    const float a_tail[] = {3, 4};
    const float a_head[] = {1, 2};
    const std::int64_t b[] = {-7, 1LL << 40};
    writer.write("a", 8, a_tail, sizeof a_tail);  // the second half first
    writer.write("b", 0, b, sizeof b);
    writer.write("a", 0, a_head, sizeof a_head);
    CHECK_FALSE(fs::exists(path));  // nothing visible before commit()
    writer.commit();
  }
  const sk::checkpoint::SafetensorsReader reader(path.string());
  CHECK(reader.metadata().at("format") == "pt");
  REQUIRE(reader.find("a") != nullptr);
  float middle[2] = {};
  reader.read(*reader.find("a"), 4, middle, sizeof middle);
  CHECK(middle[0] == 2.0f);
  CHECK(middle[1] == 3.0f);
  CHECK(reader.read(*reader.find("b")).values<std::int64_t>() ==
        std::vector<std::int64_t>{-7, 1LL << 40});
  CHECK(reader.find("empty")->bytes() == 0);
  CHECK_THROWS_WITH(reader.read(*reader.find("a"), 12, middle, sizeof middle),
                    doctest::Contains("reading bytes [12, 20) of tensor 'a', which has 16"));
  // The same bytes as the whole-file writer would give.
  const auto whole = scratch("stream_whole.safetensors");
  sk::checkpoint::save_safetensors(
      whole.string(),
      {NamedBytes::of<float>("a", {4}, {1, 2, 3, 4}), NamedBytes::of<float>("empty", {0}, {}),
       NamedBytes::of<std::int64_t>("b", {2}, {-7, 1LL << 40})},
      {{"format", "pt"}});
  std::ifstream x(path, std::ios::binary), y(whole, std::ios::binary);
  CHECK(std::string(std::istreambuf_iterator<char>(x), {}) ==
        std::string(std::istreambuf_iterator<char>(y), {}));
}

TEST_CASE("a streamed file is refused until complete, and an abandoned one leaves nothing") {
  const auto path = scratch("partial.safetensors");
  {
    sk::checkpoint::SafetensorsWriter writer(path.string(), {{"a", sk::DType::f32, {4}}});
    const float head[] = {1, 2};
    writer.write("a", 0, head, sizeof head);
    CHECK_THROWS_WITH_AS(writer.commit(), doctest::Contains("tensor 'a' got 8 of its 16 bytes"),
                         sk::StateError);
    CHECK_THROWS_WITH(writer.write("a", 12, head, sizeof head),
                      doctest::Contains("writing bytes [12, 20) of tensor 'a', which has 16"));
    CHECK_THROWS_WITH(writer.write("c", 0, head, 4), doctest::Contains("no tensor 'c'"));
  }
  CHECK_FALSE(fs::exists(path));
  for (const auto& entry : fs::directory_iterator(path.parent_path()))
    CHECK(entry.path().filename().string().find("partial") == std::string::npos);
}

TEST_CASE("zero-size tensors may share an offset with a neighbour in any name order") {
  const auto path = scratch("zero_size.safetensors");
  // "z" is empty at offset 4, after "a" and at the start of "b": both orders of the keys.
  write_raw(path,
            R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
            R"("z":{"dtype":"F32","shape":[2,0,3],"data_offsets":[4,4]},)"
            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
            bytes_of({1, 2}));
  const auto file = sk::checkpoint::load_safetensors(path.string());
  REQUIRE(file.tensors.size() == 3);
  CHECK(file.find("b")->values<float>() == std::vector<float>{2});
  CHECK(file.find("z")->shape == sk::Shape{2, 0, 3});
}

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace

TEST_CASE("every tensor's CRC32 is recorded; a flipped bit anywhere in the data names the tensor") {
  const auto path = scratch("checksummed.safetensors");
  std::vector<float> a(1000);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::sin(static_cast<float>(i) * 0.37f);
  const std::int64_t b[] = {-7, 1LL << 40, 3};
  {
    // Streamed in pieces out of order: the writer combines the pieces' CRCs.
    sk::checkpoint::SafetensorsWriter writer(
        path.string(),
        {{"a", sk::DType::f32, {1000}}, {"empty", sk::DType::f32, {0}}, {"b", sk::DType::i64, {3}}},
        {{"note", "kept"}});
    writer.write("a", 2400, a.data() + 600, 1600);
    writer.write("b", 0, b, sizeof b);
    writer.write("a", 0, a.data(), 1200);
    writer.write("a", 1200, a.data() + 300, 1200);
    writer.commit();
  }
  const auto pristine = read_file(path);
  {
    const sk::checkpoint::SafetensorsReader reader(path.string());
    // The checksum keys live in the tensors' infos, not among the caller's metadata.
    CHECK(reader.metadata() == std::map<std::string, std::string>{{"note", "kept"}});
    CHECK(reader.find("a")->crc32 == sk::checkpoint::crc32_of(a.data(), 4000));
    CHECK(reader.find("b")->crc32 == sk::checkpoint::crc32_of(b, sizeof b));
    CHECK(reader.find("empty")->crc32 == 0u);
    CHECK(reader.verify_all() == 3);
  }
  // Flip one bit of every data byte of both tensors, one file at a time: each is caught on the
  // first read of any part of its tensor, and names it; the other tensor still reads.
  const std::uint64_t data_start = pristine.size() - 4000 - sizeof b;
  std::uint64_t flips = 0;
  for (std::uint64_t at = data_start; at < pristine.size(); at += 7) {
    std::string damaged = pristine;
    damaged[at] = static_cast<char>(damaged[at] ^ (1 << (at % 8)));
    write_file(path, damaged);
    const sk::checkpoint::SafetensorsReader reader(path.string());
    const auto* hit = reader.find("a");
    const auto* other = reader.find("b");
    if (at - data_start >= hit->begin + hit->bytes() || at - data_start < hit->begin)
      std::swap(hit, other);
    const std::string expected = "tensor '" + hit->name + "' is corrupt";
    float four[4];
    CHECK_THROWS_WITH_AS(reader.read(*hit), doctest::Contains(expected.c_str()), sk::IoError);
    CHECK_THROWS_WITH_AS(reader.read(*hit, 0, four, sizeof four),
                         doctest::Contains(expected.c_str()), sk::IoError);
    CHECK_NOTHROW(reader.read(*other));
    CHECK_THROWS_WITH_AS(reader.verify_all(), doctest::Contains(expected.c_str()), sk::IoError);
    ++flips;
  }
  CHECK(flips > 500);
  // The header's own checksum: every single-bit flip anywhere in the length or the header text
  // (names, shapes, offsets, checksums, metadata, padding) is refused when the file is opened.
  std::uint64_t header_flips = 0, named_corrupt = 0;
  for (std::uint64_t at = 0; at < data_start; ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string damaged = pristine;
      damaged[at] = static_cast<char>(damaged[at] ^ (1 << bit));
      write_file(path, damaged);
      std::string message;
      try {
        sk::checkpoint::SafetensorsReader reader(path.string());
      } catch (const sk::IoError& e) {
        message = e.what();
      }
      CAPTURE(at);
      CAPTURE(bit);
      CHECK_FALSE(message.empty());
      named_corrupt += message.find("the header is corrupt") != std::string::npos;
      ++header_flips;
    }
  }
  CHECK(header_flips > 1000);
  CHECK(named_corrupt > 50);  // those that still parse and pass the structural checks
  // A changed digit in a metadata value (the step count a resume trusts) names the header.
  {
    std::string damaged = pristine;
    const auto kept = damaged.find("\"kept\"");
    REQUIRE(kept != std::string::npos);
    damaged[kept + 1] = 'K';
    write_file(path, damaged);
    CHECK_THROWS_WITH_AS(sk::checkpoint::SafetensorsReader(path.string()),
                         doctest::Contains("the header is corrupt: its CRC32 is"), sk::IoError);
  }
  // A file from another writer has no checksums and loads unchecked.
  write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", bytes_of({1, 2}));
  {
    const sk::checkpoint::SafetensorsReader reader(path.string());
    CHECK_FALSE(reader.find("a")->crc32.has_value());
    CHECK(reader.verify_all() == 0);
    CHECK(reader.read(*reader.find("a")).values<float>() == std::vector<float>{1, 2});
  }
  // A checksum record that names no tensor, or is not 8 lowercase hex digits, is refused.
  write_raw(path,
            R"({"__metadata__":{"shardkit.crc32.x":"00000000"},)"
            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            bytes_of({1, 2}));
  CHECK_THROWS_WITH_AS(sk::checkpoint::SafetensorsReader(path.string()),
                       doctest::Contains("records a checksum for tensor 'x', which it does not"),
                       sk::IoError);
  write_raw(path,
            R"({"__metadata__":{"shardkit.crc32.a":"ABCDEF01"},)"
            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            bytes_of({1, 2}));
  CHECK_THROWS_WITH_AS(sk::checkpoint::SafetensorsReader(path.string()),
                       doctest::Contains("the checksum of tensor 'a' is 'ABCDEF01'"), sk::IoError);
}

// The reference writer orders tensors its own way (by dtype, then name): a shardkit file loaded
// in Python and saved again with its metadata kept has new offsets under the same checksums.
TEST_CASE("a file re-serialised by another writer with shardkit's checksums kept still loads") {
  const auto path = scratch("reserialised.safetensors");
  sk::checkpoint::save_safetensors(
      path.string(),
      {NamedBytes::of<float>("b", {2}, {1.5f, -2.0f}), NamedBytes::of<float>("a", {1}, {0.25f})},
      {{"step", "3"}});
  const std::string original = read_file(path);
  std::uint64_t length = 0;
  for (int i = 0; i < 8; ++i)
    length |= std::uint64_t(static_cast<unsigned char>(original[static_cast<std::size_t>(i)]))
              << (8 * i);
  const auto header = nlohmann::json::parse(original.substr(8, length));
  const std::string data = original.substr(8 + length);
  REQUIRE(header["b"]["data_offsets"] == nlohmann::json::array({0, 8}));
  // "a" first: its bytes, then "b"'s, every other key as it was.
  auto reordered = header;
  reordered["a"]["data_offsets"] = {0, 4};
  reordered["b"]["data_offsets"] = {4, 12};
  const std::string moved = data.substr(8, 4) + data.substr(0, 8);
  const std::vector<unsigned char> moved_bytes(moved.begin(), moved.end());
  write_raw(path, reordered.dump(), moved_bytes);
  {
    const sk::checkpoint::SafetensorsReader reader(path.string());
    CHECK(reader.verify_all() == 2);
    CHECK(reader.read(*reader.find("b")).values<float>() == std::vector<float>{1.5f, -2.0f});
    CHECK(reader.metadata().at("step") == "3");
  }
  // The header still checked: a changed metadata value, or dtype, is refused with the fix.
  auto changed = reordered;
  changed["__metadata__"]["step"] = "4";
  write_raw(path, changed.dump(), moved_bytes);
  CHECK(load_error(path).find("the header is corrupt") != std::string::npos);
  CHECK(load_error(path).find("remove the 'shardkit.crc32.*' and 'shardkit.header_crc32' "
                              "metadata") != std::string::npos);
  changed = reordered;
  changed["a"]["dtype"] = "I32";
  write_raw(path, changed.dump(), moved_bytes);
  CHECK(load_error(path).find("the header is corrupt") != std::string::npos);
  // And the values: a tensor rewritten with the old checksum kept is named, with the fix.
  std::vector<unsigned char> new_values = moved_bytes;
  new_values[0] ^= 1;
  write_raw(path, reordered.dump(), new_values);
  CHECK(load_error(path).find("tensor 'a' is corrupt") != std::string::npos);
  CHECK(load_error(path).find("remove the 'shardkit.crc32.*'") != std::string::npos);
  // A file whose header checksum covers the offsets too (shardkit's before 2026-12) loads.
  auto older = header;
  older["__metadata__"]["shardkit.header_crc32"] =
      sk::checkpoint::detail::crc32_hex(sk::checkpoint::detail::header_crc32(
          header, sk::checkpoint::detail::HeaderCrcForm::with_offsets));
  CHECK(older != header);
  const std::vector<unsigned char> data_bytes(data.begin(), data.end());
  write_raw(path, older.dump(), data_bytes);
  CHECK(load_error(path) == "no error");
  older["a"]["data_offsets"] = {0, 4};  // (then its offsets are checked by it, as they were)
  older["b"]["data_offsets"] = {4, 12};
  write_raw(path, older.dump(), moved_bytes);
  CHECK(load_error(path).find("the header is corrupt") != std::string::npos);
}

TEST_CASE("the writer owns the checksum keys and needs each byte written exactly once") {
  const auto path = scratch("twice.safetensors");
  CHECK_THROWS_WITH(sk::checkpoint::SafetensorsWriter(path.string(), {{"a", sk::DType::f32, {2}}},
                                                      {{"shardkit.crc32.a", "0"}}),
                    doctest::Contains("metadata key 'shardkit.crc32.a' is reserved"));
  CHECK_THROWS_WITH(sk::checkpoint::SafetensorsWriter(path.string(), {{"a", sk::DType::f32, {2}}},
                                                      {{"shardkit.header_crc32", "0"}}),
                    doctest::Contains("metadata key 'shardkit.header_crc32' is reserved"));
  sk::checkpoint::SafetensorsWriter writer(path.string(), {{"a", sk::DType::f32, {4}}});
  const float two[] = {1, 2};
  writer.write("a", 0, two, sizeof two);
  writer.write("a", 0, two, sizeof two);  // the first half twice, the second half never
  CHECK_THROWS_WITH_AS(writer.commit(),
                       doctest::Contains("tensor 'a' got bytes from 0 while bytes from 8 were "
                                         "missing or written twice"),
                       sk::StateError);
}

// What the writer cannot write a valid file of is refused before a byte is written, by name:
// a negative dimension (its reader refused the file it wrote; -1 wrapped every offset after
// it), bytes past 64 bits, and text that is not UTF-8 (a JSON library's error before, which
// named neither the entry nor the file). Nothing is left behind.
TEST_CASE("the writer refuses shapes and text it cannot write, naming them") {
  const auto path = scratch("refused.safetensors");
  using sk::checkpoint::SafetensorsWriter;
  CHECK_THROWS_WITH_AS(SafetensorsWriter(path.string(), {{"x", sk::DType::f32, {-2, -3}}}),
                       doctest::Contains("tensor 'x' has shape [-2, -3]; dimensions must be >= 0"),
                       sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      sk::checkpoint::save_safetensors(path.string(), {sk::checkpoint::NamedBytes::of<float>(
                                                          "x", {-2, -3}, std::vector<float>(6))}),
      doctest::Contains("dimensions must be >= 0"), sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      SafetensorsWriter(path.string(), {{"big", sk::DType::f64, {INT64_MAX / 4, 3}}}),
      doctest::Contains("their bytes fit in 64 bits"), sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(
      SafetensorsWriter(path.string(), {{"a", sk::DType::f32, {2}}}, {{"note", "caf\xe9"}}),
      doctest::Contains("the value of metadata key 'note' is not UTF-8 text"), sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(SafetensorsWriter(path.string(), {{"w\xff", sk::DType::f32, {2}}}),
                       doctest::Contains("the tensor name is not UTF-8 text"), sk::InvalidArgument);
  CHECK_FALSE(std::filesystem::exists(path));
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path()))
    CHECK(entry.path().filename().string().find(".tmp.") == std::string::npos);
}
