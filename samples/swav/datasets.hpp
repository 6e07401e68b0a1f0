// The SwAV trainer's images: each split from its source (DATA.TRAIN / DATA.TEST: Fashion-MNIST's
// IDX files, a folder of class subfolders of image files, or generated images), and the kNN
// memory bank's size (docs/swav.md, "Data sources").
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/data/fashion_mnist.hpp"
#include "shardkit/data/synthetic_images.hpp"
#if SHARDKIT_WITH_IMAGES
#include "shardkit/data/image_folder.hpp"
#endif
#include "swav_config.hpp"

namespace swav {

// The data every rank reads (shared by the local ranks of one process).
struct Datasets {
  sk::data::ImageDataset train, test;
  std::int64_t bank_size = 0;  // the kNN memory bank: the first bank_size training images
  std::string description;     // what the images are, for the run's first line
};

// One split's images from its source (docs/swav.md, "Data sources").
inline sk::data::ImageDataset load_split(const DataSource& source, const char* split,
                                         [[maybe_unused]] const std::string& key,
                                         std::uint64_t seed) {
  if (source.kind == "fashion_mnist")
    return first_images(sk::data::load_fashion_mnist(split, source.path), source.limit);
  if (source.kind == "synthetic")
    return sk::data::make_synthetic_images({.count = source.limit,
                                            .side = source.synthetic_side,
                                            .channels = 3,
                                            .classes = source.synthetic_classes,
                                            .seed = seed});
#if SHARDKIT_WITH_IMAGES
  // ImageFolder's order is class by class; the files are taken in a fixed shuffled order so
  // that DATA_LIMIT and the kNN memory bank (the first images) are random subsets of every
  // class, as VISSL's DATA_LIMIT samples one.
  auto index = sk::data::index_image_folder(source.path);
  std::vector<std::size_t> order(index.paths.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::mt19937_64 shuffle(source.sampling_seed);
  std::shuffle(order.begin(), order.end(), shuffle);
  if (source.limit >= 0 && static_cast<std::size_t>(source.limit) < order.size())
    order.resize(static_cast<std::size_t>(source.limit));
  sk::data::ImageFolderIndex picked{index.classes, {}, {}};
  for (std::size_t i : order) {
    picked.paths.push_back(index.paths[i]);
    picked.labels.push_back(index.labels[i]);
  }
  return sk::data::load_image_folder(
      picked, static_cast<int>(std::max(2u, std::thread::hardware_concurrency())));
#else
  (void)seed;
  sk::fail<sk::NotAvailable>(key,
                             ".DATA_SOURCES = [disk_folder]: this build has no image "
                             "decoders; install libjpeg-dev and libpng-dev (scripts/setup does) "
                             "and rebuild");
#endif
}

inline Datasets load_datasets(SwavConfig& c) {
  Datasets d;
  d.train = load_split(c.train_data, "train", "DATA.TRAIN", c.seed);
  // The synthetic test images are other images than the training ones (another seed).
  d.test = load_split(c.test_data, "t10k", "DATA.TEST", c.seed + 0x5EED);
  sk::check(d.train.channels == d.test.channels, "DATA.TRAIN's images have ", d.train.channels,
            " channels and DATA.TEST's ", d.test.channels, "; the network reads one kind");
  sk::check(static_cast<std::int64_t>(c.crops.mean.size()) == d.train.channels,
            "DATA.TRAIN.TRANSFORMS' Normalize has ", c.crops.mean.size(),
            " mean/std entries but the images have ", d.train.channels,
            " channels; give one per channel (grey: Fashion-MNIST's [0.2860], [0.3530]; RGB: "
            "ImageNet's [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])");
  sk::check(c.eval_images.mean.empty() ||
                static_cast<std::int64_t>(c.eval_images.mean.size()) == d.test.channels,
            "DATA.TEST.TRANSFORMS' Normalize has ", c.eval_images.mean.size(),
            " mean/std entries but the images have ", d.test.channels,
            " channels; give one per channel");
  sk::check(d.train.count >= 1 && d.test.count >= 1, "no images to train on or to test with");
  c.in_channels = d.train.channels;
  d.bank_size =
      c.memory_bank_limit < 0 ? d.train.count : std::min(c.memory_bank_limit, d.train.count);
  auto describe = [](const DataSource& s, const sk::data::ImageDataset& images) {
    const std::string kind = s.kind == "fashion_mnist" ? "Fashion-MNIST"
                             : s.kind == "synthetic"   ? "synthetic images"
                                                       : "images of " + s.path;
    const std::string size = images.uniform()
                                 ? std::to_string(images.cols) + "x" + std::to_string(images.rows)
                                 : "sizes vary";
    return kind + " (" + std::to_string(images.count) + ", " +
           (images.channels == 1 ? "grey" : "RGB") + ", " + size + ", " +
           std::to_string(images.num_classes()) + " classes)";
  };
  d.description = describe(c.train_data, d.train) + "; tested on " + describe(c.test_data, d.test);
  return d;
}

}  // namespace swav
