// Multi-crop augmentation (docs/swav.md, "Data"): VISSL's ImgPilToMultiCrop ->
// RandomHorizontalFlip -> ImgPilColorDistortion -> ImgPilGaussianBlur -> ToTensor -> Normalize,
// for grey (one-channel) and RGB images. Every random draw of crop c of image i in epoch e comes
// from a Philox stream keyed by (seed, epoch, image, crop), so a crop does not depend on the
// thread that makes it or on where a run resumed.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/philox.hpp"
#include "shardkit/data/image_dataset.hpp"

namespace swav {

namespace sk = shardkit;

// (x - mean) / std of `channels` planes of `area` values in [0, 1], in place (CHW): torchvision's
// Normalize, one mean and std per channel.
inline void normalize_planes(float* planes, std::int64_t channels, std::int64_t area,
                             const std::vector<double>& mean, const std::vector<double>& std) {
  for (std::int64_t ch = 0; ch < channels; ++ch)
    for (std::int64_t k = 0; k < area; ++k)
      planes[ch * area + k] =
          static_cast<float>((planes[ch * area + k] - mean[static_cast<std::size_t>(ch)]) /
                             std[static_cast<std::size_t>(ch)]);
}

struct MultiCropConfig {
  // One entry per crop size, large first: how many crops, their side, their area range.
  std::vector<int> num_crops{2, 4};
  std::vector<int> size_crops{24, 12};
  std::vector<std::array<double, 2>> crop_scales{{0.14, 1.0}, {0.05, 0.14}};
  double flip_p = 0.5;          // RandomHorizontalFlip
  double color_strength = 1.0;  // ImgPilColorDistortion; 0 turns it off
  double color_p = 0.8;         // probability of the jitter (VISSL: 0.8)
  double blur_p = 0.5;          // ImgPilGaussianBlur
  double blur_radius_min = 0.1, blur_radius_max = 2.0;
  // Normalize: one mean and std per channel (Fashion-MNIST's pixel statistics in [0, 1]);
  // none (a transform list without Normalize) leaves the values in [0, 1], as VISSL does.
  std::vector<double> mean{0.2860}, std{0.3530};

  // Normalize of `channels` planes of `area` values in [0, 1], in place (CHW).
  void normalize(float* planes, std::int64_t channels, std::int64_t area) const {
    if (!mean.empty()) normalize_planes(planes, channels, area, mean, std);
  }
  int total_crops() const {
    int n = 0;
    for (int c : num_crops) n += c;
    return n;
  }
  // The size group of crop `crop` (crops are numbered large first).
  std::size_t group_of(int crop) const {
    for (std::size_t g = 0; g < num_crops.size(); ++g) {
      if (crop < num_crops[g]) return g;
      crop -= num_crops[g];
    }
    sk::fail<sk::InvalidArgument>("multi-crop: crop index out of range");
  }
  void validate() const {
    sk::check(!num_crops.empty() && num_crops.size() == size_crops.size() &&
                  num_crops.size() == crop_scales.size(),
              "ImgPilToMultiCrop: num_crops (", num_crops.size(), " entries), size_crops (",
              size_crops.size(), ") and crop_scales (", crop_scales.size(),
              ") must have one entry per crop size");
    for (std::size_t g = 0; g < num_crops.size(); ++g) {
      sk::check(num_crops[g] >= 1 && size_crops[g] >= 4, "ImgPilToMultiCrop: size group ", g,
                " has ", num_crops[g], " crops of side ", size_crops[g],
                "; each group needs >= 1 crop of side >= 4");
      sk::check(
          crop_scales[g][0] > 0 && crop_scales[g][0] <= crop_scales[g][1] && crop_scales[g][1] <= 1,
          "ImgPilToMultiCrop: crop_scales[", g, "] = [", crop_scales[g][0], ", ", crop_scales[g][1],
          "] must satisfy 0 < min <= max <= 1");
    }
    sk::check(mean.size() == std.size(), "Normalize: mean has ", mean.size(), " entries and std ",
              std.size(), "; give one of each per channel");
    for (double s : std) sk::check(s > 0, "Normalize: std ", s, " must be positive");
    sk::check(blur_radius_min > 0 && blur_radius_min <= blur_radius_max,
              "ImgPilGaussianBlur: radius_min ", blur_radius_min, " and radius_max ",
              blur_radius_max, " must satisfy 0 < min <= max");
  }
};

// Uniform draws of one crop: Philox keyed by a mix of (seed, epoch, image, crop).
class CropRandom {
 public:
  CropRandom(std::uint64_t seed, std::int64_t epoch, std::int64_t image, int crop)
      : key_(mix(
            mix(mix(seed, static_cast<std::uint64_t>(epoch)), static_cast<std::uint64_t>(image)),
            static_cast<std::uint64_t>(crop))) {}
  double uniform() {  // [0, 1)
    if (lane_ == 4) {
      block_ = sk::philox_block(key_, counter_++);
      lane_ = 0;
    }
    return sk::word_to_unit(block_.v[lane_++]);
  }
  double uniform(double low, double high) { return low + (high - low) * uniform(); }
  // An integer in [low, high).
  std::int64_t integer(std::int64_t low, std::int64_t high) {
    return low + std::min<std::int64_t>(static_cast<std::int64_t>(uniform() * double(high - low)),
                                        high - low - 1);
  }

