// A folder of class subfolders of image files -- torchvision's ImageFolder layout, which VISSL
// reads as its `disk_folder` data source -- decoded into an ImageDataset held in memory (within
// a memory budget, when one is given).
//
// As ImageFolder: the classes are the subfolders of the root, sorted by name (label = position);
// each class holds the files below its folder (subfolders too) whose extension, in lower case,
// is an image one (.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp); other files are passed over.
// Within a class the samples are in ImageFolder's order: by folder (its path; os.walk's folders
// sorted), then by file name in each folder -- a class's own files before those of its
// subfolders, where sorting whole paths put "cat/a/x.jpg" before "cat/b.jpg". Unlike ImageFolder,
// whose loader converts every image to RGB, a folder of grey images stays one channel (a grey
// folder trains a one-channel network, as the IDX reader gives); a folder that mixes them is read
// as RGB, grey images repeated over the three channels. Images keep their own size.
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
  std::string empty_classes;
  for (std::size_t label = 0; label < index.classes.size(); ++label) {
    const fs::path folder = fs::path(root) / index.classes[label];
    std::vector<std::string> files;
    for (const auto& entry :
         fs::recursive_directory_iterator(folder, fs::directory_options::follow_directory_symlink))
      if (entry.is_regular_file() && has_image_extension(entry.path()))
        files.push_back(entry.path().string());
    std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
      const fs::path pa(a), pb(b);
      const std::string fa = pa.parent_path().string(), fb = pb.parent_path().string();
      return fa != fb ? fa < fb : pa.filename().string() < pb.filename().string();
    });
    // (a class of no images still takes a label: every label after it would differ from the
    // other split's where that one has the images, as torchvision refuses it too)
    if (files.empty() && empty_classes.size() < 200)
      empty_classes += (empty_classes.empty() ? "'" : ", '") + index.classes[label] + "'";
    for (auto& f : files) {
      index.paths.push_back(std::move(f));
      index.labels.push_back(static_cast<std::int32_t>(label));
    }
  }
  check<IoError>(!index.paths.empty(), "image folder '", root, "' has ", index.classes.size(),
                 " class subfolders but no image files in them (extensions read: .jpg .jpeg .png "
                 ".ppm .bmp .pgm .tif .tiff .webp)");
  check<IoError>(empty_classes.empty(), "image folder '", root,
                 "' has class subfolders with no image files: ", empty_classes,
                 " (extensions read: .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp); remove "
                 "them or add their images: each subfolder is a class, and its label is its "
                 "place among them");
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
  std::int64_t images_that_fit;  // how many would fit, at the average size measured (< all)
};

// Decodes every file of the index on `threads` threads. The first file that cannot be read
// stops the load with an IoError naming it.
//
// Held in memory, a folder's images take their decoded bytes and their packed copy at once
// while they are packed into one buffer (each decoded image is freed once copied; a grey image
// in an RGB folder takes three times its bytes packed). With `memory_budget` >= 0 bytes, a
// folder that would take more is refused with an ImageFolderTooLarge naming the images, their
// average cost and how many would fit: judged once from the first kBudgetSampleImages decoded
// (so that a folder the size of ImageNet's is refused in a second, not after an hour of
// decoding; give the files in a shuffled order, not class by class, for a fair sample), and at
// any time by what the images decoded so far will take (after the last one: exactly).
inline ImageDataset load_image_folder(const ImageFolderIndex& index, int threads,
                                      std::int64_t memory_budget = -1) {
  const auto count = static_cast<std::int64_t>(index.paths.size());
  std::vector<DecodedImage> images(static_cast<std::size_t>(count));
  std::atomic<std::int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  // What the images decoded so far will take: their bytes, and their pixels at the most
  // channels seen (the packed copy's).
  struct Cost {
    std::int64_t images = 0, bytes = 0, pixels = 0, channels = 1;
    std::int64_t total() const { return bytes + pixels * channels; }
  };
  Cost seen;
  std::mutex seen_mutex;
  const auto over_budget = [&](const Cost& measured) {
    const double each = double(measured.total()) / double(measured.images);
    const auto fit = std::min(count - 1, static_cast<std::int64_t>(double(memory_budget) / each));
    char figures[256];
    std::snprintf(figures, sizeof figures,
                  "about %.2f GB decoded and packed (%.1f kB an image, measured over %s%lld), "
                  "more than the %.2f GB of memory they may use; ",
                  each * double(count) / 1e9, each / 1e3,
                  measured.images == count ? "all " : "the first ",
                  static_cast<long long>(measured.images), double(memory_budget) / 1e9);
    return ImageFolderTooLarge(
        "image folder '" + index.root + "': its " + std::to_string(count) + " images would take " +
            figures +
            (fit < 1 ? std::string("not even one of them fits")
                     : "about " + std::to_string(fit) + " of them would fit"),
        fit);
  };
  auto work = [&] {
    for (std::int64_t i; (i = next++) < count;) {
      try {
        auto& image = images[static_cast<std::size_t>(i)];
        image = decode_image_file(index.paths[static_cast<std::size_t>(i)]);
        if (memory_budget < 0) continue;
        std::lock_guard lock(seen_mutex);
        seen.images += 1;
        seen.bytes += static_cast<std::int64_t>(image.pixels.size());
        seen.pixels += image.rows * image.cols;
        seen.channels = std::max(seen.channels, image.channels);
        // What these images will take already; and, once, what all of them would at the
        // sample's average.
        const bool sampled = seen.images == std::min(count, kBudgetSampleImages);
        if (seen.total() > memory_budget ||
            (sampled &&
             double(seen.total()) / double(seen.images) * double(count) > double(memory_budget)))
          throw over_budget(seen);
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
  if (count == 0) {  // (a limit of 0 images)
    ImageDataset none;
    none.classes = index.classes;
    return none;
  }

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
  // (within the budget: the check after the last image decoded counted all of them exactly)
  std::int64_t total = 0;
  for (const auto& im : images) total += im.rows * im.cols * d.channels;
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
