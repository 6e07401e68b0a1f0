// A folder of class subfolders of image files -- torchvision's ImageFolder layout, which VISSL
// reads as its `disk_folder` data source -- decoded into an ImageDataset held in memory (within
// a memory budget, when one is given).
//
// As ImageFolder: the classes are the subfolders of the root, sorted by name (label = position);
// each class holds the files below its folder (subfolders too) whose extension, in lower case,
// is an image one (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp); other files are passed over.
// The samples are sorted by path within a class. Unlike ImageFolder, whose loader converts
// every image to RGB, a folder of grey images stays one channel (a grey folder trains a
// one-channel network, as the IDX reader gives); a folder that mixes them is read as RGB, grey
// images repeated over the three channels. Images keep their own size.
//
// Needs libjpeg and libpng at link time (image_decode.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/data/image_dataset.hpp"
#include "shardkit/data/image_decode.hpp"

namespace shardkit::data {

inline constexpr const char* kImageExtensions[] = {".jpg", ".jpeg", ".png",  ".ppm", ".bmp",
                                                   ".pgm", ".tif",  ".tiff", ".webp"};

// The files of an ImageFolder, before decoding.
struct ImageFolderIndex {
  std::vector<std::string> classes;  // label -> subfolder name
  std::vector<std::string> paths;    // every sample, class by class
  std::vector<std::int32_t> labels;  // per sample
  std::string root;                  // the folder indexed (for messages)
};

inline bool has_image_extension(const std::filesystem::path& path) {
  std::string ext = path.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return std::find(std::begin(kImageExtensions), std::end(kImageExtensions), ext) !=
         std::end(kImageExtensions);
}

inline ImageFolderIndex index_image_folder(const std::string& root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  check<IoError>(fs::is_directory(root, ec), "image folder '", root,
                 "' is not a folder; DATA_PATHS of a disk_folder source must name a folder "
                 "holding one subfolder of images per class (torchvision's ImageFolder layout)");
  ImageFolderIndex index;
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.is_directory()) index.classes.push_back(entry.path().filename().string());
  std::sort(index.classes.begin(), index.classes.end());
  check<IoError>(!index.classes.empty(), "image folder '", root,
                 "' has no class subfolders; put the images of each class in a subfolder of "
                 "its own (root/<class>/<image>.png)");
  for (std::size_t label = 0; label < index.classes.size(); ++label) {
    const fs::path folder = fs::path(root) / index.classes[label];
    std::vector<std::string> files;
    for (const auto& entry :
         fs::recursive_directory_iterator(folder, fs::directory_options::follow_directory_symlink))
      if (entry.is_regular_file() && has_image_extension(entry.path()))
        files.push_back(entry.path().string());
    std::sort(files.begin(), files.end());
    for (auto& f : files) {
      index.paths.push_back(std::move(f));
      index.labels.push_back(static_cast<std::int32_t>(label));
    }
  }
  check<IoError>(!index.paths.empty(), "image folder '", root, "' has ", index.classes.size(),
                 " class subfolders but no image files in them (extensions read: .jpg .jpeg .png "
                 ".ppm .bmp .pgm .tif .tiff .webp)");
  index.root = root;
  return index;
}

// The images decoded before load_image_folder judges a memory budget by their average size.
inline constexpr std::int64_t kBudgetSampleImages = 256;

// A folder whose images would take more memory than load_image_folder's budget allows.
class ImageFolderTooLarge : public OutOfMemory {
 public:
  ImageFolderTooLarge(const std::string& message, std::int64_t images_that_fit)
      : OutOfMemory(message), images_that_fit(images_that_fit) {}
  std::int64_t images_that_fit;  // how many would fit, at the average size measured
};