 private:
  static std::uint64_t mix(std::uint64_t a, std::uint64_t b) {  // splitmix64 of a combination
    std::uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E5Full;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t key_;
  std::uint64_t counter_ = 0;
  sk::PhiloxBlock block_{};
  int lane_ = 4;
};

struct CropBox {
  std::int64_t top, left, height, width;
};

// torchvision's RandomResizedCrop.get_params: up to 10 tries of an area in `scale` and an
// aspect ratio log-uniform in [3/4, 4/3]; else the largest centred crop of a valid ratio.
inline CropBox random_resized_box(CropRandom& rng, std::int64_t rows, std::int64_t cols,
                                  std::array<double, 2> scale) {
  const double area = double(rows * cols);
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * rng.uniform(scale[0], scale[1]);
    const double ratio = std::exp(rng.uniform(log_lo, log_hi));
    const auto w = static_cast<std::int64_t>(std::lround(std::sqrt(target * ratio)));
    const auto h = static_cast<std::int64_t>(std::lround(std::sqrt(target / ratio)));
    if (w > 0 && w <= cols && h > 0 && h <= rows) {
      const std::int64_t top = rng.integer(0, rows - h + 1);
      const std::int64_t left = rng.integer(0, cols - w + 1);
      return {top, left, h, w};
    }
  }
  const double in_ratio = double(cols) / double(rows);
  std::int64_t w = cols, h = rows;
  if (in_ratio < 3.0 / 4.0)
    h = std::lround(double(w) / (3.0 / 4.0));
  else if (in_ratio > 4.0 / 3.0)
    w = std::lround(double(h) * (4.0 / 3.0));
  return {(rows - h) / 2, (cols - w) / 2, h, w};
}

// Bilinear resize of the box to side x side, half-pixel centres (align_corners = False), each
// channel of the interleaved image into its own plane of `out` (CHW).
inline void resize_box(const sk::data::ImageView& image, const CropBox& box, int side, float* out) {
  const double sy = double(box.height) / side, sx = double(box.width) / side;
  const std::int64_t channels = image.channels, cols = image.cols;
  for (int y = 0; y < side; ++y) {
    const double fy = std::clamp((y + 0.5) * sy - 0.5, 0.0, double(box.height - 1));
    const auto y0 = static_cast<std::int64_t>(fy);
    const std::int64_t y1 = std::min(y0 + 1, box.height - 1);
    const double wy = fy - double(y0);
    for (int x = 0; x < side; ++x) {
      const double fx = std::clamp((x + 0.5) * sx - 0.5, 0.0, double(box.width - 1));
      const auto x0 = static_cast<std::int64_t>(fx);
      const std::int64_t x1 = std::min(x0 + 1, box.width - 1);
      const double wx = fx - double(x0);
      for (std::int64_t ch = 0; ch < channels; ++ch) {
        auto at = [&](std::int64_t r, std::int64_t c) {
          return double(image.pixels[((box.top + r) * cols + box.left + c) * channels + ch]) /
                 255.0;
        };
        const double top = at(y0, x0) * (1 - wx) + at(y0, x1) * wx;
        const double bottom = at(y1, x0) * (1 - wx) + at(y1, x1) * wx;
        out[(ch * side + y) * side + x] = static_cast<float>(top * (1 - wy) + bottom * wy);
      }
    }
  }
}

// The whole image resized to side x side and normalised, CHW: what the kNN evaluation reads.
inline void whole_image(const MultiCropConfig& config, const sk::data::ImageView& image, int side,
                        float* out) {
  resize_box(image, CropBox{0, 0, image.rows, image.cols}, side, out);
  const std::int64_t area = std::int64_t{side} * side;
  config.normalize(out, image.channels, area);
}

// DATA.TEST.TRANSFORMS: how the kNN evaluation reads an image. VISSL's default, an empty list,
// keeps the trainer's own rule: the whole image resized to the large crops' side and normalised
// like the crops. A list is torchvision's Resize (the shorter side to `resize`, the aspect kept),
// CenterCrop (a `crop` x `crop` square from the middle) and Normalize, each optional. The two
// geometric steps are done here as one bilinear resampling of the centred box of the stored
// image that they keep (torchvision resamples the whole image, then crops it), so an image whose
// side is already the crop's (Fashion-MNIST's 28 pixels, Resize 28, CenterCrop 28) is read as it
// is stored, pixel for pixel.
struct EvalTransform {
  bool configured = false;        // false: the trainer's own rule above
  int resize = 0;                 // 0: no Resize
  int crop = 0;                   // 0: no CenterCrop
  std::vector<double> mean, std;  // empty: no Normalize

