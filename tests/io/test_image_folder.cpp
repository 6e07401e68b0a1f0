// The image readers (data/image_decode.hpp, image_folder.hpp) on files the test writes: PNG and
// PGM/PPM exactly, JPEG within its loss, grey and RGB, ImageFolder's layout and order; corrupt,
// truncated and unsupported files refused by path; the synthetic source.
#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <string>

#include "image_files.hpp"
#include "shardkit/core/philox.hpp"
#include "shardkit/data/image_folder.hpp"
#include "shardkit/data/synthetic_images.hpp"

namespace sk = shardkit;
namespace fs = std::filesystem;
using image_files::Pixels;

namespace {

struct TempFolder {
  fs::path path;
  explicit TempFolder(const std::string& name)
      : path(fs::temp_directory_path() /
             ("shardkit_images_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() { fs::remove_all(path); }
  std::string operator/(const std::string& rel) const {
    fs::create_directories((path / rel).parent_path());
    return (path / rel).string();
  }
};

// Random pixels, never all alike: a smooth ramp plus noise (JPEG keeps smooth images closely).
Pixels random_pixels(std::int64_t rows, std::int64_t cols, std::int64_t channels,
                     std::uint64_t seed, int noise = 255) {
  Pixels p{rows, cols, channels, {}};
  p.data.resize(static_cast<std::size_t>(rows * cols * channels));
  for (std::size_t i = 0; i < p.data.size(); ++i) {
    const auto word = sk::philox_block(seed, i / 4).v[i % 4];
    const std::int64_t pixel = static_cast<std::int64_t>(i) / channels;
    const int ramp = static_cast<int>((pixel % cols) * 160 / cols + (pixel / cols) * 40 / rows);
    p.data[i] =
        static_cast<std::uint8_t>(std::min(255, ramp + static_cast<int>(word % (noise + 1))));
  }
  return p;
}

std::string error_of(const std::string& path) {
  try {
    sk::data::decode_image_file(path);
  } catch (const sk::IoError& e) {
    return e.what();
  }
  return "";
}

// A PNG made byte by byte (zlib for the data, CRCs): forms that write_png does not make --
// 16-bit samples, a gAMA chunk, a palette, 2-bit grey, interlacing. `samples`: the rows packed,
// without their filter bytes (none is used), each pass's rows in turn when interlaced.
using Chunks = std::vector<std::pair<std::string, std::vector<std::uint8_t>>>;
std::vector<std::uint8_t> png_file(std::uint32_t width, std::uint32_t height, int depth, int type,
                                   const std::vector<std::vector<std::uint8_t>>& rows,
                                   const Chunks& chunks = {}, bool interlaced = false) {
  std::vector<std::uint8_t> out{0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  auto put32 = [](std::vector<std::uint8_t>& v, std::uint32_t x) {
    for (int shift : {24, 16, 8, 0}) v.push_back(static_cast<std::uint8_t>(x >> shift));
  };
  auto chunk = [&](const std::string& kind, const std::vector<std::uint8_t>& data) {
    put32(out, static_cast<std::uint32_t>(data.size()));
    const std::size_t start = out.size();
    out.insert(out.end(), kind.begin(), kind.end());
    out.insert(out.end(), data.begin(), data.end());
    put32(out, static_cast<std::uint32_t>(
                   ::crc32(0, out.data() + start, static_cast<uInt>(out.size() - start))));
  };
  std::vector<std::uint8_t> header;
  put32(header, width);
  put32(header, height);
  header.insert(header.end(), {static_cast<std::uint8_t>(depth), static_cast<std::uint8_t>(type), 0,
                               0, static_cast<std::uint8_t>(interlaced ? 1 : 0)});
  chunk("IHDR", header);
  for (const auto& [kind, data] : chunks) chunk(kind, data);
  std::vector<std::uint8_t> raw;
  for (const auto& row : rows) {
    raw.push_back(0);  // filter: none
    raw.insert(raw.end(), row.begin(), row.end());
  }
  uLongf size = ::compressBound(static_cast<uLong>(raw.size()));
  std::vector<std::uint8_t> packed(size);
  REQUIRE(::compress(packed.data(), &size, raw.data(), static_cast<uLong>(raw.size())) == Z_OK);
  packed.resize(size);
  chunk("IDAT", packed);
  chunk("IEND", {});
  return out;
}

}  // namespace

TEST_CASE("PNG and PGM/PPM decode exactly, grey and RGB, and alpha is dropped") {
  TempFolder dir("exact");
  for (std::int64_t channels : {1, 3}) {
    const Pixels p = random_pixels(13, 17, channels, 7 + std::uint64_t(channels));
    const std::string png = dir / ("a" + std::to_string(channels) + ".png");
    const std::string pnm =
        dir / ("a" + std::to_string(channels) + (channels == 1 ? ".pgm" : ".ppm"));
    image_files::write_png(png, p);
    image_files::write_netpbm(pnm, p);
    for (const auto& path : {png, pnm}) {
      const auto d = sk::data::decode_image_file(path);
      CHECK(d.rows == 13);
      CHECK(d.cols == 17);
      CHECK(d.channels == channels);
      CHECK(d.pixels == p.data);
    }
    // With an alpha channel: the colour values stay, the alpha goes (PIL's convert).
    Pixels with_alpha = random_pixels(9, 11, channels + 1, 99);
    image_files::write_png(dir / "alpha.png", with_alpha);
    const auto d = sk::data::decode_image_file(dir / "alpha.png");
    REQUIRE(d.channels == channels);
    for (std::int64_t px = 0; px < 9 * 11; ++px)
      for (std::int64_t c = 0; c < channels; ++c)
        CHECK(d.pixels[std::size_t(px * channels + c)] ==
              with_alpha.data[std::size_t(px * (channels + 1) + c)]);
  }
  // A PGM with maxval 15 is scaled to 0..255.
  Pixels small{2, 2, 1, {0, 5, 10, 15}};
  image_files::write_netpbm(dir / "m.pgm", small, 15);
  CHECK(sk::data::decode_image_file(dir / "m.pgm").pixels ==
        std::vector<std::uint8_t>{0, 85, 170, 255});
}

// PIL's values (torchvision's loader): 16-bit samples cut to their high byte, no gamma
// correction, palettes expanded (a transparency ignored), low-bit grey scaled to 8 bits. libpng's
// simplified API, read before, took 16-bit samples without a gAMA chunk as linear light (0x8080
// gave 188) and applied a file's gAMA.
TEST_CASE("PNG samples are PIL's: 16 bits cut to their high byte, no gamma, palettes, 2-bit grey") {
  TempFolder dir("png_forms");
  auto decoded = [&](const std::string& name, const std::vector<std::uint8_t>& bytes) {
    image_files::write_bytes(dir / name, bytes);
    return sk::data::decode_image_file(dir / name);
  };
  using Bytes = std::vector<std::uint8_t>;
  const auto wide = decoded(
      "rgb16.png",
      png_file(2, 1, 16, 2, {{0x80, 0x80, 0, 0, 0xFF, 0xFF, 0x12, 0x34, 0xAB, 0xCD, 0x00, 0xFF}}));
  CHECK(wide.channels == 3);
  CHECK(wide.pixels == Bytes{0x80, 0, 0xFF, 0x12, 0xAB, 0});
  const auto wide_alpha =
      decoded("rgba16.png", png_file(1, 1, 16, 6, {{0x10, 0x01, 0x20, 0x02, 0x30, 0x03, 0, 0}}));
  CHECK(wide_alpha.pixels == Bytes{0x10, 0x20, 0x30});
  const Chunks linear_gamma{{"gAMA", {0, 1, 0x86, 0xA0}}};  // 1.0: linear light
  const auto grey = decoded("gamma.png", png_file(3, 1, 8, 0, {{0, 100, 200}}, linear_gamma));
  CHECK(grey.channels == 1);
  CHECK(grey.pixels == Bytes{0, 100, 200});
  const auto rgb = decoded("gamma_rgb.png", png_file(1, 1, 8, 2, {{30, 60, 90}}, linear_gamma));
  CHECK(rgb.pixels == Bytes{30, 60, 90});
  const auto palette =
      decoded("palette.png",
              png_file(3, 1, 8, 3, {{2, 0, 1}},
                       {{"PLTE", {10, 20, 30, 40, 50, 60, 70, 80, 90}}, {"tRNS", {0, 128}}}));
  CHECK(palette.channels == 3);
  CHECK(palette.pixels == Bytes{70, 80, 90, 10, 20, 30, 40, 50, 60});
  const auto low = decoded("grey2.png", png_file(4, 1, 2, 0, {{0x1B}}));  // 0, 1, 2, 3
  CHECK(low.pixels == Bytes{0, 85, 170, 255});
  // Interlaced (Adam7), 2 x 2: pass 1 holds (0, 0), pass 6 (0, 1), pass 7 row 1.
  const auto laced = decoded("laced.png", png_file(2, 2, 8, 0, {{11}, {12}, {21, 22}}, {}, true));
  CHECK(laced.pixels == Bytes{11, 12, 21, 22});
  // A file cut after its image data (no IEND): the pixels are whole, as PIL reads them.
  const auto whole = png_file(3, 1, 8, 0, {{7, 8, 9}});
  CHECK(decoded("no_end.png", {whole.begin(), whole.end() - 12}).pixels == Bytes{7, 8, 9});
  image_files::write_bytes(dir / "grey16.png", png_file(1, 1, 16, 0, {{1, 2}}));
  CHECK(error_of(dir / "grey16.png").find("is a 16-bit grey PNG, which is not read") !=
        std::string::npos);
}

TEST_CASE("JPEG decodes within its compression loss, grey and RGB") {
  TempFolder dir("jpeg");
  for (std::int64_t channels : {1, 3}) {
    const Pixels p = random_pixels(32, 24, channels, 3, /*noise=*/8);
    image_files::write_jpeg(dir / "a.jpg", p, 98);
    const auto d = sk::data::decode_image_file(dir / "a.jpg");
    REQUIRE(d.rows == 32);
    REQUIRE(d.cols == 24);
    REQUIRE(d.channels == channels);
    double err = 0;
    for (std::size_t i = 0; i < p.data.size(); ++i)
      err += std::abs(int(d.pixels[i]) - int(p.data[i]));
    CHECK(err / double(p.data.size()) < 4.0);  // mean absolute error in grey levels
    CHECK(err > 0);                            // and it is a JPEG: lossy
  }
}

// libjpeg's warnings about the metadata or about bytes around the image data leave the
// pixels whole: PIL decodes such files (ImageNet holds some), and so do we. Those that mean
// pixels were lost still refuse (the garbled and cut files below).
TEST_CASE("JPEG warnings that lose no pixel are let pass, with the pixels of the file") {
  TempFolder dir("jpeg_warnings");
  const Pixels rgb = random_pixels(24, 32, 3, 7, /*noise=*/8);
  image_files::write_jpeg(dir / "good.jpg", rgb, 95);
  const auto good = sk::data::decode_image_file(dir / "good.jpg");
  const auto jpg = image_files::read_bytes(dir / "good.jpg");
  REQUIRE(jpg.size() > 20);
  REQUIRE(jpg[jpg.size() - 2] == 0xFF);
  REQUIRE(jpg[jpg.size() - 1] == 0xD9);
  // "Corrupt JPEG data: 5 extraneous bytes before marker 0xd9".
  auto extraneous = jpg;
  extraneous.insert(extraneous.end() - 2, {0x12, 0x34, 0x56, 0x78, 0x9A});
  image_files::write_bytes(dir / "extraneous.jpg", extraneous);
  // "unknown JFIF revision number 0.01": the APP0 segment's major version.
  auto revision = jpg;
  REQUIRE(revision[3] == 0xE0);
  REQUIRE(std::string(revision.begin() + 6, revision.begin() + 10) == "JFIF");
  revision[11] = 0;
  image_files::write_bytes(dir / "revision.jpg", revision);
  // No end marker at all (the data whole): PIL loads it.
  image_files::write_bytes(dir / "no_end.jpg", {jpg.begin(), jpg.end() - 2});
  // Progressive, whole: every scan read.
  image_files::write_jpeg(dir / "progressive.jpg", rgb, 95, false, /*progressive=*/true);
  const auto progressive = image_files::read_bytes(dir / "progressive.jpg");
  CHECK(sk::data::decode_image_file(dir / "progressive.jpg").pixels.size() == good.pixels.size());
  for (const char* name : {"extraneous.jpg", "revision.jpg", "no_end.jpg"}) {
    INFO(name);
    const auto d = sk::data::decode_image_file(dir / name);
    CHECK(d.rows == good.rows);
    CHECK(d.cols == good.cols);
    CHECK(d.pixels == good.pixels);
  }
  // A progressive file cut where a scan ends (its next SOS marker's place) would decode with no
  // warning, its later scans grey: refused as a cut file. Its last scan's start is found from
  // the end (0xFF 0xDA).
  std::size_t last_scan = 0;
  for (std::size_t i = 2; i + 1 < progressive.size(); ++i)
    if (progressive[i] == 0xFF && progressive[i + 1] == 0xDA) last_scan = i;
  REQUIRE(last_scan > 0);
  image_files::write_bytes(dir / "scans_cut.jpg",
                           {progressive.begin(), progressive.begin() + std::ptrdiff_t(last_scan)});
  const std::string cut = error_of(dir / "scans_cut.jpg");
  CHECK(cut.find("is not a readable JPEG: Premature end of JPEG file") != std::string::npos);
}

TEST_CASE("corrupt, truncated and unsupported files are refused by path") {
  TempFolder dir("bad");
  const Pixels rgb = random_pixels(40, 40, 3, 5);
  image_files::write_png(dir / "good.png", rgb);
  image_files::write_jpeg(dir / "good.jpg", rgb);
  const auto png = image_files::read_bytes(dir / "good.png");
  const auto jpg = image_files::read_bytes(dir / "good.jpg");

  auto refused = [&](const std::string& name, const std::vector<std::uint8_t>& bytes,
                     const std::string& says) {
    const std::string path = dir / name;
    image_files::write_bytes(path, bytes);
    const std::string message = error_of(path);
    INFO(name, ": ", message);
    CHECK(message.find(path) != std::string::npos);
    CHECK(message.find(says) != std::string::npos);
  };
  refused("cut.png", {png.begin(), png.begin() + std::ptrdiff_t(png.size() / 2)}, "PNG");
  refused("cut.jpg", {jpg.begin(), jpg.begin() + std::ptrdiff_t(jpg.size() / 2)}, "JPEG");
  auto flipped = png;
  flipped[png.size() / 2] ^= 0x5A;  // the data's CRC no longer matches
  refused("crc.png", flipped, "PNG");
  auto garbled = jpg;
  for (std::size_t i = jpg.size() / 3; i < jpg.size() / 3 + 64; ++i) garbled[i] = 0xFF;
  refused("garbled.jpg", garbled, "JPEG");
  refused("header_only.jpg", {0xFF, 0xD8, 0xFF}, "JPEG");
  refused("empty.png", {}, "empty");
  refused("text.jpg", {'h', 'e', 'l', 'l', 'o'}, "neither JPEG, PNG");
  refused("image.bmp", {'B', 'M', 0, 0, 0, 0}, "BMP, TIFF and WebP are not read");
  refused("huge.pgm",
          {'P', '5', ' ', '9', '9', '9', '9', '9', ' ', '9', '9', '9', '9', '9', ' ', '2', '5', '5',
           '\n'},
          "decompression bomb");
  // A header that claims far more pixels than the file could hold is refused before allocating
  // (IHDR's CRC made again, so that libpng reads the header and our check is what refuses).
  // 10 000 x 10 000: under PIL's bomb limit and libpng's million a side, far above what a 40 x 40
  // file's bytes can encode.
  auto claims_huge = png;
  for (int i : {16, 20}) {
    claims_huge[std::size_t(i + 2)] = 0x27;
    claims_huge[std::size_t(i + 3)] = 0x10;
  }
  const auto ihdr_crc = ::crc32(0, claims_huge.data() + 12, 17);  // chunk type and data
  for (int k = 0; k < 4; ++k)
    claims_huge[std::size_t(29 + k)] = static_cast<std::uint8_t>(ihdr_crc >> (24 - 8 * k));
  refused("claims.png", claims_huge, "more than the format can compress");
  refused("wide.pgm", {'P', '5', ' ', '2', ' ', '2', ' ', '6', '5', '5', '3', '5', '\n'}, "16-bit");
  refused("short.ppm", {'P', '6', ' ', '4', ' ', '4', ' ', '2', '5', '5', '\n', 1, 2, 3},
          "truncated");
}

// A CMYK JPEG (ImageNet's training set has 22) read as PIL's convert("RGB") reads it: PIL takes
// a four-component JPEG's samples as Adobe's inverted CMYK and makes r = k' - c'k'/255 of them
// (k' = 255 - k). A flat patch, whose samples come back as written within the DCT's rounding:
// c, m, y, k = 200, 100, 50, 200 give 157, 78, 39. (Refused before, naming a conversion.)
TEST_CASE("a CMYK JPEG is converted to RGB as PIL converts it") {
  TempFolder dir("cmyk");
  Pixels flat = random_pixels(16, 16, 3, 1);
  for (std::size_t i = 0; i < flat.data.size(); i += 3) {
    flat.data[i] = 200;  // c, and k (write_jpeg repeats channel 0 as the fourth)
    flat.data[i + 1] = 100;
    flat.data[i + 2] = 50;
  }
  image_files::write_jpeg(dir / "cmyk.jpg", flat, 100, /*cmyk=*/true);
  const auto d = sk::data::decode_image_file(dir / "cmyk.jpg");
  REQUIRE(d.channels == 3);
  REQUIRE(d.pixels.size() == 16 * 16 * 3);
  const int expected[3] = {157, 78, 39};
  for (std::size_t i = 0; i < d.pixels.size(); ++i)
    CHECK(std::abs(int(d.pixels[i]) - expected[i % 3]) <= 2);
}

TEST_CASE("an image folder: classes sorted, files sorted per class, grey stays grey") {
  TempFolder dir("folder");
  // Written out of order, in nested folders, with an upper-case extension and a stray file.
  image_files::write_png(dir / "zebra/b.png", random_pixels(8, 8, 1, 1));
  image_files::write_png(dir / "zebra/a.PNG", random_pixels(8, 8, 1, 2));
  image_files::write_png(dir / "apple/deep/x.png", random_pixels(8, 8, 1, 3));
  image_files::write_netpbm(dir / "apple/c.pgm", random_pixels(8, 8, 1, 4));
  // ImageFolder's order within a class: the class folder's own files, then each subfolder's
  // (os.walk's folders sorted), whatever the whole paths' order ("apple/a_sub/y.png" sorts
  // before "apple/c.pgm" as a path).
  image_files::write_png(dir / "apple/a_sub/y.png", random_pixels(8, 8, 1, 5));
  image_files::write_bytes(dir / "apple/notes.txt", {'h', 'i'});
  image_files::write_bytes(dir / "README", {'h', 'i'});
  const auto index = sk::data::index_image_folder(dir.path.string());
  CHECK(index.classes == std::vector<std::string>{"apple", "zebra"});
  REQUIRE(index.paths.size() == 5);
  CHECK(fs::path(index.paths[0]).filename() == "c.pgm");
  CHECK(fs::path(index.paths[1]).filename() == "y.png");  // apple/a_sub
  CHECK(fs::path(index.paths[2]).filename() == "x.png");  // apple/deep
  CHECK(fs::path(index.paths[3]).filename() == "a.PNG");
  CHECK(index.labels == std::vector<std::int32_t>{0, 0, 0, 1, 1});

  const auto d = sk::data::load_image_folder(index, 3);
  CHECK(d.count == 5);
  CHECK(d.channels == 1);
  CHECK(d.uniform());
  CHECK(d.rows == 8);
  CHECK(std::vector<std::uint8_t>(d.image(3).pixels, d.image(3).pixels + 64) ==
        random_pixels(8, 8, 1, 2).data);

  // One colour image of another size: the dataset becomes RGB (grey repeated) and per-image.
  image_files::write_png(dir / "zebra/c.png", random_pixels(5, 7, 3, 9));
  const auto mixed = sk::data::load_image_folder(dir.path.string(), 2);
  CHECK(mixed.channels == 3);
  CHECK(!mixed.uniform());
  const auto grey = random_pixels(8, 8, 1, 4).data;
  const auto first = mixed.image(0);
  CHECK(first.rows == 8);
  for (int p = 0; p < 64; ++p)
    for (int c = 0; c < 3; ++c) CHECK(first.pixels[p * 3 + c] == grey[std::size_t(p)]);
  const auto last = mixed.image(5);
  CHECK(last.rows == 5);
  CHECK(last.cols == 7);
  CHECK(std::vector<std::uint8_t>(last.pixels, last.pixels + last.bytes()) ==
        random_pixels(5, 7, 3, 9).data);
  const auto two = sk::data::first_images(mixed, 2);
  CHECK(two.count == 2);
  CHECK(two.pixels.size() == 2 * 64 * 3);

  // A broken file stops the load, named.
  image_files::write_bytes(dir / "apple/broken.png",
                           {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n', 0});
  try {
    sk::data::load_image_folder(dir.path.string(), 2);
    FAIL("a broken file was accepted");
  } catch (const sk::IoError& e) {
    CHECK(std::string(e.what()).find("broken.png") != std::string::npos);
  }
}

TEST_CASE("an image folder of more classes than a byte counts; a memory budget, judged early") {
  TempFolder dir("classes");
  // ImageNet has 1000 classes: labels are not bytes. 300 classes of one 4 x 4 grey image each
  // (16 bytes decoded), and a last class holding a file that does not decode.
  char name[16];
  for (int c = 0; c < 300; ++c) {
    std::snprintf(name, sizeof name, "c%03d/0.pgm", c);
    image_files::write_netpbm(dir / name, random_pixels(4, 4, 1, std::uint64_t(c) + 1));
  }
  image_files::write_bytes(dir / "zzz/broken.png",
                           {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n', 0});
  auto index = sk::data::index_image_folder(dir.path.string());
  REQUIRE(index.classes.size() == 301);
  CHECK(index.labels[299] == 299);
  CHECK(index.labels[300] == 300);
  CHECK(index.root == dir.path.string());

  // 301 grey images of 16 bytes take twice that while they are packed (9632 bytes). Read on one
  // thread (in order), a budget of 9000 bytes is refused once the first 256 are decoded (their
  // 8192 bytes would fit), before the broken file is reached, with the number that would fit
  // (9000 / 32); a budget of 5000 already by what the first 157 hold.
  const auto refusal = [&](std::int64_t budget) {
    try {
      (void)sk::data::load_image_folder(index, 1, budget);
      FAIL("a folder over its memory budget was read");
    } catch (const sk::data::ImageFolderTooLarge& e) {
      return std::make_pair(std::string(e.what()), e.images_that_fit);
    }
    return std::make_pair(std::string(), std::int64_t{0});
  };
  const std::string start = "image folder '" + dir.path.string() +
                            "': its 301 images would take about 0.00 GB decoded and packed (0.0 "
                            "kB an image, measured over the first ";
  const auto [by_average, fit] = refusal(9000);
  CHECK(by_average.find(start + "256), more than the 0.00 GB") == 0);
  CHECK(by_average.find("about 281 of them would fit") != std::string::npos);
  CHECK(fit == 281);
  const auto [by_held, fit_held] = refusal(5000);
  CHECK(by_held.find(start + "157), more than") == 0);
  CHECK(fit_held == 156);
  // Without the broken file, and within the budget: every label.
  index.paths.pop_back();
  index.labels.pop_back();
  index.classes.pop_back();
  const auto d = sk::data::load_image_folder(index, 2, 2 * 300 * 16);
  CHECK(d.count == 300);
  CHECK(d.num_classes() == 300);
  CHECK(d.labels[299] == 299);
  CHECK(std::vector<std::uint8_t>(d.image(299).pixels, d.image(299).pixels + 16) ==
        random_pixels(4, 4, 1, 300).data);
  CHECK_THROWS_AS(sk::data::load_image_folder(index, 2, 2 * 300 * 16 - 1),
                  sk::data::ImageFolderTooLarge);

  // Grey images packed among RGB ones take three times their bytes, which the decoded sizes
  // alone do not show (two grey 16-byte images and one RGB 48-byte one: 80 bytes decoded, 144
  // packed): 223 bytes are refused, with the two images that would fit (74.7 bytes each).
  TempFolder mixed("mixed_budget");
  image_files::write_netpbm(mixed / "a/0.pgm", random_pixels(4, 4, 1, 1));
  image_files::write_netpbm(mixed / "a/1.pgm", random_pixels(4, 4, 1, 2));
  image_files::write_netpbm(mixed / "b/0.ppm", random_pixels(4, 4, 3, 3));
  const auto three = sk::data::index_image_folder(mixed.path.string());
  CHECK(sk::data::load_image_folder(three, 1, 80 + 144).channels == 3);
  try {
    (void)sk::data::load_image_folder(three, 1, 80 + 143);
    FAIL("a mixed folder over its budget was read");
  } catch (const sk::data::ImageFolderTooLarge& e) {
    CHECK(std::string(e.what()).find("measured over all 3") != std::string::npos);
    CHECK(e.images_that_fit == 2);
  }
  // Nothing fits: said so. No images (a limit of 0): an empty dataset, not a read past the end.
  CHECK_THROWS_WITH_AS(sk::data::load_image_folder(three, 1, 10),
                       doctest::Contains("not even one of them fits"),
                       sk::data::ImageFolderTooLarge);
  const auto none = sk::data::load_image_folder(
      sk::data::ImageFolderIndex{three.classes, {}, {}, three.root}, 2, 0);
  CHECK(none.count == 0);
  CHECK(none.num_classes() == 2);
}

TEST_CASE("image folder layouts that cannot be read are refused with the fix") {
  TempFolder dir("layout");
  auto message = [](const std::string& root) {
    try {
      sk::data::index_image_folder(root);
    } catch (const sk::IoError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(message((dir.path / "missing").string()).find("is not a folder") != std::string::npos);
  image_files::write_png(dir / "flat.png", random_pixels(4, 4, 1, 1));
  CHECK(message(dir.path.string()).find("no class subfolders") != std::string::npos);
  fs::create_directories(dir.path / "empty_class");
  CHECK(message(dir.path.string()).find("no image files") != std::string::npos);
  // A class folder with no images among others (a class missing from this split, a hidden
  // .ipynb_checkpoints): its label would shift every later class's, as torchvision refuses.
  fs::create_directories(dir.path / "a_class");
  image_files::write_png(dir / "a_class/0.png", random_pixels(4, 4, 1, 2));
  fs::create_directories(dir.path / ".ipynb_checkpoints");
  CHECK(message(dir.path.string())
            .find("has class subfolders with no image files: '.ipynb_checkpoints', "
                  "'empty_class'") != std::string::npos);
}

TEST_CASE("synthetic images: deterministic, labelled i % classes, channels as asked") {
  const auto a = sk::data::make_synthetic_images(
      {.count = 30, .side = 12, .channels = 3, .classes = 4, .seed = 5});
  const auto b = sk::data::make_synthetic_images(
      {.count = 40, .side = 12, .channels = 3, .classes = 4, .seed = 5});
  CHECK(a.pixels_per_image() == 12 * 12 * 3);
  CHECK(std::equal(a.pixels.begin(), a.pixels.end(), b.pixels.begin()));  // a prefix of b
  for (std::int64_t i = 0; i < 30; ++i) CHECK(a.labels[std::size_t(i)] == i % 4);
  CHECK(a.num_classes() == 4);
  const auto other = sk::data::make_synthetic_images(
      {.count = 30, .side = 12, .channels = 3, .classes = 4, .seed = 6});
  CHECK(other.pixels != a.pixels);
  const auto grey = sk::data::make_synthetic_images(
      {.count = 3, .side = 8, .channels = 1, .classes = 0, .seed = 1});
  CHECK(grey.pixels_per_image() == 64);
  CHECK(grey.labels == std::vector<std::int32_t>{0, 0, 0});
  CHECK_THROWS_AS(sk::data::make_synthetic_images({.count = 3, .side = 8, .channels = 2}),
                  sk::InvalidArgument);
}