// Decodes every file of the index on `threads` threads. The first file that cannot be read
// stops the load with an IoError naming it.
//
// Held in memory, a folder's images take their decoded size twice while they are packed into
// one buffer (the decoded images, then the dataset's copy; each decoded image is freed once
// copied). With `memory_budget` >= 0 bytes, a folder that would take more is refused with an
// ImageFolderTooLarge naming the images, their average size and how many would fit -- judged
// from the first
// kBudgetSampleImages decoded, so that a folder the size of ImageNet's is refused in a second,
// not after an hour of decoding -- and again by the exact total before the copy.
inline ImageDataset load_image_folder(const ImageFolderIndex& index, int threads,
                                      std::int64_t memory_budget = -1) {
  const auto count = static_cast<std::int64_t>(index.paths.size());
  std::vector<DecodedImage> images(static_cast<std::size_t>(count));
  std::atomic<std::int64_t> next{0}, decoded{0}, decoded_bytes{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto over_budget = [&](std::int64_t images_seen, std::int64_t bytes_seen,
                               std::int64_t estimate) {
    const double average = double(bytes_seen) / double(images_seen);
    const auto fit = static_cast<std::int64_t>(double(memory_budget) / (2 * average));
    char figures[256];
    std::snprintf(figures, sizeof figures,
                  "about %.2f GB decoded and packed (%.1f kB an image on average over the %lld "
                  "decoded first), more than the %.2f GB of memory they may use; about %lld of "
                  "them would fit",
                  double(estimate) / 1e9, average / 1e3, static_cast<long long>(images_seen),
                  double(memory_budget) / 1e9, static_cast<long long>(fit));
    return ImageFolderTooLarge("image folder '" + index.root + "': its " + std::to_string(count) +
                                   " images would take " + figures,
                               fit);
  };
  auto work = [&] {
    for (std::int64_t i; (i = next++) < count;) {
      try {
        auto& image = images[static_cast<std::size_t>(i)];
        image = decode_image_file(index.paths[static_cast<std::size_t>(i)]);
        if (memory_budget < 0) continue;
        const auto bytes = static_cast<std::int64_t>(image.pixels.size());
        const std::int64_t seen = ++decoded, held = decoded_bytes += bytes;
        // Twice the bytes while they are packed: once kBudgetSampleImages are in, the average
        // so far times the images; before that, what is held already.
        const std::int64_t estimate =
            seen >= std::min(count, kBudgetSampleImages) ? 2 * (held / seen) * count : 2 * held;
        if (estimate > memory_budget) throw over_budget(seen, held, estimate);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
        next = count;  // stop the others early
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(threads, 1); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);

  ImageDataset d;
  d.count = count;
  d.classes = index.classes;
  d.labels = index.labels;
  d.channels = 1;
  for (const auto& im : images) d.channels = std::max(d.channels, im.channels);
  bool uniform = true;
  for (const auto& im : images)
    uniform = uniform && im.rows == images[0].rows && im.cols == images[0].cols;
  if (uniform) {
    d.rows = images[0].rows;
    d.cols = images[0].cols;
  }
  std::int64_t total = 0, held = 0;
  for (const auto& im : images) {
    total += im.rows * im.cols * d.channels;
    held += static_cast<std::int64_t>(im.pixels.size());
  }
  // (grey images in an RGB folder take three times their decoded bytes once packed)
  if (memory_budget >= 0 && held + total > memory_budget)
    throw over_budget(count, held, held + total);
  d.pixels.resize(static_cast<std::size_t>(total));
  std::int64_t offset = 0;
  for (auto& im : images) {
    if (!uniform) d.extents.push_back({offset, im.rows, im.cols});
    std::uint8_t* out = d.pixels.data() + offset;
    if (im.channels == d.channels) {
      std::copy(im.pixels.begin(), im.pixels.end(), out);
    } else {  // a grey image in an RGB dataset
      for (std::size_t p = 0; p < im.pixels.size(); ++p)
        out[3 * p] = out[3 * p + 1] = out[3 * p + 2] = im.pixels[p];
    }
    offset += im.rows * im.cols * d.channels;
    std::vector<std::uint8_t>().swap(im.pixels);  // (freed as it goes)
  }
  return d;
}

inline ImageDataset load_image_folder(const std::string& root, int threads) {
  return load_image_folder(index_image_folder(root), threads);
}

}  // namespace shardkit::data
