// The SwAV trainer's images: each split from its source (DATA.TRAIN / DATA.TEST: Fashion-MNIST's
// IDX files, a folder of class subfolders of image files, or generated images) within the
// memory the machine has (host_memory.hpp), the kNN memory bank's size and the raw-pixel kNN's
// features (docs/swav.md, "Data sources").
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/data/fashion_mnist.hpp"
#include "shardkit/data/synthetic_images.hpp"
#if SHARDKIT_WITH_IMAGES
#include "shardkit/data/image_folder.hpp"
#endif
#include "host_memory.hpp"
#include "swav_config.hpp"

namespace swav {

// The raw-pixel kNN's memory bank as floats, made once per process: the first of its ranks (as
// threads) to evaluate makes it, the others take the same, and it goes when the last lets go
// (trainer.hpp's evaluate holds it only while it counts).
struct SharedRawBank {
  std::mutex mutex;
  std::weak_ptr<const std::vector<float>> values;

  template <class Make>
  std::shared_ptr<const std::vector<float>> get(Make&& make) {
    std::lock_guard lock(mutex);
    auto held = values.lock();
    if (!held) {
      held = std::make_shared<const std::vector<float>>(make());
      values = held;
    }
    return held;
  }
};

// The data every rank reads (shared by the local ranks of one process).
struct Datasets {
  sk::data::ImageDataset train, test;
  std::int64_t bank_size = 0;  // the kNN memory bank: the first bank_size training images
  std::string description;     // what the images are, for the run's first line
  std::shared_ptr<SharedRawBank> raw_bank = std::make_shared<SharedRawBank>();
};

// How many of the test images each of `world` ranks queries in a kNN evaluation at most: rank
// r takes [min(r * share, count), min((r + 1) * share, count)), so the last ranks' shares may be
// short or empty (5 images on 4 ranks: 2, 2, 1, 0).
inline std::int64_t query_share(std::int64_t count, int world) {
  return (count + world - 1) / world;
}
// Rank `rank`'s images [first, last) of `count` split so over `world` ranks (the kNN's queries,
// and the memory bank's features that each rank keeps).
inline std::pair<std::int64_t, std::int64_t> share_range(std::int64_t count, int world, int rank) {
  const std::int64_t share = query_share(count, world);
  const std::int64_t first = std::min(count, rank * share);
  return {first, std::min(count, first + share)};
}

// Fashion-MNIST's file set of a split (`key`: DATA.TRAIN or DATA.TEST).
inline const char* fashion_mnist_split(const std::string& key) {
  return key == "DATA.TRAIN" ? "train" : "t10k";
}

// The synthetic source's images are RGB.
inline constexpr std::int64_t kSyntheticChannels = 3;

// What load_split will meet, found without reading the images (read_swav_config's
// Machine::probe_data): Fashion-MNIST's files are there, an image folder indexes (its class
// subfolders hold image files), this build decodes images. Returns the images' channels where
// the source fixes them -- Fashion-MNIST's 1, the synthetic source's 3 -- and 0 for an image
// folder's, which its images tell once decoded (load_datasets checks them then).
inline std::int64_t probe_split(const DataSource& source, const std::string& key) {
  if (source.kind == "synthetic") return kSyntheticChannels;
#if !SHARDKIT_WITH_IMAGES
  if (source.kind == "disk_folder")
    throw ConfigError("config." + key +
                      ".DATA_SOURCES = [disk_folder]: this build has no image decoders; install "
                      "libjpeg-dev and libpng-dev (scripts/setup does) and rebuild");
#endif
  const auto at_paths = [&](const std::exception& e) {
    return ConfigError("config." + key + ".DATA_PATHS = [" + source.path + "]: " + e.what());
  };
  try {
    if (source.kind == "fashion_mnist") {
      (void)sk::data::fashion_mnist_files(fashion_mnist_split(key), source.path);
      return 1;
    }
#if SHARDKIT_WITH_IMAGES
    (void)sk::data::index_image_folder(source.path);
#endif
    return 0;
  } catch (const sk::IoError& e) {
    throw at_paths(e);
  } catch (const std::filesystem::filesystem_error& e) {  // a folder it may not read, ...
    throw at_paths(e);
  }
}

// The raw-pixel kNN's features of an image (raw_pixel_dim values): its stored pixels when every
// image of both splits has one size, else the image resized to the large crops' side.
inline bool raw_pixels_as_stored(const Datasets& d) {
  return d.train.uniform() && d.test.uniform() && d.train.rows == d.test.rows &&
         d.train.cols == d.test.cols;
}
inline std::int64_t raw_pixel_dim(const Datasets& d, std::int64_t crop_side) {
  return raw_pixels_as_stored(d) ? d.train.pixels_per_image()
                                 : d.train.channels * crop_side * crop_side;
}

// One split's images from its source (docs/swav.md, "Data sources"). An image folder that would
// not fit in `memory_budget` bytes (-1: no limit) is refused with the DATA_LIMIT that would.
inline sk::data::ImageDataset load_split(const DataSource& source, const std::string& key,
                                         std::uint64_t seed, std::int64_t memory_budget = -1) {
  if (source.kind == "fashion_mnist")
    return first_images(sk::data::load_fashion_mnist(fashion_mnist_split(key), source.path),
                        source.limit);
  if (source.kind == "synthetic")
    return sk::data::make_synthetic_images({.count = source.limit,
                                            .side = source.synthetic_side,
                                            .channels = kSyntheticChannels,
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
  sk::data::ImageFolderIndex picked{index.classes, {}, {}, index.root};
  for (std::size_t i : order) {
    picked.paths.push_back(index.paths[i]);
    picked.labels.push_back(index.labels[i]);
  }
  try {
    return sk::data::load_image_folder(
        picked, static_cast<int>(std::max(2u, std::thread::hardware_concurrency())), memory_budget);
  } catch (const sk::data::ImageFolderTooLarge& e) {
    throw ConfigError(
        "config." + key + ".DATA_LIMIT = " + std::to_string(source.limit) + ": " + e.what() + "; " +
        (e.images_that_fit < 1 ? std::string("use a machine with more memory")
                               : "set DATA_LIMIT to at most " + std::to_string(e.images_that_fit) +
                                     " (a random subset of every class), or use a machine with "
                                     "more memory"));
  }
#else
  (void)seed;
  (void)probe_split(source, key);  // refuses it: this build has no image decoders
  return {};
#endif
}

// Both splits' images (DATA.TRAIN's alone under TEST_MODEL: False), every problem with them
// reported together (each split's files, the channels against each other and the Normalize
// steps) -- after read_swav_config's probe, what only the decoded images tell.
// `local_processes`: the processes launched side by side on this machine (data_memory_budget).
inline Datasets load_datasets(SwavConfig& c, int local_processes = 1) {
  Datasets d;
  ConfigProblems problems;
  const bool train_ok = problems.attempt([&] {
    d.train = load_split(c.train_data, "DATA.TRAIN", c.seed, data_memory_budget(local_processes));
  });
  // The synthetic test images are other images than the training ones (another seed).
  const bool test_ok = c.test_model && problems.attempt([&] {
    d.test =
        load_split(c.test_data, "DATA.TEST", c.seed + 0x5EED, data_memory_budget(local_processes));
  });
  detail::check_channels(problems, train_ok ? d.train.channels : 0, test_ok ? d.test.channels : 0,
                         &c.crops, &c.eval_images);
  problems.attempt([&] {
    if ((train_ok && d.train.count < 1) || (test_ok && d.test.count < 1))
      throw ConfigError("no images to train on or to test with");
  });
  // kNN compares the bank's labels with the test images': a label is a class's place in its
  // split's list, so a folder's split must name the same classes in the same order (a class
  // missing from the test folder shifted every later label, and the accuracy meant nothing).
  problems.attempt([&] {
    const bool folder = c.train_data.kind == "disk_folder" || c.test_data.kind == "disk_folder";
    if (!train_ok || !test_ok || !folder || d.train.classes.empty() || d.test.classes.empty() ||
        d.train.classes == d.test.classes)
      return;
    std::size_t at = 0;
    while (at < d.train.classes.size() && at < d.test.classes.size() &&
           d.train.classes[at] == d.test.classes[at])
      ++at;
    auto name = [&](const std::vector<std::string>& classes) {
      return at < classes.size() ? "'" + classes[at] + "'" : std::string("none");
    };
    throw ConfigError("the splits' classes differ: DATA.TRAIN has " +
                      std::to_string(d.train.classes.size()) + ", DATA.TEST " +
                      std::to_string(d.test.classes.size()) + ", and their class " +
                      std::to_string(at + 1) + " is " + name(d.train.classes) + " in DATA.TRAIN, " +
                      name(d.test.classes) +
                      " in DATA.TEST; give the test folder a subfolder for each training class, "
                      "named alike (kNN compares the labels, which are the classes' places)");
  });
  problems.check();
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
  d.description = describe(c.train_data, d.train) +
                  (c.test_model ? "; tested on " + describe(c.test_data, d.test)
                                : "; not tested (TEST_MODEL: False, no kNN evaluation)");
  return d;
}

}  // namespace swav