  // The side of the square a `rows` x `cols` image becomes; `crop_side` is the large crops'.
  int side(std::int64_t rows, std::int64_t cols, int crop_side) const {
    if (!configured) return crop_side;
    if (crop > 0) return crop;
    sk::check(rows == cols, "DATA.TEST.TRANSFORMS: a ", rows, " x ", cols,
              " image stays oblong without CenterCrop (Resize keeps the aspect), and the network "
              "reads square batches; add {name: CenterCrop, size: N}");
    return resize > 0 ? resize : static_cast<int>(rows);
  }
  // The part of a `rows` x `cols` image that side() resamples.
  CropBox box(std::int64_t rows, std::int64_t cols) const {
    if (!configured || crop == 0) return CropBox{0, 0, rows, cols};
    const std::int64_t shorter = std::min(rows, cols);
    const std::int64_t after_resize = resize > 0 ? resize : shorter;
    sk::check(crop <= after_resize, "DATA.TEST.TRANSFORMS: CenterCrop ", crop,
              " is larger than the shorter side of the ", resize > 0 ? "resized " : "", "image (",
              after_resize, " of a ", rows, " x ", cols,
              " image); torchvision would pad it, "
              "this trainer does not: lower CenterCrop or raise Resize");
    const double scale = double(after_resize) / double(shorter);  // output pixels per stored one
    const std::int64_t extent = std::clamp<std::int64_t>(std::llround(crop / scale), 1, shorter);
    return CropBox{std::llround(double(rows - extent) / 2), std::llround(double(cols - extent) / 2),
                   extent, extent};
  }
};

// An image as the kNN evaluation reads it, `side` x `side` (EvalTransform::side()), CHW.
inline void eval_image(const MultiCropConfig& crops, const EvalTransform& eval,
                       const sk::data::ImageView& image, int side, float* out) {
  if (!eval.configured) return whole_image(crops, image, side, out);
  resize_box(image, eval.box(image.rows, image.cols), side, out);
  if (!eval.mean.empty())
    normalize_planes(out, image.channels, std::int64_t{side} * side, eval.mean, eval.std);
}

// Separable Gaussian blur of standard deviation sigma (PIL's radius), edges clamped.
inline void gaussian_blur(float* pixels, int side, double sigma) {
  const int radius = std::max(1, static_cast<int>(std::ceil(3 * sigma)));
  std::vector<double> kernel(static_cast<std::size_t>(2 * radius + 1));
  double sum = 0;
  for (int i = -radius; i <= radius; ++i)
    sum += kernel[static_cast<std::size_t>(i + radius)] = std::exp(-0.5 * i * i / (sigma * sigma));
  for (double& k : kernel) k /= sum;
  std::vector<float> tmp(static_cast<std::size_t>(side * side));
  for (int pass = 0; pass < 2; ++pass) {
    const float* src = pass == 0 ? pixels : tmp.data();
    float* dst = pass == 0 ? tmp.data() : pixels;
    for (int y = 0; y < side; ++y)
      for (int x = 0; x < side; ++x) {
        double acc = 0;
        for (int i = -radius; i <= radius; ++i) {
          const int yy = pass == 0 ? y : std::clamp(y + i, 0, side - 1);
          const int xx = pass == 0 ? std::clamp(x + i, 0, side - 1) : x;
          acc += kernel[static_cast<std::size_t>(i + radius)] * src[yy * side + xx];
        }
        dst[y * side + x] = static_cast<float>(acc);
      }
  }
}

// Colour distortion of an RGB crop (planes r, g, b of `area` values in [0, 1]): VISSL's
// ImgPilColorDistortion, torchvision's ColorJitter(0.8 s, 0.8 s, 0.8 s, 0.2 s) applied with
// probability color_p -- brightness, contrast, saturation and hue factors, applied in a random
// order -- then RandomGrayscale with probability 0.2.
class RgbJitter {
 public:
  RgbJitter(float* planes, std::int64_t area) : planes_(planes), area_(area) {}

