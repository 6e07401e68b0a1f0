// Fashion-MNIST from Debian's dataset-fashion-mnist package (gzip IDX files).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "shardkit/data/idx_file.hpp"
#include "shardkit/data/image_dataset.hpp"

namespace shardkit::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

inline constexpr const char* kFashionMnistClasses[10] = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

// A split's two files in `dir`: images, then labels. split: "train" (60 000 images) or "t10k"
// (10 000). Missing files get an error that says how to install them.
struct FashionMnistFiles {
  std::string images, labels;
};
inline FashionMnistFiles fashion_mnist_files(const std::string& split,
                                             const std::string& dir = kFashionMnistDir) {
  check(split == "train" || split == "t10k", "Fashion-MNIST split must be 'train' or 't10k', got '",
        split, "'");
  FashionMnistFiles files{dir + "/" + split + "-images-idx3-ubyte.gz",
                          dir + "/" + split + "-labels-idx1-ubyte.gz"};
  for (const auto& path : {files.images, files.labels})
    check<IoError>(std::filesystem::exists(path), "Fashion-MNIST file '", path,
                   "' is missing; install it with: apt-get install dataset-fashion-mnist "
                   "(or pass the folder that holds the .gz files)");
  return files;
}

inline ImageDataset load_fashion_mnist(const std::string& split,
                                       const std::string& dir = kFashionMnistDir) {
  const auto [images_path, labels_path] = fashion_mnist_files(split, dir);
  IdxArray images = read_idx(images_path);
  IdxArray labels = read_idx(labels_path);
  check<IoError>(images.dims.size() == 3, "'", images_path,
                 "' should hold [count, rows, cols] images, has ", images.dims.size(),
                 " dimensions");
  check<IoError>(images.dims[1] >= 1 && images.dims[2] >= 1, "'", images_path, "' holds images of ",
                 images.dims[1], " x ", images.dims[2],
                 " pixels; an image needs at least one row and one column");
  check<IoError>(labels.dims.size() == 1 && labels.dims[0] == images.dims[0], "'", labels_path,
                 "' has ", labels.dims.empty() ? 0 : labels.dims[0], " labels for ", images.dims[0],
                 " images");
  for (auto label : labels.data)
    check<IoError>(label < 10, "'", labels_path, "' holds label ", int{label}, "; expected 0..9");
  ImageDataset dataset;
  dataset.count = images.dims[0];
  dataset.rows = images.dims[1];
  dataset.cols = images.dims[2];
  dataset.pixels = std::move(images.data);
  dataset.labels.assign(labels.data.begin(), labels.data.end());
  dataset.classes.assign(std::begin(kFashionMnistClasses), std::end(kFashionMnistClasses));
  return dataset;
}

}  // namespace shardkit::data
