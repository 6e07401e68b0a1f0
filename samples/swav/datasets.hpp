// The SwAV trainer's images: each split from its source (DATA.TRAIN / DATA.TEST: Fashion-MNIST's
// IDX files, a folder of class subfolders of image files, or generated images), and the kNN
// memory bank's size (docs/swav.md, "Data sources").
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
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

// The host memory this process may still take, in bytes: what the kernel says is available
// (/proc/meminfo's MemAvailable), or what the process's memory cgroups leave where that is less
// (a container's limit -- cgroup v2's memory.max, v1's memory.limit_in_bytes -- less what the
// group holds that it could not drop, its inactive file pages aside); -1 where nothing says.
// The process's group and each group above it are read (a limit may sit on a parent: a slice,
// a pod), and where the group's own folder is not there -- a container that sees its own group
// at the hierarchy's mount point, under its host-side name -- the mount point's.
inline std::int64_t available_host_memory() {
  const auto number = [](const std::string& text) -> std::int64_t {
    errno = 0;
    char* end = nullptr;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    return !text.empty() && end != nullptr && *end == '\0' && errno == 0 && value >= 0 ? value : -1;
  };
  std::int64_t available = -1;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key, value;
    while (meminfo >> key >> value) {
      if (key == "MemAvailable:" && number(value) >= 0) {
        available = number(value) * 1024;
        break;
      }
      meminfo.ignore(256, '\n');
    }
  }
  // What one group leaves: its limit, less its usage, plus its inactive file pages; -1 where
  // it has no limit (v2's "max", v1's page-rounded 2^63 - 1) or its files are not there.
  const auto group_left = [&](const std::string& folder, const char* limit_file,
                              const char* usage_file, const char* inactive_key) -> std::int64_t {
    std::ifstream limit_in(folder + limit_file), usage_in(folder + usage_file),
        stat(folder + "/memory.stat");
    std::string limit_text, usage_text;
    if (!(limit_in >> limit_text) || !(usage_in >> usage_text)) return -1;
    const std::int64_t limit = number(limit_text), usage = number(usage_text);
    if (limit < 0 || usage < 0 || limit >= (std::int64_t{1} << 62)) return -1;
    std::int64_t inactive = 0;
    std::string key, value;
    while (stat >> key >> value)
      if (key == inactive_key) inactive = std::max<std::int64_t>(0, number(value));
    return std::max<std::int64_t>(0, limit - usage + inactive);
  };
  const auto take = [&](std::int64_t left) {
    if (left >= 0) available = available < 0 ? left : std::min(available, left);
  };
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    // "0::/path" (v2's one hierarchy) or "N:controllers:/path" (v1), one of them "memory".
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const bool v2 = controllers.empty();
    if (!v2 && ("," + controllers + ",").find(",memory,") == std::string::npos) continue;
    const std::string mount = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char* limit_file = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const char* usage_file = v2 ? "/memory.current" : "/memory.usage_in_bytes";
    const char* inactive_key = v2 ? "inactive_file" : "total_inactive_file";
    bool own_found = false;
    for (std::string path = line.substr(second + 1); !path.empty() && path != "/";
         path = path.substr(0, path.rfind('/'))) {
      own_found = own_found || std::filesystem::exists(mount + path);
      take(group_left(mount + path, limit_file, usage_file, inactive_key));
    }
    if (!own_found) take(group_left(mount, limit_file, usage_file, inactive_key));
  }
  return available;
}

// What the data of a run may take in memory: four fifths of what is available (the rest for
// the run itself); -1 (no limit) where nothing says. The process's ranks share one copy of the
// data; processes launched side by side (mpirun) each read their own and each see the same
// figure.
inline std::int64_t data_memory_budget() {
  const std::int64_t available = available_host_memory();
  return available < 0 ? -1 : available / 5 * 4;
}

// The raw-pixel kNN's features of an image: its stored pixels when every image of both splits
// has one size, else the image resized to the large crops' side (`crop_side`).
inline bool raw_pixels_as_stored(const Datasets& d) {
  return d.train.uniform() && d.test.uniform() && d.train.rows == d.test.rows &&
         d.train.cols == d.test.cols;
}
inline std::int64_t raw_pixel_features(const Datasets& d, std::int64_t crop_side) {
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
inline Datasets load_datasets(SwavConfig& c) {
  Datasets d;
  ConfigProblems problems;
  const bool train_ok = problems.attempt(
      [&] { d.train = load_split(c.train_data, "DATA.TRAIN", c.seed, data_memory_budget()); });
  // The synthetic test images are other images than the training ones (another seed).
  const bool test_ok = c.test_model && problems.attempt([&] {
    d.test = load_split(c.test_data, "DATA.TEST", c.seed + 0x5EED, data_memory_budget());
  });
  detail::check_channels(problems, train_ok ? d.train.channels : 0, test_ok ? d.test.channels : 0,
                         &c.crops, &c.eval_images);
  problems.attempt([&] {
    if ((train_ok && d.train.count < 1) || (test_ok && d.test.count < 1))
      throw ConfigError("no images to train on or to test with");
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