  void apply(const MultiCropConfig& config, CropRandom& rng) {
    const double jitter = 0.8 * config.color_strength;
    if (config.color_strength > 0 && rng.uniform() < config.color_p) {
      const double brightness = rng.uniform(std::max(0.0, 1 - jitter), 1 + jitter);
      const double contrast = rng.uniform(std::max(0.0, 1 - jitter), 1 + jitter);
      const double saturation = rng.uniform(std::max(0.0, 1 - jitter), 1 + jitter);
      const double hue = rng.uniform(-0.2 * config.color_strength, 0.2 * config.color_strength);
      std::array<int, 4> order{0, 1, 2, 3};  // torch.randperm(4): a uniform permutation
      for (int i = 3; i > 0; --i) std::swap(order[i], order[rng.integer(0, i + 1)]);
      for (int op : order) {
        if (op == 0) blend_with(0.0, brightness);
        if (op == 1) blend_with(grey_mean(), contrast);
        if (op == 2) blend_with_grey(saturation);
        if (op == 3) shift_hue(hue);
      }
    }
    if (config.color_strength > 0 && rng.uniform() < 0.2) to_grey();
  }

 private:
  float& at(int c, std::int64_t k) { return planes_[c * area_ + k]; }
  // ITU-R 601-2 luma, as PIL's convert("L") and torchvision's rgb_to_grayscale.
  double luma(std::int64_t k) { return 0.299 * at(0, k) + 0.587 * at(1, k) + 0.114 * at(2, k); }
  static float clamp01(double v) { return static_cast<float>(std::clamp(v, 0.0, 1.0)); }
  double grey_mean() {
    double sum = 0;
    for (std::int64_t k = 0; k < area_; ++k) sum += luma(k);
    return sum / double(area_);
  }
  // torchvision's _blend: factor x image + (1 - factor) x other.
  void blend_with(double other, double factor) {
    for (int c = 0; c < 3; ++c)
      for (std::int64_t k = 0; k < area_; ++k)
        at(c, k) = clamp01(factor * at(c, k) + (1 - factor) * other);
  }
  void blend_with_grey(double factor) {
    for (std::int64_t k = 0; k < area_; ++k) {
      const double grey = luma(k);
      for (int c = 0; c < 3; ++c) at(c, k) = clamp01(factor * at(c, k) + (1 - factor) * grey);
    }
  }
  void to_grey() {
    for (std::int64_t k = 0; k < area_; ++k) {
      const float grey = clamp01(luma(k));
      at(0, k) = at(1, k) = at(2, k) = grey;
    }
  }
  // The hue turned by `shift` of a full turn: RGB -> HSV, h + shift mod 1, HSV -> RGB.
  void shift_hue(double shift) {
    for (std::int64_t k = 0; k < area_; ++k) {
      const double r = at(0, k), g = at(1, k), b = at(2, k);
      const double max = std::max({r, g, b}), min = std::min({r, g, b}), delta = max - min;
      if (delta <= 0) continue;  // grey: no hue to turn
      double h = max == r ? (g - b) / delta : max == g ? 2 + (b - r) / delta : 4 + (r - g) / delta;
      h = h / 6 + shift;
      h -= std::floor(h);
      const double s = delta / max, v = max;
      const double sector = h * 6;
      const int i = static_cast<int>(sector) % 6;
      const double f = sector - std::floor(sector);
      const double p = v * (1 - s), q = v * (1 - s * f), t = v * (1 - s * (1 - f));
      const double rgb[6][3] = {{v, t, p}, {q, v, p}, {p, v, t}, {p, q, v}, {t, p, v}, {v, p, q}};
      for (int c = 0; c < 3; ++c) at(c, k) = clamp01(rgb[i][c]);
    }
  }

