// Writes the first COUNT images of a Fashion-MNIST split as an image folder (torchvision's
// ImageFolder layout: OUT/<class>/<index>.<ext>), for the tests that read the same images from
// files (tests/swav/check_image_folder.py).
//   write_image_folder FASHION_MNIST_DIR train|t10k COUNT OUT png|jpg|rgb-png
// rgb-png writes each grey image as an RGB PNG (the grey value in all three channels).
#include <cstdio>
#include <filesystem>
#include <string>

#include "image_files.hpp"
#include "shardkit/data/fashion_mnist.hpp"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s FASHION_MNIST_DIR train|t10k COUNT OUT png|jpg|rgb-png\n",
                 argv[0]);
    return 2;
  }
  try {
    const auto data = shardkit::data::load_fashion_mnist(argv[2], argv[1]);
    const std::int64_t count = std::min<std::int64_t>(std::stoll(argv[3]), data.count);
    const std::string out = argv[4], format = argv[5];
    for (std::int64_t i = 0; i < count; ++i) {
      const auto image = data.image(i);
      image_files::Pixels p{
          image.rows, image.cols, 1, {image.pixels, image.pixels + image.bytes()}};
      // Class folders named by label number, so that their sorted order is the label order.
      const auto folder = std::filesystem::path(out) /
                          ("class" + std::to_string(data.labels[static_cast<std::size_t>(i)]));
      std::filesystem::create_directories(folder);
      char name[32];
      std::snprintf(name, sizeof name, "%06lld", static_cast<long long>(i));
      if (format == "jpg") {
        image_files::write_jpeg((folder / (std::string(name) + ".jpg")).string(), p, 95);
      } else {
        if (format == "rgb-png") {
          image_files::Pixels rgb{p.rows, p.cols, 3, {}};
          for (auto v : p.data) rgb.data.insert(rgb.data.end(), {v, v, v});
          p = rgb;
        }
        image_files::write_png((folder / (std::string(name) + ".png")).string(), p);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "write_image_folder: %s\n", e.what());
    return 1;
  }
}
