// IDX reading (synthetic files, corrupt files, the real Fashion-MNIST) and the sampler.
#include <doctest/doctest.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>
#include <string>

#include "shardkit/checkpoint/checkpoint.hpp"
#include "shardkit/data/data.hpp"

namespace sk = shardkit;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir() {
  auto dir = fs::temp_directory_path() / ("shardkit_io_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

void write_gz(const fs::path& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  gzclose(f);
}

std::vector<unsigned char> idx_bytes(std::vector<std::uint32_t> dims,
                                     const std::vector<unsigned char>& data) {
  std::vector<unsigned char> out{0, 0, 0x08, static_cast<unsigned char>(dims.size())};
  for (auto d : dims)
    for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<unsigned char>(d >> shift));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::string io_error(const fs::path& path) {
  try {
    sk::data::read_idx(path.string());
  } catch (const sk::IoError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("read_idx reads gzip and plain IDX files") {
  const auto dir = temp_dir();
  std::vector<unsigned char> data(2 * 3 * 4);
  std::iota(data.begin(), data.end(), 7);
  write_gz(dir / "a.gz", idx_bytes({2, 3, 4}, data));
  const auto array = sk::data::read_idx((dir / "a.gz").string());
  CHECK(array.dims == std::vector<std::int64_t>{2, 3, 4});
  CHECK(array.data == std::vector<std::uint8_t>(data.begin(), data.end()));
  {
    const auto raw = idx_bytes({5}, {9, 8, 7, 6, 5});
    FILE* f = std::fopen((dir / "plain.idx").c_str(), "wb");
    std::fwrite(raw.data(), 1, raw.size(), f);
    std::fclose(f);
  }
  CHECK(sk::data::read_idx((dir / "plain.idx").string()).data ==
        std::vector<std::uint8_t>{9, 8, 7, 6, 5});
  fs::remove_all(dir);
}

TEST_CASE("corrupt IDX files get errors that name the file and the problem") {
  const auto dir = temp_dir();
  write_gz(dir / "short.gz", idx_bytes({10}, {1, 2, 3}));
  CHECK(io_error(dir / "short.gz").find("ends early or is corrupt while reading the data") !=
        std::string::npos);
  write_gz(dir / "magic.gz", {1, 2, 8, 1, 0, 0, 0, 1, 5});
  CHECK(io_error(dir / "magic.gz").find("is not an IDX file") != std::string::npos);
  write_gz(dir / "type.gz", {0, 0, 0x0d, 1, 0, 0, 0, 1, 5, 5, 5, 5});
  CHECK(io_error(dir / "type.gz").find("holds IDX type 0x0D; only unsigned bytes") !=
        std::string::npos);  // (f32's type, in hex: it printed "0x13")
  write_gz(dir / "long.gz", idx_bytes({2}, {1, 2, 3}));
  CHECK(io_error(dir / "long.gz").find("bytes after its 2 data elements") != std::string::npos);
  CHECK(io_error(dir / "absent.gz").find("cannot open") != std::string::npos);
  // Sizes whose product overflows 64 bits (4 x 2^32 - 1) are refused before any arithmetic wraps.
  write_gz(dir / "huge.gz", {0,   0,   8,   4,   255, 255, 255, 255, 255, 255,
                             255, 255, 255, 255, 255, 255, 255, 255, 255, 255});
  CHECK(io_error(dir / "huge.gz").find("claims dimensions of more than 17179869184 elements") !=
        std::string::npos);
  // A claim within the limit (2^33 elements) over three bytes fails at the end of the data,
  // without reserving 8 GiB first (the fuzzer's first finding: memory follows the file).
  write_gz(dir / "claim.gz", {0, 0, 8, 2, 0, 0, 0, 2, 255, 255, 255, 255, 1, 2, 3});
  CHECK(io_error(dir / "claim.gz").find("ends early or is corrupt while reading the data") !=
        std::string::npos);
  // A gzip file cut in its trailer (CRC-32 and length): zlib's read gives 0 as at a clean end,
  // and says the stream is incomplete through gzerror only -- the file was taken whole.
  write_gz(dir / "trailer.gz", idx_bytes({2, 3, 4}, std::vector<unsigned char>(24, 9)));
  fs::resize_file(dir / "trailer.gz", fs::file_size(dir / "trailer.gz") - 8);
  CHECK(io_error(dir / "trailer.gz").find("ends early or is corrupt at its end") !=
        std::string::npos);
  try {
    sk::data::load_fashion_mnist("train", dir.string());
    FAIL("no throw");
  } catch (const sk::IoError& e) {
    CHECK(std::string(e.what()).find("apt-get install dataset-fashion-mnist") != std::string::npos);
  }
  // Images of no columns: every crop of them would be empty (the SwAV loader read before row 0).
  write_gz(dir / "train-images-idx3-ubyte.gz", idx_bytes({2, 28, 0}, {}));
  write_gz(dir / "train-labels-idx1-ubyte.gz", idx_bytes({2}, {0, 1}));
  try {
    sk::data::load_fashion_mnist("train", dir.string());
    FAIL("no throw");
  } catch (const sk::IoError& e) {
    CHECK(std::string(e.what()).find("holds images of 28 x 0 pixels") != std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("the real Fashion-MNIST: 60 000 + 10 000 28x28 images, 10 balanced classes") {
  const auto train = sk::data::load_fashion_mnist("train");
  const auto test = sk::data::load_fashion_mnist("t10k");
  CHECK(train.count == 60000);
  CHECK(test.count == 10000);
  CHECK(train.rows == 28);
  CHECK(train.cols == 28);
  std::array<int, 10> per_class{};
  for (auto label : train.labels) ++per_class[label];
  for (int c : per_class) CHECK(c == 6000);
  // Real images: not blank, full 0..255 range used.
  const auto [low, high] = std::minmax_element(train.pixels.begin(), train.pixels.end());
  CHECK(*low == 0);
  CHECK(*high == 255);
}

TEST_CASE("stateful sampler: VISSL's contiguous blocks, shared permutation, dropped tail") {
  const std::int64_t size = 103;
  const int world = 4;
  std::set<std::int64_t> seen;
  std::vector<std::int64_t> rank0;
  for (int r = 0; r < world; ++r) {
    sk::data::StatefulDistributedSampler sampler(size, world, r, 5, 17);
    sampler.set_epoch(3);
    const auto indices = sampler.indices();
    CHECK(indices.size() == 25);  // 103 - 103 mod 4 = 100, / 4
    for (auto i : indices) {
      CHECK(i >= r * 25);
      CHECK(i < (r + 1) * 25);
      seen.insert(i);
    }
    if (r == 0) rank0 = indices;
    for (std::size_t k = 0; k < indices.size(); ++k) CHECK(indices[k] - r * 25 == rank0[k]);
  }
  CHECK(seen.size() == 100);  // indices 100..102 dropped, nothing repeated
  CHECK(*seen.rbegin() == 99);

  sk::data::StatefulDistributedSampler sampler(size, world, 1, 5, 17);
  sampler.set_epoch(3);
  const auto full = sampler.indices();
  CHECK_FALSE(std::is_sorted(full.begin(), full.end()));
  sampler.set_epoch(4);
  CHECK(sampler.indices() != full);
  sampler.set_epoch(3);
  sampler.set_start_iter(2);  // resume after two batches of 5
  CHECK(sampler.indices() == std::vector<std::int64_t>(full.begin() + 10, full.end()));
  sampler.set_start_iter(9);
  CHECK(sampler.indices().empty());
  sampler.set_start_iter(std::numeric_limits<std::int64_t>::max() / 2);  // a corrupt resume point
  CHECK(sampler.indices().empty());
  CHECK_THROWS_WITH_AS(sk::data::StatefulDistributedSampler(3, 4, 0, 1),
                       doctest::Contains("3 samples cannot feed 4 ranks"), sk::InvalidArgument);
  CHECK_THROWS_WITH_AS(sk::data::StatefulDistributedSampler(10, 2, 2, 1),
                       doctest::Contains("rank 2 outside [0, 2)"), sk::InvalidArgument);
}

// A checkpoint of another global batch resumes at the same epoch and images, in this run's steps:
// the schedule's iteration / total and the epoch's data stay where the writer was.
TEST_CASE("a resumed position travels in images between global batches") {
  const sk::data::TrainingPosition written{30, 1, 10};  // 20 steps an epoch of 16 images a step
  const auto same = sk::data::converted_position(written, 16, 16, 20);
  CHECK(same.iteration == 30);
  const auto doubled = sk::data::converted_position(written, 16, 32, 10);  // twice the ranks
  CHECK(doubled.epoch == 1);
  CHECK(doubled.batch == 5);
  CHECK(doubled.iteration == 15);  // 1.5 epochs of 10 steps: the schedule's 1.5 / epochs
  const auto halved = sk::data::converted_position(written, 16, 8, 40);
  CHECK(halved.batch == 20);
  CHECK(halved.iteration == 60);
  // A partial step's images are seen again: 10 x 16 = 160 images are 3 steps of 48.
  CHECK(sk::data::converted_position(written, 16, 48, 6).batch == 3);
  CHECK_THROWS_AS(sk::data::converted_position({0, 0, INT64_MAX / 2}, 16, 8, 40),
                  sk::InvalidArgument);
  // An epoch whose iteration would overflow (a damaged checkpoint's metadata).
  CHECK_THROWS_WITH_AS(sk::data::converted_position({0, std::int64_t{1} << 40, 0}, 16, 8, 1 << 24),
                       doctest::Contains("is not one a run reaches"), sk::InvalidArgument);
  CHECK(sk::data::converted_position({0, 1000, 0}, 16, 8, 1 << 24).iteration == 1000ll << 24);
}