  float* planes_;
  std::int64_t area_;
};

// Colour distortion of a grey crop: brightness and contrast jitter (saturation and hue have
// nothing to change, grayscale conversion neither), in a random order.
inline void grey_jitter(const MultiCropConfig& config, CropRandom& rng, std::span<float> px) {
  const double jitter = 0.8 * config.color_strength;
  if (config.color_strength > 0 && rng.uniform() < config.color_p) {
    const double brightness = rng.uniform(std::max(0.0, 1 - jitter), 1 + jitter);
    const double contrast = rng.uniform(std::max(0.0, 1 - jitter), 1 + jitter);
    const bool brightness_first = rng.uniform() < 0.5;
    auto apply_brightness = [&] {
      for (float& v : px) v = std::clamp(static_cast<float>(v * brightness), 0.0f, 1.0f);
    };
    auto apply_contrast = [&] {
      double mean = 0;
      for (float v : px) mean += v;
      mean /= double(px.size());
      for (float& v : px)
        v = std::clamp(static_cast<float>((v - mean) * contrast + mean), 0.0f, 1.0f);
    };
    if (brightness_first) {
      apply_brightness();
      apply_contrast();
    } else {
      apply_contrast();
      apply_brightness();
    }
  }
}

// Crop `crop` of `image` in `epoch`, written normalised into `out`: channels x side x side
// (CHW) of the crop's size group.
inline void make_crop(const MultiCropConfig& config, std::uint64_t seed, std::int64_t epoch,
                      std::int64_t image_index, int crop, const sk::data::ImageView& image,
                      float* out) {
  sk::check(image.channels == 1 || image.channels == 3, "multi-crop: images have ", image.channels,
            " channels; grey (1) or RGB (3) are read");
  sk::check(config.mean.empty() || static_cast<std::int64_t>(config.mean.size()) == image.channels,
            "Normalize: mean and std have ", config.mean.size(), " entries but the images have ",
            image.channels, " channels; give one per channel");
  CropRandom rng(seed, epoch, image_index, crop);
  const std::size_t group = config.group_of(crop);
  const int side = config.size_crops[group];
  const std::int64_t area = std::int64_t{side} * side;
  const CropBox box = random_resized_box(rng, image.rows, image.cols, config.crop_scales[group]);
  resize_box(image, box, side, out);
  const std::span<float> px(out, static_cast<std::size_t>(image.channels * area));
  if (rng.uniform() < config.flip_p)
    for (std::int64_t row = 0; row < image.channels * side; ++row)
      std::reverse(out + row * side, out + (row + 1) * side);
  if (image.channels == 1)
    grey_jitter(config, rng, px);
  else
    RgbJitter(out, area).apply(config, rng);
  if (rng.uniform() < config.blur_p) {
    const double sigma = rng.uniform(config.blur_radius_min, config.blur_radius_max);
    for (std::int64_t ch = 0; ch < image.channels; ++ch)
      gaussian_blur(out + ch * area, side, sigma);
  }
  config.normalize(out, image.channels, area);
}

}  // namespace swav
