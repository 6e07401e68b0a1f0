// The SwAV trainer's settings, read from a VISSL-style configuration (config_tree.hpp,
// swav_defaults.hpp) and completed the way VISSL's infer_and_assert_hydra_config does: the
// ZeRO stage from OPTIMIZER.name / use_zero, SHARDED_DDP_SETUP.USE_SDP and
// FSDP_CONFIG.AUTO_SETUP_FSDP; the precision from AMP_PARAMS; the loss's crops, prototypes and
// queue length from the data and head settings; the learning rate scaled by the global batch.
// Combinations this trainer does not implement are errors that say so.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "config_tree.hpp"
#include "feature_eval.hpp"
#include "lr_schedule.hpp"
#include "multicrop.hpp"
#include "shardkit/data/synthetic_images.hpp"
#include "shardkit/nn/efficientnet.hpp"
#include "shardkit/nn/regnet.hpp"
#include "shardkit/nn/resnet.hpp"
#include "shardkit/optim/sharded_optimizer.hpp"
#include "shardkit/parallel/options.hpp"
#include "swav_defaults.hpp"
#include "swav_loss.hpp"

namespace swav {

// Where one split's images come from (DATA.TRAIN / DATA.TEST: DATA_SOURCES, DATA_PATHS,
// DATA_LIMIT and the synthetic source's keys).
struct DataSource {
  std::string kind = "fashion_mnist";  // fashion_mnist | disk_folder | synthetic
  std::string path;                    // fashion_mnist: the .gz files' folder; disk_folder: root
  std::int64_t limit = -1;             // DATA_LIMIT; synthetic: the number of images
  std::uint64_t sampling_seed = 0;     // disk_folder: DATA_LIMIT_SAMPLING.SEED (the file order)
  std::int64_t synthetic_classes = 0;  // RANDOM_SYNTHETIC_LABELS
  std::int64_t synthetic_side = 32;    // DEFAULT_GRAY_IMG_SIZE
};

// What one run reads from its config. read_swav_config sets every field from the merged config,
// whose defaults are swav_defaults.hpp's; the initialisers here are those defaults too (VISSL's
// for the network and the optimizer), so that the two never tell different stories.
struct SwavConfig {
  std::uint64_t seed = 0;
  int log_frequency = 10;
  // TEST_MODEL, VISSL's test phases on DATA.TEST: here the kNN evaluations (raw pixels, the
  // initial network, every NEAREST_NEIGHBOR.FREQUENCY epochs, the end). False trains without
  // them and leaves DATA.TEST unread, as VISSL's pretraining configs (which all say False and
  // have no test split) ask.
  bool test_model = true;
  std::string device = "auto";
  std::string cuda_graph = "auto";  // true | false | auto (on a GPU where every part captures)
  // Data
  DataSource train_data, test_data;
  std::int64_t batch_size = 32, test_batch_size = 256;
  int workers = 2;
  MultiCropConfig crops;
  EvalTransform eval_images;  // DATA.TEST.TRANSFORMS: the kNN evaluation's images
  // Model
  std::string trunk = "resnet";  // MODEL.TRUNK.NAME: resnet, regnet or efficientnet (fields below)
  int depth = 50;
  std::int64_t base_channels = 64;
  std::int64_t groups = 1, width_per_group = 64;  // ResNeXt's (64: the plain ResNet)
  std::int64_t in_channels = 1;  // the images' channels (load_datasets sets it from the data)
  bool small_image_stem = false, zero_init_residual = false;
  bool channels_last = false;  // the trunk's activations stored NHWC (either device)
  bool channel_blocks = true;  // kept in oneDNN's channel blocks inside the stages (CPU)
  // MODEL.TRUNK.REGNET: a registered model's name, "anynet", or "" (built from its numbers);
  // the stages; the stem, squeeze-and-excitation and batch-norm settings (in_channels aside).
  std::string regnet_name;
  std::vector<shardkit::nn::RegNetStage> regnet_stages;
  shardkit::nn::RegNetOptions regnet;
  // MODEL.TRUNK.EFFICIENT_NETS: model_version (B0 ... B7) and the options it and the rest give
  // (in_channels aside).
  std::string efficientnet_version;
  shardkit::nn::EfficientNetOptions efficientnet;
  // VISSL's swav_head: dims = [head_in, head_hidden..., embedding_dim] (Linear, BatchNorm1d when
  // head_bn, ReLU per hidden width; the last Linear, then its BatchNorm1d and ReLU unless
  // skip_last_bn), then the L2-normalised embedding's prototypes.
  std::int64_t head_in = 2048, embedding_dim = 128, prototypes = 3000;
  std::vector<std::int64_t> head_hidden = {2048};
  bool head_bn = true, head_bias = true, head_skip_last_bn = true;
  double bn_eps = 1e-5, bn_momentum = 0.1;
  std::vector<std::pair<std::string, std::int64_t>> frozen;  // parameter -> iterations
  int checkpoint_splits = 0;                                 // 0: no activation checkpointing
  int sync_bn_group = 0;  // SyncBatchNorm over groups of this many consecutive ranks; 0: off
  // VISSL's OPTIMIZER.regularize_bn / regularize_bias: False puts batch-norm parameters /
  // Linear and Conv biases in a group without weight decay.
  bool regularize_bn = false, regularize_bias = true;
  // VISSL's OPTIMIZER.construct_single_param_group_only (which its AUTO_SETUP_FSDP turns on):
  // every parameter in one group with the weight decay, the regularize_* keys unread.
  bool single_param_group = false;
  // Parallelism and precision
  int ranks = 2;
  // The stage, precision, buckets, resharding and CPU offload (FSDP's move_grads_to_cpu /
  // move_params_to_cpu), given as they are to the memory planner and the sharded module.
  shardkit::parallel::ParallelOptions parallel;
  bool loss_scaling = false;             // f16: dynamic loss scaling
  std::int64_t fsdp_wrap_threshold = 0;  // VISSL's AUTO_WRAP_THRESHOLD (0: off; rank_setup.hpp)
  // Loss
  SwavLossConfig loss;
  std::int64_t queue_length = 0;  // global, after VISSL's rounding
  // Optimizer
  shardkit::optim::OptimizerConfig optimizer;
  int num_epochs = 1;
  LrSchedule lr;
  // Checkpoints, evaluation, metrics
  std::string checkpoint_dir;
  bool auto_resume = true, overwrite_existing = false, consolidated = false;
  int checkpoint_every_epochs = 1;
  std::int64_t checkpoint_every_iters = -1;
  int knn_topk = 200;
  double knn_sigma = 0.07;
  int knn_every_epochs = 0;
  std::vector<FeaturePool> knn_features{FeaturePool{}};  // the first is the headline figure
  std::int64_t memory_bank_limit = -1;
  std::string export_dir, metrics_path;
  bool plot_metrics = true;  // METRICS.PLOT: the curves as a PNG at the end
  std::int64_t max_iterations = -1;
};

// "ResNet-50", a ResNeXt's torchvision name ("ResNeXt-50 32x4d"), a RegNet's: "RegNetY
// regnet_y_400mf (4 stages, 440 features)", "AnyNet of RegNetY blocks (...)", or
// "EfficientNet-B0 (16 blocks, 1280 features)".
inline std::string trunk_name(const SwavConfig& c) {
  if (c.trunk == "efficientnet")
    return "EfficientNet-" + c.efficientnet_version + " (" +
           std::to_string(shardkit::nn::efficientnet_blocks(c.efficientnet).size()) + " blocks, " +
           std::to_string(shardkit::nn::efficientnet_width(1280, c.efficientnet)) + " features)";
  if (c.trunk == "regnet") {
    const std::string blocks = c.regnet.use_se ? "RegNetY" : "RegNetX";
    const std::string name = c.regnet_name == "anynet" ? "AnyNet of " + blocks + " blocks"
                             : c.regnet_name.empty()   ? blocks + " from its numbers"
                                                       : blocks + " " + c.regnet_name;
    return name + " (" + std::to_string(c.regnet_stages.size()) + " stages, " +
           std::to_string(c.regnet_stages.empty() ? 0 : c.regnet_stages.back().width) +
           " features)";
  }
  if (c.groups == 1 && c.width_per_group == 64) return "ResNet-" + std::to_string(c.depth);
  return "ResNeXt-" + std::to_string(c.depth) + " " + std::to_string(c.groups) + "x" +
         std::to_string(c.width_per_group) + "d";
}

namespace detail {

inline ConfigError bad(const std::string& key, const std::string& value, const std::string& fix) {
  return ConfigError("config." + key + " = " + value + ": " + fix);
}

// The start of the refusal of a kNN setting that TEST_MODEL: False makes moot.
inline constexpr const char* kEvaluationOff =
    "asks for kNN evaluations on DATA.TEST, which config.TEST_MODEL = False turns off; set "
    "TEST_MODEL True (with DATA.TEST's images) or ";

// A value in a free-form part of the config (a transform, a schedule, the head's parameters,
// the frozen-parameter map: the defaults cannot type-check those) as T, or a ConfigError
// naming its key and what it must be.
template <class T>
T value_as(const YAML::Node& n, const std::string& key, const char* wanted) {
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    throw bad(key, n.IsDefined() ? ::swav::detail::text_of(n) : "(missing)",
              std::string("must be ") + wanted);
  }
}

// The transforms one list may hold, and the parameters each may carry.
using TransformKeys = std::vector<std::pair<std::string, std::vector<std::string>>>;

// The name of transform `t` (at `where`): a map with a name among `known` (`what` says which
// transforms, in the refusal of another) whose other keys are that transform's parameters.
inline std::string transform_name(const YAML::Node& t, const std::string& where,
                                  const TransformKeys& known, const std::string& what) {
  if (!t.IsMap() || !t["name"])
    throw bad(where, ::swav::detail::text_of(t), "each transform is a map with a name");
  const std::string name = value_as<std::string>(t["name"], where + ".name", "a string");
  auto it = std::find_if(known.begin(), known.end(), [&](auto& k) { return k.first == name; });
  if (it == known.end()) {
    std::string names;
    for (const auto& k : known) names += (names.empty() ? "" : ", ") + k.first;
    throw bad(where + ".name", name, "not " + what + " this trainer implements; use " + names);
  }
  for (const auto& kv : t) {
    const std::string key = value_as<std::string>(kv.first, where, "a map with string keys");
    if (key != "name" && std::find(it->second.begin(), it->second.end(), key) == it->second.end())
      throw bad(where + "." + key, ::swav::detail::text_of(kv.second),
                "not a parameter of " + name);
  }
  return name;
}

inline MultiCropConfig read_transforms(const ConfigTree& c) {
  MultiCropConfig m;
  bool multicrop = false;
  const YAML::Node list = c.at("DATA.TRAIN.TRANSFORMS");
  // Transforms this trainer applies (to grey and RGB images), and the keys each may carry.
  const TransformKeys known{
      {"ImgPilToMultiCrop", {"total_num_crops", "size_crops", "num_crops", "crop_scales"}},
      {"RandomHorizontalFlip", {"p"}},
      {"ImgPilColorDistortion", {"strength"}},
      {"ImgPilGaussianBlur", {"p", "radius_min", "radius_max"}},
      {"ToTensor", {}},
      {"Normalize", {"mean", "std"}}};
  m.flip_p = 0;
  m.color_strength = 0;
  m.blur_p = 0;
  m.mean.clear();  // (as the augmentations: only what the list names -- VISSL's [0, 1] without)
  m.std.clear();
  for (std::size_t i = 0; i < list.size(); ++i) {
    const YAML::Node t = list[i];
    const std::string where = "DATA.TRAIN.TRANSFORMS[" + std::to_string(i) + "]";
    const std::string name = transform_name(t, where, known, "a transform");
    try {
      if (name == "ImgPilToMultiCrop") {
        multicrop = true;
        m.size_crops = t["size_crops"].as<std::vector<int>>();
        m.num_crops = t["num_crops"].as<std::vector<int>>();
        m.crop_scales.clear();
        for (const auto& s : t["crop_scales"]) {
          const auto pair = s.as<std::vector<double>>();
          if (pair.size() != 2)
            throw bad(where + ".crop_scales", ::swav::detail::text_of(s),
                      "each scale is [min, max]");
          m.crop_scales.push_back({pair[0], pair[1]});
        }
        if (t["total_num_crops"] && t["total_num_crops"].as<int>() != m.total_crops())
          throw bad(where + ".total_num_crops", t["total_num_crops"].as<std::string>(),
                    "must equal the sum of num_crops (" + std::to_string(m.total_crops()) + ")");
      } else if (name == "RandomHorizontalFlip") {
        m.flip_p = t["p"] ? t["p"].as<double>() : 0.5;
      } else if (name == "ImgPilColorDistortion") {
        m.color_strength = t["strength"] ? t["strength"].as<double>() : 1.0;
      } else if (name == "ImgPilGaussianBlur") {
        m.blur_p = t["p"] ? t["p"].as<double>() : 0.5;
        if (t["radius_min"]) m.blur_radius_min = t["radius_min"].as<double>();
        if (t["radius_max"]) m.blur_radius_max = t["radius_max"].as<double>();
      } else if (name == "Normalize") {
        // One entry per channel of the images (checked against them when they are loaded).
        m.mean = t["mean"].as<std::vector<double>>();
        m.std = t["std"].as<std::vector<double>>();
        if (m.mean.size() != m.std.size() || (m.mean.size() != 1 && m.mean.size() != 3))
          throw bad(where, ::swav::detail::text_of(t),
                    "give one mean and one std per channel: 1 for grey images (Fashion-MNIST: "
                    "[0.2860], [0.3530]), 3 for RGB (ImageNet: [0.485, 0.456, 0.406], "
                    "[0.229, 0.224, 0.225])");
      }
    } catch (const YAML::Exception& e) {
      throw bad(where, ::swav::detail::text_of(t),
                std::string("a value has the wrong type (") + e.what() + ")");
    }
  }
  if (!multicrop)
    throw bad("DATA.TRAIN.TRANSFORMS", ::swav::detail::text_of(list),
              "SwAV needs an ImgPilToMultiCrop transform (the crops it compares)");
  m.validate();
  return m;
}

// DATA.TEST.TRANSFORMS (multicrop.hpp, EvalTransform): VISSL's evaluation transforms, of which
// the kNN evaluation applies Resize, CenterCrop and Normalize (ToTensor is implied).
inline EvalTransform read_test_transforms(const ConfigTree& c) {
  EvalTransform e;
  const YAML::Node list = c.at("DATA.TEST.TRANSFORMS");
  e.configured = list.size() > 0;
  const TransformKeys known{{"Resize", {"size"}},
                            {"CenterCrop", {"size"}},
                            {"ToTensor", {}},
                            {"Normalize", {"mean", "std"}}};
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const YAML::Node t = list[i];
    const std::string where = "DATA.TEST.TRANSFORMS[" + std::to_string(i) + "]";
    const std::string name = transform_name(t, where, known, "an evaluation transform");
    if (std::find(seen.begin(), seen.end(), name) != seen.end())
      throw bad(where + ".name", name, "given twice; give each transform once");
    seen.push_back(name);
    if (name == "Resize" || name == "CenterCrop") {
      const int size = value_as<int>(t["size"], where + ".size",
                                     "one whole number of pixels (Resize: the shorter side; "
                                     "CenterCrop: the square's side)");
      if (size < 1) throw bad(where + ".size", std::to_string(size), "must be >= 1");
      if (name == "Resize" && e.crop > 0)
        throw bad(where, ::swav::detail::text_of(t),
                  "this trainer applies Resize before CenterCrop; list Resize first");
      (name == "Resize" ? e.resize : e.crop) = size;
    } else if (name == "Normalize") {
      e.mean = value_as<std::vector<double>>(t["mean"], where + ".mean", "a list of numbers");
      e.std = value_as<std::vector<double>>(t["std"], where + ".std", "a list of numbers");
      if (e.mean.size() != e.std.size() || (e.mean.size() != 1 && e.mean.size() != 3))
        throw bad(where, ::swav::detail::text_of(t),
                  "give one mean and one std per channel: 1 for grey images, 3 for RGB (as "
                  "DATA.TRAIN.TRANSFORMS' Normalize)");
    }
  }
  return e;
}

inline Schedule read_schedule(const YAML::Node& n, const std::string& where) {
  Schedule s;
  // A subscript of a scalar or a list throws yaml-cpp's BadSubscript, which names no key.
  if (!n.IsMap())
    throw bad(where, ::swav::detail::text_of(n),
              "each scheduler is a map: {name: cosine, start_value: ..., end_value: ...}");
  s.name = value_as<std::string>(n["name"], where + ".name", "a scheduler name");
  if (s.name != "constant" && s.name != "linear" && s.name != "cosine" &&
      s.name != "cosine_warm_restart")
    throw bad(where + ".name", s.name,
              "use constant, linear, cosine or cosine_warm_restart (or composite above them)");
  // ClassyVision's schedulers assert their values are given: one left out (or misspelt) would
  // otherwise run the schedule from or to 0.
  const std::vector<const char*> needed =
      s.name == "constant" ? std::vector<const char*>{"value"}
                           : std::vector<const char*>{"start_value", "end_value"};
  for (const char* key : needed)
    if (!n[key])
      throw bad(where, ::swav::detail::text_of(n),
                std::string("a ") + s.name + " scheduler needs " +
                    (s.name == "constant" ? "value" : "start_value and end_value") +
                    " (ClassyVision's); " + key + " is missing");
  for (auto [key, value] :
       {std::pair{"start_value", &s.start_value}, std::pair{"end_value", &s.end_value},
        std::pair{"value", &s.value}, std::pair{"lr_multiplier", &s.lr_multiplier}})
    if (n[key]) *value = value_as<double>(n[key], where + "." + key, "a number");
  if (s.name == "cosine_warm_restart") {
    // (VISSL asserts both are given)
    if (!n["restart_interval_length"] || !n["wave_type"])
      throw bad(where, ::swav::detail::text_of(n),
                "cosine_warm_restart needs restart_interval_length (a fraction of its part) and "
                "wave_type (half or full)");
    s.restart_interval_length = value_as<double>(n["restart_interval_length"],
                                                 where + ".restart_interval_length", "a number");
    if (!(s.restart_interval_length > 0))
      throw bad(where + ".restart_interval_length", std::to_string(s.restart_interval_length),
                "must be > 0 (a fraction of the scheduler's part: 0.5 restarts once)");
    const auto wave = value_as<std::string>(n["wave_type"], where + ".wave_type", "half or full");
    if (wave != "half" && wave != "full") throw bad(where + ".wave_type", wave, "use half or full");
    s.full_wave = wave == "full";
    if (n["is_adaptive"])
      s.is_adaptive = value_as<bool>(n["is_adaptive"], where + ".is_adaptive", "True or False");
    if (s.is_adaptive && s.start_value == 0)
      throw bad(where + ".start_value", "0", "is_adaptive scales the peaks by start_value");
  }
  return s;
}

// i for an EfficientNet's feature block "block<i>" (decimal, no leading zero; past the int64
// range: its maximum), else -1.
inline std::int64_t feature_block_index(const std::string& layer) {
  if (layer.size() <= 5 || layer.rfind("block", 0) != 0 || (layer[5] == '0' && layer.size() > 6))
    return -1;
  std::uint64_t index = 0;
  const auto [end, error] = std::from_chars(layer.data() + 5, layer.data() + layer.size(), index);
  if (end != layer.data() + layer.size() || error == std::errc::invalid_argument) return -1;
  return error == std::errc::result_out_of_range ||
                 index > std::uint64_t(std::numeric_limits<std::int64_t>::max())
             ? std::numeric_limits<std::int64_t>::max()
             : static_cast<std::int64_t>(index);
}

// MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP (feature_eval.hpp); an empty list
// is the trunk's output, res5avg (VISSL's RegNet calls it avgpool: both names read).
inline std::vector<FeaturePool> read_feature_pools(const YAML::Node& list, const std::string& key) {
  const std::string form =
      "each entry is [layer, [op, args]]: a layer of res2, res3, res4, res5, res5avg (or "
      "avgpool; an EfficientNet's conv1, block<i>, conv_final) and an op "
      "of [\"Identity\", []], [\"AvgPool2d\", [[kh, kw], stride, padding]], "
      "[\"AdaptiveAvgPool2d\", [[oh, ow]]]";
  std::vector<FeaturePool> pools;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const YAML::Node e = list[i];
    const std::string where = key + "[" + std::to_string(i) + "]";
    if (!e.IsSequence() || e.size() != 2 || !e[1].IsSequence() || e[1].size() < 1 ||
        e[1].size() > 2)
      throw bad(where, ::swav::detail::text_of(e), form);
    FeaturePool p;
    p.layer = value_as<std::string>(e[0], where + "[0]", "a layer name");
    const std::vector<std::string> layers{"res2",    "res3",  "res4",       "res5",
                                          "res5avg", "conv1", "conv_final", "avgpool"};
    const bool block = feature_block_index(p.layer) >= 0;
    if (!block && std::find(layers.begin(), layers.end(), p.layer) == layers.end())
      throw bad(where + "[0]", p.layer,
                "not a trunk feature this trainer extracts; use res2, res3, res4, res5 or res5avg "
                "(avgpool: VISSL's RegNet name for res5avg), or an EfficientNet's conv1, "
                "block<i> or conv_final");
    for (const auto& other : pools)
      if (other.same_layer(p))
        throw bad(where + "[0]", p.layer, "given twice; give each layer once");
    const std::string op = value_as<std::string>(e[1][0], where + "[1][0]", "an op name");
    const YAML::Node args = e[1].size() == 2 ? e[1][1] : YAML::Node(YAML::NodeType::Sequence);
    const std::string args_where = where + "[1][1]";
    // Sizes up to 1024: far past any feature map here, and no overflow in the shape arithmetic.
    auto pair_of = [&](const YAML::Node& n, const char* what) {
      const auto v = value_as<std::vector<std::int64_t>>(n, args_where, what);
      if (v.size() != 2 || v[0] < 1 || v[1] < 1 || v[0] > 1024 || v[1] > 1024)
        throw bad(args_where, ::swav::detail::text_of(args), std::string("give ") + what);
      return std::array<std::int64_t, 2>{v[0], v[1]};
    };
    if (op == "Identity") {
      if (!args.IsSequence() || args.size() != 0)
        throw bad(args_where, ::swav::detail::text_of(args), "Identity takes []");
    } else if (op == "AvgPool2d") {
      p.op = FeaturePool::Op::avg_pool;
      if (!args.IsSequence() || args.size() < 1 || args.size() > 3)
        throw bad(args_where, ::swav::detail::text_of(args),
                  "AvgPool2d takes [[kh, kw], stride, padding] (stride defaults to the kernel)");
      p.kernel = pair_of(args[0], "a kernel [kh, kw] of integers from 1 to 1024");
      p.stride =
          args.size() > 1 ? value_as<std::int64_t>(args[1], args_where, "a stride") : p.kernel[0];
      p.padding = args.size() > 2 ? value_as<std::int64_t>(args[2], args_where, "a padding") : 0;
      if (args.size() == 1 && p.kernel[0] != p.kernel[1])
        throw bad(args_where, ::swav::detail::text_of(args),
                  "give the stride of a non-square kernel");
      if (p.stride < 1 || p.stride > 1024 || p.padding < 0 ||
          p.padding > std::min(p.kernel[0], p.kernel[1]) / 2)
        throw bad(args_where, ::swav::detail::text_of(args),
                  "stride must be from 1 to 1024 and padding from 0 to half the kernel (as "
                  "nn.AvgPool2d)");
    } else if (op == "AdaptiveAvgPool2d") {
      p.op = FeaturePool::Op::adaptive_avg_pool;
      if (!args.IsSequence() || args.size() != 1)
        throw bad(args_where, ::swav::detail::text_of(args), "AdaptiveAvgPool2d takes [[oh, ow]]");
      p.output = pair_of(args[0], "an output size [oh, ow] of integers from 1 to 1024");
    } else {
      throw bad(where + "[1][0]", op, "use Identity, AvgPool2d or AdaptiveAvgPool2d");
    }
    pools.push_back(p);
  }
  if (pools.empty()) pools.push_back(FeaturePool{});
  return pools;
}

// VISSL's get_scaled_lr_scheduler on one scheduler.
inline void scale_schedule(Schedule& s, double scaled) {
  if (s.name == "cosine" || s.name == "cosine_warm_restart") {  // (VISSL: "cosine" in the name)
    const double decay = s.end_value / s.start_value;
    s.start_value = scaled;
    s.end_value = scaled * decay;
  } else if (s.name == "linear") {
    s.end_value = scaled;
  } else {
    s.value = scaled;
  }
}

inline LrSchedule read_lr(const ConfigTree& c, int world, std::int64_t batch, int procs_per_node,
                          int nodes) {
  const std::string base = "OPTIMIZER.param_schedulers.lr";
  LrSchedule lr;
  const std::string name = c.get<std::string>(base + ".name");
  const std::string interval = c.get<std::string>(base + ".update_interval");
  if (interval != "step" && interval != "epoch")
    throw bad(base + ".update_interval", interval, "use step or epoch");
  lr.per_step = interval == "step";
  if (name == "composite") {
    const YAML::Node parts = c.at(base + ".schedulers");
    for (std::size_t i = 0; i < parts.size(); ++i)
      lr.parts.push_back(read_schedule(parts[i], base + ".schedulers[" + std::to_string(i) + "]"));
    lr.lengths = c.get<std::vector<double>>(base + ".lengths");
    const auto scaling = c.get<std::vector<std::string>>(base + ".interval_scaling");
    lr.rescaled.clear();
    for (const auto& s : scaling) {
      if (s != "rescaled" && s != "fixed")
        throw bad(base + ".interval_scaling", s, "use rescaled or fixed for each part");
      lr.rescaled.push_back(s == "rescaled");
    }
    if (lr.parts.empty() || lr.lengths.size() != lr.parts.size() ||
        lr.rescaled.size() != lr.parts.size())
      throw bad(base, ::swav::detail::text_of(c.at(base)),
                "a composite needs as many lengths and interval_scaling entries as schedulers");
    double total = 0;
    for (double l : lr.lengths) total += l;
    // (ClassyVision's tolerance, and its last length made up from the others)
    if (std::abs(total - 1.0) >= 1e-3)
      throw bad(base + ".lengths", ::swav::detail::text_of(c.at(base + ".lengths")),
                "the lengths must sum to 1");
    if (total != 1.0) lr.lengths.back() = 1.0 - (total - lr.lengths.back());
  } else {
    const YAML::Node single = c.at(base);
    lr.parts.push_back(read_schedule(single, base));
  }
  if (c.get<bool>(base + ".auto_lr_scaling.auto_scale")) {
    const double base_value = c.get<double>(base + ".auto_lr_scaling.base_value");
    const double base_batch = c.get<double>(base + ".auto_lr_scaling.base_lr_batch_size");
    const std::string type = c.get<std::string>(base + ".auto_lr_scaling.scaling_type");
    if (type != "linear" && type != "sqrt")
      throw bad(base + ".auto_lr_scaling.scaling_type", type, "use linear or sqrt");
    double factor = double(batch * world) / base_batch;
    if (type == "sqrt") factor = std::sqrt(factor);
    const double scaled = base_value * factor;
    for (const auto& p : lr.parts)
      if ((p.name == "cosine" || p.name == "cosine_warm_restart") && !(p.start_value > 0))
        throw bad(base + ".auto_lr_scaling.auto_scale", "True",
                  "a cosine part keeps its end / start ratio when scaled, and its start_value is " +
                      std::to_string(p.start_value) + "; give a start_value > 0");
    for (auto& p : lr.parts) scale_schedule(p, scaled);
    if (name == "composite") {
      // resolve_linear_schedule: every linear part is a warm-up from the per-node scaled rate
      // (computed as VISSL does, base x (batch / base batch): on one node it is then the scaled
      // rate itself, bit for bit); on one node the last that does not rise is dropped.
      const double start = base_value * (double(batch * procs_per_node) / base_batch);
      std::size_t drop = lr.parts.size();
      for (std::size_t i = 0; i < lr.parts.size(); ++i) {
        if (lr.parts[i].name != "linear") continue;
        lr.parts[i].start_value = start;
        if (nodes == 1 && start <= lr.parts[i].end_value) drop = i;
      }
      if (drop < lr.parts.size() && lr.parts.size() > 1) {
        const double freed = lr.lengths[drop];
        lr.parts.erase(lr.parts.begin() + static_cast<std::ptrdiff_t>(drop));
        lr.lengths.erase(lr.lengths.begin() + static_cast<std::ptrdiff_t>(drop));
        lr.rescaled.erase(lr.rescaled.begin() + static_cast<std::ptrdiff_t>(drop));
        for (auto& l : lr.lengths) l /= (1.0 - freed);
      }
      if (lr.parts.size() == 1) {
        lr.lengths = {1.0};
        lr.rescaled = {true};
      }
    }
  }
  // Every rate the schedule can give is finite and >= 0: checked here, by key, instead of by
  // the optimizer at the step that first reached a bad one, partway through the run.
  for (std::size_t i = 0; i < lr.parts.size(); ++i) {
    const Schedule& p = lr.parts[i];
    const std::string where =
        name == "composite" ? base + ".schedulers[" + std::to_string(i) + "]" : base;
    const auto ok = [](double v) { return std::isfinite(v) && v >= 0; };
    if (p.name == "constant" ? !ok(p.value) : !ok(p.start_value) || !ok(p.end_value))
      throw bad(where,
                p.name == "constant"
                    ? std::to_string(p.value)
                    : std::to_string(p.start_value) + " -> " + std::to_string(p.end_value),
                "learning rates must be finite and >= 0" +
                    std::string(c.get<bool>(base + ".auto_lr_scaling.auto_scale")
                                    ? " (after auto_lr_scaling)"
                                    : ""));
  }
  return lr;
}

// The name of MODEL.HEAD.PARAMS's first head ("" when the list has another form).
inline std::string first_head_name(const ConfigTree& c) {
  const YAML::Node heads = c.at("MODEL.HEAD.PARAMS");
  if (!heads.IsSequence() || heads.size() == 0 || !heads[0].IsSequence() || heads[0].size() == 0 ||
      !heads[0][0].IsScalar())
    return "";
  return heads[0][0].Scalar();
}

inline shardkit::optim::OptimizerConfig read_optimizer(const ConfigTree& c,
                                                       const std::string& base) {
  shardkit::optim::OptimizerConfig o;
  const std::string name = c.get<std::string>(base + ".name");
  // (sgd_fsdp: VISSL's SGD for FSDP; read_swav_config checks its stage)
  if (name != "sgd" && name != "sgd_fsdp")
    throw bad(base + ".name", name,
              "the SwAV trainer implements sgd (with use_larc for LARC) and VISSL's sgd_fsdp");
  o.sgd.momentum = c.get<float>(base + ".momentum");
  o.sgd.nesterov = c.get<bool>(base + ".nesterov");
  o.sgd.weight_decay = c.get<float>(base + ".weight_decay");
  if (c.get<bool>(base + ".use_larc")) {
    o.kind = shardkit::optim::OptimizerKind::larc_sgd;
    o.larc.clip = c.get<bool>(base + ".larc_config.clip");
    o.larc.eps = c.get<float>(base + ".larc_config.eps");
    o.larc.trust_coefficient = c.get<float>(base + ".larc_config.trust_coefficient");
  }
  return o;
}

// MODEL.TRUNK.EFFICIENT_NETS (NAME: efficientnet), as VISSL's efficientnet trunk reads it:
// ClassyVision's EfficientNet arguments, model_version naming B0 ... B7 (its widths, depths and
// dropout rate). Every problem is reported; false when there was one.
inline bool read_efficientnet(const ConfigTree& c, SwavConfig& s, ConfigProblems& problems) {
  const std::string k = "MODEL.TRUNK.EFFICIENT_NETS.";
  namespace nn = shardkit::nn;
  if (c.refused_exactly("MODEL.TRUNK.EFFICIENT_NETS")) return false;  // (not a map: reported)
  nn::EfficientNetOptions& o = s.efficientnet;
  bool ok = problems.attempt([&] {
    s.efficientnet_version = c.get<std::string>(k + "model_version");
    if (!nn::efficientnet_named_params(s.efficientnet_version, o.params))
      throw bad(k + "model_version",
                s.efficientnet_version.empty() ? "\"\"" : s.efficientnet_version,
                "name one of B0 ... B7 (VISSL's efficientnet configs: B0, B1, B2)");
  });
  ok &= problems.attempt([&] {
    o.bn_momentum = c.get<double>(k + "bn_momentum");
    if (!(o.bn_momentum >= 0 && o.bn_momentum <= 1))
      throw bad(k + "bn_momentum", text_of(c.at(k + "bn_momentum")),
                "must be in [0, 1] (VISSL's configs: 0.01)");
  });
  ok &= problems.attempt([&] {
    o.bn_epsilon = c.get<double>(k + "bn_epsilon");
    if (!(o.bn_epsilon > 0))
      throw bad(k + "bn_epsilon", text_of(c.at(k + "bn_epsilon")), "must be > 0 (VISSL's: 0.001)");
  });
  ok &= problems.attempt([&] {
    o.drop_connect_rate = c.get<double>(k + "drop_connect_rate");
    if (!(o.drop_connect_rate >= 0 && o.drop_connect_rate < 1))
      throw bad(k + "drop_connect_rate", text_of(c.at(k + "drop_connect_rate")),
                "must be in [0, 1): block i drops the branch of rate x i / blocks of the "
                "samples (VISSL's: 0.2; 0: no drop connect)");
  });
  ok &= problems.attempt([&] {
    o.width_divisor = c.get<std::int64_t>(k + "width_divisor");
    if (o.width_divisor < 1)
      throw bad(k + "width_divisor", text_of(c.at(k + "width_divisor")),
                "must be >= 1 (VISSL's: 8)");
  });
  ok &= problems.attempt([&] {
    // (null or 0: the width divisor, as ClassyVision's `min_width or width_divisor`)
    o.min_width = c.at(k + "min_width").IsNull() ? 0 : c.get<std::int64_t>(k + "min_width");
    if (o.min_width < 0)
      throw bad(k + "min_width", text_of(c.at(k + "min_width")),
                "must be >= 0, or null (0 and null: the width divisor; VISSL's: null)");
  });
  ok &= problems.attempt([&] { o.use_se = c.get<bool>(k + "use_se"); });
  return ok;
}

// MODEL.TRUNK.REGNET (NAME: regnet, or regnet_fsdp: VISSL's FSDP name for the same network), as
// VISSL's regnet trunk reads it: a registered model's `name` (VISSL then builds it from the name
// alone: the other keys are refused as unread), `name: anynet` with per-stage lists
// (ClassyVision's AnyNetParams), or RegNet's numbers (RegNetParams). Each problem is reported
// once: a key whose value the merge refused (it has its report) counts as not given, and the
// stages are not built from it. False when there was a problem.
inline bool read_regnet(const ConfigTree& c, SwavConfig& s, ConfigProblems& problems) {
  const std::string k = "MODEL.TRUNK.REGNET.";
  namespace nn = shardkit::nn;
  if (c.refused_exactly("MODEL.TRUNK.REGNET")) return false;  // (not a map: reported)
  const std::vector<std::string> numbers{"depth", "w_0",         "w_a",
                                         "w_m",   "group_width", "bottleneck_multiplier"};
  const std::vector<std::string> lists{"depths", "widths", "group_widths", "bottleneck_multipliers",
                                       "strides"};
  const std::vector<std::string> options{"stem_type", "stem_width", "block_type", "activation",
                                         "use_se",    "se_ratio",   "bn_epsilon", "bn_momentum"};
  const auto join_given = [&](const std::vector<std::vector<std::string>>& groups) {
    std::string given;
    for (const auto& keys : groups)
      for (const std::string& key : keys)
        if (c.given(k + key) && !c.refused(k + key)) given += (given.empty() ? "" : ", ") + key;
    return given;
  };
  const auto any_refused = [&](const std::vector<std::string>& keys) {
    return std::any_of(keys.begin(), keys.end(),
                       [&](const std::string& key) { return c.refused(k + key); });
  };
  const bool name_ok = !c.refused(k + "name");
  s.regnet_name = name_ok ? c.get<std::string>(k + "name") : std::string();
  if (name_ok && !s.regnet_name.empty() && s.regnet_name != "anynet") {
    // A registered model: ClassyVision's defaults for everything but its stages and SE. The
    // name and the keys given beside it are two problems, both reported.
    const bool alone = problems.attempt([&] {
      if (const std::string extra = join_given({numbers, lists, options}); !extra.empty())
        throw bad(k + "name", s.regnet_name,
                  "VISSL builds a registered RegNet from its name alone and does not read " +
                      extra + "; remove them, or the name");
    });
    return problems.attempt([&] {
      nn::RegNetParams params;
      bool se = true;
      if (!nn::regnet_named_params(s.regnet_name, params, se))
        throw bad(k + "name", s.regnet_name,
                  "not a RegNet this trainer knows; use one of ClassyVision's registered models (" +
                      nn::regnet_names() +
                      "), anynet with per-stage lists, or no name and RegNet's numbers (depth, "
                      "w_0, w_a, w_m, group_width)");
      s.regnet = nn::RegNetOptions{};
      s.regnet.use_se = se;
      s.regnet_stages = nn::regnet_stages(params);
    }) && alone;
  }
  // (each setting its own attempt: every bad one reported)
  bool ok = problems.attempt([&] {
    const std::string stem = c.get<std::string>(k + "stem_type");
    if (stem == "simple_stem_in")
      s.regnet.stem = nn::RegNetStem::simple_stem_in;
    else if (stem == "res_stem_in")
      s.regnet.stem = nn::RegNetStem::res_stem_in;
    else if (stem == "res_stem_cifar")
      s.regnet.stem = nn::RegNetStem::res_stem_cifar;
    else
      throw bad(k + "stem_type", stem,
                "use simple_stem_in (RegNet's 3 x 3 stride 2), res_stem_in (ResNet's 7 x 7 and "
                "max-pool) or res_stem_cifar (3 x 3 stride 1, for small images)");
  });
  ok &= problems.attempt([&] {
    s.regnet.stem_width = c.get<std::int64_t>(k + "stem_width");
    if (s.regnet.stem_width < 1)
      throw bad(k + "stem_width", std::to_string(s.regnet.stem_width), "must be >= 1 (RegNet: 32)");
  });
  ok &= problems.attempt([&] {
    const std::string block = c.get<std::string>(k + "block_type");
    if (block != "res_bottleneck_block")
      throw bad(k + "block_type", block,
                "this trainer builds res_bottleneck_block, every RegNetX's and RegNetY's; "
                "vanilla_block, res_basic_block and RegNetZ's res_bottleneck_linear_block it "
                "does not");
  });
  ok &= problems.attempt([&] {
    const std::string activation = c.get<std::string>(k + "activation");
    if (activation != "relu")
      throw bad(k + "activation", activation,
                "this trainer's RegNets use relu (RegNetZ's silu is not built here)");
  });
  ok &= problems.attempt([&] {
    // (ClassyVision: a se_ratio of 0 means no squeeze-and-excitation, as use_se False, which
    // leaves the ratio unread)
    s.regnet.se_ratio = c.get<double>(k + "se_ratio");
    s.regnet.use_se = c.get<bool>(k + "use_se") && s.regnet.se_ratio != 0;
    if (s.regnet.use_se && s.regnet.se_ratio < 0)
      throw bad(k + "se_ratio", std::to_string(s.regnet.se_ratio),
                "the squeeze width's share of a block's input width must be >= 0 (RegNetY: "
                "0.25; 0: no squeeze-and-excitation)");
  });
  ok &= problems.attempt([&] {
    s.regnet.bn_epsilon = c.get<double>(k + "bn_epsilon");
    if (!(s.regnet.bn_epsilon > 0))
      throw bad(k + "bn_epsilon", std::to_string(s.regnet.bn_epsilon),
                "must be > 0 (ClassyVision: 1e-05)");
  });
  ok &= problems.attempt([&] {
    s.regnet.bn_momentum = c.get<double>(k + "bn_momentum");
    if (!(s.regnet.bn_momentum >= 0 && s.regnet.bn_momentum <= 1))
      throw bad(k + "bn_momentum", std::to_string(s.regnet.bn_momentum),
                "must be in [0, 1] (ClassyVision: 0.1)");
  });
  if (!name_ok) return false;
  const bool anynet = s.regnet_name == "anynet";
  // The form's own problems: another form's keys beside it.
  ok &= problems.attempt([&] {
    if (anynet) {
      if (const std::string extra = join_given({numbers}); !extra.empty())
        throw bad(k + "name", "anynet",
                  "an AnyNet takes per-stage lists (depths, widths, group_widths, "
                  "bottleneck_multipliers, strides); remove " +
                      extra + ", RegNet's numbers, or name a RegNet");
    } else if (const std::string extra = join_given({lists}); !extra.empty()) {
      throw bad(k + "name", "\"\"",
                "per-stage lists (" + extra +
                    ") are an AnyNet's; add name: anynet, or give RegNet's numbers alone");
    }
  });
  // The stages, unless a value they are made of was refused (its report stands).
  if (any_refused(anynet ? lists : numbers)) return false;
  ok &= problems.attempt([&] {
    if (anynet) {
      std::vector<std::vector<double>> values;
      for (const std::string& key : lists) values.push_back(c.get<std::vector<double>>(k + key));
      const std::size_t count = values[0].size();
      for (std::size_t i = 0; i < lists.size(); ++i)
        if (values[i].empty() || values[i].size() != count)
          throw bad(k + lists[i], std::to_string(values[i].size()) + " entries",
                    "an AnyNet gives one entry a stage in each of depths, widths, group_widths, "
                    "bottleneck_multipliers and strides (depths has " +
                        std::to_string(count) + ")");
      s.regnet_stages.clear();
      for (std::size_t i = 0; i < count; ++i) {
        for (std::size_t j = 0; j < lists.size(); ++j)
          if (!(values[j][i] > 0) || (j != 3 && values[j][i] != std::floor(values[j][i])))
            throw bad(k + lists[j], text_of(c.at(k + lists[j])),
                      "stage " + std::to_string(i + 1) + "'s entry must be a positive " +
                          (j == 3 ? "number" : "whole number"));
        s.regnet_stages.push_back({static_cast<std::int64_t>(values[1][i]),
                                   static_cast<std::int64_t>(values[4][i]),
                                   static_cast<std::int64_t>(values[0][i]),
                                   static_cast<std::int64_t>(values[2][i]), values[3][i]});
      }
      return;
    }
    nn::RegNetParams params;
    params.depth = c.get<int>(k + "depth");
    params.w_0 = c.get<double>(k + "w_0");
    params.w_a = c.get<double>(k + "w_a");
    params.w_m = c.get<double>(k + "w_m");
    params.group_width = c.get<std::int64_t>(k + "group_width");
    params.bottleneck_multiplier = c.get<double>(k + "bottleneck_multiplier");
    if (join_given({{"depth", "w_0", "w_a", "w_m", "group_width"}}).empty())
      throw bad("MODEL.TRUNK.REGNET", "{}",
                "name a registered RegNet (e.g. name: regnet_y_400mf), or give depth, w_0, w_a, "
                "w_m and group_width (e.g. 16, 48, 27.89, 2.09, 8), or name: anynet with "
                "per-stage lists");
    try {
      s.regnet_stages = nn::regnet_stages(params);
    } catch (const shardkit::InvalidArgument& e) {
      throw ConfigError("config.MODEL.TRUNK.REGNET: " + std::string(e.what()));
    }
  });
  if (!ok) return false;
  // Each block as ClassyVision makes it: its grouped convolution, and its squeeze width.
  return problems.attempt([&] {
    std::int64_t in = s.regnet.stem_width;
    for (std::size_t i = 0; i < s.regnet_stages.size(); ++i) {
      const nn::RegNetStage& stage = s.regnet_stages[i];
      const std::int64_t width = nn::block_bottleneck(stage.width, stage.bottleneck_multiplier);
      const std::int64_t groups = nn::block_groups(width, stage.group_width);
      if (groups < 1 || width % groups != 0)
        throw bad(k + (anynet ? "group_widths" : "group_width"),
                  "stage " + std::to_string(i + 1) + " (bottleneck " + std::to_string(width) +
                      ", group width " + std::to_string(stage.group_width) + ")",
                  "the bottleneck's channels must split into bottleneck / group_width groups "
                  "of equal size; use a group width that divides it");
      for (const std::int64_t block_in : {in, stage.width})  // (the first block's, the rest's)
        if (s.regnet.use_se && nn::block_se_width(s.regnet.se_ratio, block_in) < 1)
          throw bad(k + "se_ratio", std::to_string(s.regnet.se_ratio),
                    "a block of " + std::to_string(block_in) +
                        " input channels would squeeze to none (se_ratio x input width rounds "
                        "to 0); use a larger se_ratio, or 0 for no squeeze-and-excitation");
      in = stage.width;
    }
  });
}

}  // namespace detail

// The ranks the config asks for: DISTRIBUTED.NUM_NODES x NUM_PROC_PER_NODE (a launcher's world
// size takes their place).
inline int configured_ranks(const ConfigTree& c) {
  const int nodes = c.get<int>("DISTRIBUTED.NUM_NODES");
  const int per_node = c.get<int>("DISTRIBUTED.NUM_PROC_PER_NODE");
  if (nodes < 1) throw detail::bad("DISTRIBUTED.NUM_NODES", std::to_string(nodes), "must be >= 1");
  if (per_node < 1)
    throw detail::bad("DISTRIBUTED.NUM_PROC_PER_NODE", std::to_string(per_node), "must be >= 1");
  return nodes * per_node;
}

// What the machine that will run a config offers. read_swav_config checks the config against it
// beside the config's own problems, so that one run names them all: MACHINE.DEVICE against the
// build and the GPU, and each split's data against the files and folders there. `probe_data`
// (the trainer's probe_split) refuses a split whose files or folder it cannot find, by path,
// and returns the images' channels where the source fixes them (0 where only decoding the
// images tells: an image folder's). Without a machine (a test reading configs) nothing outside
// the config is looked at.
struct Machine {
  bool cuda_build = false;  // the trainer was built with CUDA
  bool gpu = false;         // ... and a CUDA GPU answers
  std::function<std::int64_t(const DataSource&, const std::string& key)> probe_data;
};

namespace detail {

// The images' channels -- the two splits' and each Normalize's entries -- agree; a count of 0
// is not known (yet), a null transform list not read. Checked with the config where the sources
// fix the channels, and again once the images are loaded.
inline void check_channels(ConfigProblems& problems, std::int64_t train, std::int64_t test,
                           const MultiCropConfig* crops, const EvalTransform* eval) {
  if (train > 0 && test > 0)
    problems.attempt([&] {
      if (train != test)
        throw ConfigError("DATA.TRAIN's images have " + std::to_string(train) +
                          " channels and DATA.TEST's " + std::to_string(test) +
                          "; the network reads one kind (the kNN's memory bank is DATA.TRAIN's "
                          "images, its queries DATA.TEST's)");
    });
  if (train > 0 && crops != nullptr)
    problems.attempt([&] {
      if (!crops->mean.empty() && static_cast<std::int64_t>(crops->mean.size()) != train)
        throw ConfigError(
            "DATA.TRAIN.TRANSFORMS' Normalize has " + std::to_string(crops->mean.size()) +
            " mean/std entries but the images have " + std::to_string(train) +
            " channels; give one per channel (grey: Fashion-MNIST's [0.2860], "
            "[0.3530]; RGB: ImageNet's [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])");
    });
  if (test > 0 && eval != nullptr)
    problems.attempt([&] {
      if (!eval->mean.empty() && static_cast<std::int64_t>(eval->mean.size()) != test)
        throw ConfigError("DATA.TEST.TRANSFORMS' Normalize has " +
                          std::to_string(eval->mean.size()) +
                          " mean/std entries but the images have " + std::to_string(test) +
                          " channels; give one per channel");
    });
}

}  // namespace detail

// MODEL.TEMP_FROZEN_PARAMS_ITER_MAP's names (as read_swav_config leaves them) against the
// network's parameter names, all at once, when the network is built and before the run starts
// (a name that matched none would otherwise stop the first step).
inline void check_frozen_names(const std::vector<std::string>& parameters,
                               const std::vector<std::pair<std::string, std::int64_t>>& frozen) {
  std::string unknown;
  for (const auto& [name, iterations] : frozen) {
    if (std::find(parameters.begin(), parameters.end(), name) != parameters.end()) continue;
    const std::string nearest = detail::nearest_name(name, parameters);
    unknown += (unknown.empty() ? "'module." : ", 'module.") + name + "'" +
               (nearest.empty() ? "" : " (the nearest is 'module." + nearest + "')");
  }
  if (!unknown.empty())
    throw ConfigError("config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP names " + unknown +
                      ", which this network has no parameter of; the SwAV head's prototypes are "
                      "'module.heads.0.prototypes0.weight', the trunk's parameters "
                      "'module.trunk.layer1.0.conv1.weight' and the like");
}

// `world` is the number of ranks that will train (local ranks or the launcher's). Every part that
// can be read on its own is read in attempt(): its ConfigError is kept and the reading goes on
// (a part that needs another is read when that one was good), so that one run reports every
// problem of the config -- the merge's first, then the reader's and, given a `machine`, what the
// machine and the data refuse -- and one round of edits fixes it.
inline SwavConfig read_swav_config(const ConfigTree& c, int world,
                                   const Machine* machine = nullptr) {
  using shardkit::DType;
  using shardkit::parallel::Stage;
  ConfigProblems problems(c.problems());
  SwavConfig s;
  problems.attempt([&] {
    s.seed = c.get<std::uint64_t>("SEED_VALUE");
    s.log_frequency = c.get<int>("LOG_FREQUENCY");
    if (s.log_frequency < 1)
      throw detail::bad("LOG_FREQUENCY", std::to_string(s.log_frequency),
                        "must be >= 1 (a line every that many iterations)");
  });
  problems.attempt([&] { s.test_model = c.get<bool>("TEST_MODEL"); });
  // DATA.TEST and the kNN's own settings are read where the run tests -- not where TEST_MODEL
  // itself is refused either, whose default would add their problems to a config that may
  // mean False.
  const bool reads_test = s.test_model && !c.refused("TEST_MODEL");
  problems.attempt([&] {
    s.device = c.get<std::string>("MACHINE.DEVICE");
    if (s.device != "cpu" && s.device != "gpu" && s.device != "auto")
      throw detail::bad("MACHINE.DEVICE", s.device, "use cpu, gpu or auto");
    if (machine != nullptr && s.device == "gpu" && !(machine->cuda_build && machine->gpu))
      throw detail::bad("MACHINE.DEVICE", s.device,
                        machine->cuda_build
                            ? "this machine has no CUDA GPU; use cpu or auto"
                            : "this trainer was built without CUDA (scripts/setup builds the CPU "
                              "trainer on a machine without a GPU); on a GPU machine build one "
                              "with it (`meson setup build-gpu -Dcuda=enabled "
                              "-Dgpu_device_opt=full`, then `ninja -C build-gpu "
                              "samples/swav/swav`), or use cpu or auto");
  });
  problems.attempt([&] {
    // A YAML boolean in any spelling (True, false, on...), or auto.
    const YAML::Node graph = c.at("MACHINE.CUDA_GRAPH");
    bool on = false;
    s.cuda_graph =
        YAML::convert<bool>::decode(graph, on) ? (on ? "true" : "false") : graph.as<std::string>();
    if (s.cuda_graph != "true" && s.cuda_graph != "false" && s.cuda_graph != "auto")
      throw detail::bad("MACHINE.CUDA_GRAPH", s.cuda_graph, "use true, false or auto");
  });
  // Data
  std::int64_t channels[2] = {0, 0};  // TRAIN's, TEST's, where the machine's probe knows them
  bool data_ok[2] = {false, false};
  std::string train_kind;  // DATA.TRAIN's one source as given, refused or not ("": no one name)
  for (const char* split : {"TRAIN", "TEST"}) {
    const int i = split == std::string("TRAIN") ? 0 : 1;
    if (i == 1 && !reads_test) continue;  // (not read, as in VISSL: nor refused)
    data_ok[i] = problems.attempt([&] {
      const std::string k = std::string("DATA.") + split;
      DataSource& source = split == std::string("TRAIN") ? s.train_data : s.test_data;
      const auto sources = c.get<std::vector<std::string>>(k + ".DATA_SOURCES");
      if (i == 0 && sources.size() == 1) train_kind = sources[0];
      if (sources.size() != 1 || (sources[0] != "fashion_mnist" && sources[0] != "disk_folder" &&
                                  sources[0] != "synthetic"))
        throw detail::bad(k + ".DATA_SOURCES", detail::text_of(c.at(k + ".DATA_SOURCES")),
                          "give one source: [fashion_mnist] (Debian's dataset-fashion-mnist), "
                          "[disk_folder] (a folder of class subfolders of JPEG/PNG images) or "
                          "[synthetic] (generated images)");
      source.kind = sources[0];
      const auto paths = c.get<std::vector<std::string>>(k + ".DATA_PATHS");
      if (source.kind != "synthetic" && paths.size() != 1)
        throw detail::bad(k + ".DATA_PATHS", detail::text_of(c.at(k + ".DATA_PATHS")),
                          source.kind == "disk_folder"
                              ? "give one folder holding a subfolder of images per class"
                              : "give one folder holding the Fashion-MNIST .gz files");
      if (source.kind == "disk_folder" && !c.given(k + ".DATA_PATHS"))
        throw detail::bad(k + ".DATA_PATHS", "(not given: the default is Fashion-MNIST's folder)",
                          "give the folder holding a subfolder of images per class (VISSL finds "
                          "DATASET_NAMES' folders in its dataset catalog; this trainer reads "
                          "DATA_PATHS)");
      if (!paths.empty()) source.path = paths[0];
      source.limit = c.get<std::int64_t>(k + ".DATA_LIMIT");
      source.sampling_seed = c.get<std::uint64_t>(k + ".DATA_LIMIT_SAMPLING.SEED");
      // VISSL's synthetic source reads the train split's label count for both splits.
      source.synthetic_classes = c.get<std::int64_t>("DATA.TRAIN.RANDOM_SYNTHETIC_LABELS");
      source.synthetic_side = c.get<std::int64_t>(k + ".DEFAULT_GRAY_IMG_SIZE");
      if (source.kind == "synthetic" && source.limit < 1)
        throw detail::bad(k + ".DATA_LIMIT", std::to_string(source.limit),
                          "the synthetic source makes DATA_LIMIT images: set it >= 1");
      if (source.kind == "synthetic" && (source.synthetic_side < 4 || source.synthetic_side > 1024))
        throw detail::bad(k + ".DEFAULT_GRAY_IMG_SIZE", std::to_string(source.synthetic_side),
                          "the synthetic images' side: 4 .. 1024");
    });
  }
  problems.attempt([&] {  // (both splits read it: said once)
    const auto labels = c.get<std::int64_t>("DATA.TRAIN.RANDOM_SYNTHETIC_LABELS");
    if (labels < 0 || labels > sk::data::kMaxSyntheticClasses)
      throw detail::bad(
          "DATA.TRAIN.RANDOM_SYNTHETIC_LABELS", std::to_string(labels),
          "0 (every label 0) .. " + std::to_string(sk::data::kMaxSyntheticClasses) + " labels");
  });
  // The kNN evaluation's memory bank is DATA.TRAIN's images and its queries DATA.TEST's: a
  // config that trains on other images than the default's (Fashion-MNIST) and leaves DATA.TEST
  // out while it tests (TEST_MODEL: True) would be evaluated on another dataset's classes. Said
  // also when DATA.TRAIN's source is refused above (the edit is owed either way); the default
  // test split is then not probed: its files and channels are beside the point.
  const bool test_left_out = data_ok[1] && !train_kind.empty() &&
                             !c.given("DATA.TEST.DATA_SOURCES") && train_kind != s.test_data.kind;
  if (test_left_out)
    problems.attempt([&] {
      const bool known = train_kind == "disk_folder" || train_kind == "synthetic";
      throw ConfigError(
          "config.DATA.TEST is left at its default (" + s.test_data.kind +
          ") while DATA.TRAIN reads [" + train_kind +
          "]: the kNN evaluation queries DATA.TEST's images against a memory bank of "
          "DATA.TRAIN's, so both must be the same kind of images with the same classes; " +
          (!known ? std::string("give DATA.TEST the held-out images of DATA.TRAIN's kind")
           : train_kind == "disk_folder"
               ? std::string("set config.DATA.TEST.DATA_SOURCES=[disk_folder] and "
                             "config.DATA.TEST.DATA_PATHS=[a folder of held-out images in the "
                             "same class subfolders]")
               : "set config.DATA.TEST.DATA_SOURCES=[" + train_kind +
                     "] and config.DATA.TEST.DATA_LIMIT=<images to test with>") +
          ", or config.TEST_MODEL=False to train without the kNN evaluation");
    });
  // What the machine says of each split's data (its files and folders, its channels) -- not
  // of a split with a refused key, which would be the default's data in its place.
  if (machine != nullptr && machine->probe_data)
    for (int i = 0; i < 2; ++i)
      if (data_ok[i] && !(i == 1 && test_left_out) &&
          !c.refused(i == 0 ? "DATA.TRAIN" : "DATA.TEST"))
        problems.attempt([&] {
          channels[i] = machine->probe_data(i == 0 ? s.train_data : s.test_data,
                                            i == 0 ? "DATA.TRAIN" : "DATA.TEST");
        });
  const bool batch_ok = problems.attempt([&] {
    s.batch_size = c.get<std::int64_t>("DATA.TRAIN.BATCHSIZE_PER_REPLICA");
    if (s.batch_size < 1)
      throw detail::bad("DATA.TRAIN.BATCHSIZE_PER_REPLICA", std::to_string(s.batch_size),
                        "must be >= 1");
  });
  if (reads_test)
    problems.attempt([&] {
      s.test_batch_size = c.get<std::int64_t>("DATA.TEST.BATCHSIZE_PER_REPLICA");
      if (s.test_batch_size < 1)
        throw detail::bad("DATA.TEST.BATCHSIZE_PER_REPLICA", std::to_string(s.test_batch_size),
                          "must be >= 1 (the kNN evaluation's images per forward)");
    });
  problems.attempt([&] {
    if (!c.get<bool>("DATA.TRAIN.DROP_LAST"))
      throw detail::bad("DATA.TRAIN.DROP_LAST", "False",
                        "SwAV needs equal batches on every rank (distributed Sinkhorn); set True");
    if (c.get<std::string>("DATA.TRAIN.COLLATE_FUNCTION") != "multicrop_collator")
      throw detail::bad("DATA.TRAIN.COLLATE_FUNCTION",
                        c.get<std::string>("DATA.TRAIN.COLLATE_FUNCTION"),
                        "SwAV uses multicrop_collator");
    // VISSL's 0 loads in the main process; here one loader thread beside the training.
    s.workers = c.get<int>("DATA.NUM_DATALOADER_WORKERS");
    if (s.workers < 0)
      throw detail::bad("DATA.NUM_DATALOADER_WORKERS", std::to_string(s.workers),
                        "0 or more loader threads");
    s.workers = std::max(s.workers, 1);
  });
  const bool crops_ok = problems.attempt([&] { s.crops = detail::read_transforms(c); });
  const bool eval_ok =
      reads_test && problems.attempt([&] { s.eval_images = detail::read_test_transforms(c); });
  detail::check_channels(problems, channels[0], channels[1], crops_ok ? &s.crops : nullptr,
                         eval_ok ? &s.eval_images : nullptr);
  // Model
  std::int64_t trunk_out = 0;
  const std::string trunk_kind = c.get<std::string>("MODEL.TRUNK.NAME");
  // (regnet_fsdp: the network VISSL's FSDP set-up names so; this trainer wraps it alike)
  const bool regnet = trunk_kind == "regnet" || trunk_kind == "regnet_fsdp";
  bool regnet_ok = regnet && detail::read_regnet(c, s, problems);
  // (channels-last activations are the ResNets' alone)
  const auto refuse_channels_last = [&](const char* trunk) {
    return problems.attempt([&] {
      if (c.given("MODEL.TRUNK.RESNETS.CHANNELS_LAST") &&
          c.get<bool>("MODEL.TRUNK.RESNETS.CHANNELS_LAST"))
        throw detail::bad("MODEL.TRUNK.RESNETS.CHANNELS_LAST", "True",
                          std::string("channels-last activations are this trainer's ResNets' (") +
                              trunk + " runs NCHW); remove it");
    });
  };
  if (regnet) regnet_ok &= refuse_channels_last("a RegNet");
  if (regnet_ok) {
    s.trunk = "regnet";
    trunk_out = s.regnet_stages.back().width;
  }
  const bool efficientnet = trunk_kind == "efficientnet";
  bool efficientnet_ok = efficientnet && detail::read_efficientnet(c, s, problems);
  if (efficientnet) efficientnet_ok &= refuse_channels_last("an EfficientNet");
  if (efficientnet_ok) {
    s.trunk = "efficientnet";
    trunk_out = sk::nn::efficientnet_width(1280, s.efficientnet);
  }
  const bool trunk_ok =
      regnet_ok || efficientnet_ok || (!regnet && !efficientnet && problems.attempt([&] {
        if (trunk_kind != "resnet")
          throw detail::bad("MODEL.TRUNK.NAME", trunk_kind,
                            "this trainer builds resnet, regnet (or regnet_fsdp) and efficientnet "
                            "trunks (ClassyVision's RegNet and AnyNet: MODEL.TRUNK.REGNET; its "
                            "EfficientNet: MODEL.TRUNK.EFFICIENT_NETS)");
        s.depth = c.get<int>("MODEL.TRUNK.RESNETS.DEPTH");
        if (!sk::nn::is_resnet_depth(s.depth))
          throw detail::bad("MODEL.TRUNK.RESNETS.DEPTH", std::to_string(s.depth),
                            "use 18, 34, 50, 101 or 152");
        // ResNeXt: VISSL's GROUPS and WIDTH_PER_GROUP, torchvision's bottlenecks (a 3 x 3
        // convolution of GROUPS groups, planes x WIDTH_PER_GROUP / 64 channels each).
        s.groups = c.get<std::int64_t>("MODEL.TRUNK.RESNETS.GROUPS");
        if (s.groups < 1)
          throw detail::bad("MODEL.TRUNK.RESNETS.GROUPS", std::to_string(s.groups),
                            "use 1 (ResNet) or more (ResNeXt, e.g. 32)");
        s.width_per_group = c.get<std::int64_t>("MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP");
        if (s.width_per_group < 1)
          throw detail::bad("MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP",
                            std::to_string(s.width_per_group),
                            "use 64 (ResNet) or a ResNeXt's width, e.g. 4 for resnext50_32x4d");
        if (s.depth < 50 && (s.groups != 1 || s.width_per_group != 64))
          throw detail::bad(
              "MODEL.TRUNK.RESNETS.GROUPS",
              std::to_string(s.groups) + " (WIDTH_PER_GROUP " + std::to_string(s.width_per_group) +
                  ", DEPTH " + std::to_string(s.depth) + ")",
              "ResNeXt's grouped blocks are bottlenecks: use DEPTH 50, 101 or 152, or "
              "GROUPS 1 and WIDTH_PER_GROUP 64 (torchvision's basic blocks have no "
              "groups)");
        const double width = c.get<double>("MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER");
        s.base_channels = static_cast<std::int64_t>(std::lround(64 * width));
        if (s.base_channels < 1 || std::abs(64 * width - double(s.base_channels)) > 1e-9)
          throw detail::bad(
              "MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER", std::to_string(width),
              "64 x WIDTH_MULTIPLIER must be a whole number of channels (e.g. 0.125, 0.25, 1)");
        if (s.base_channels * s.width_per_group < 64)
          throw detail::bad("MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP",
                            std::to_string(s.width_per_group),
                            "the first stage's bottleneck would have no channels a group (" +
                                std::to_string(s.base_channels) +
                                " planes x WIDTH_PER_GROUP / 64 "
                                "rounds to 0); use WIDTH_PER_GROUP >= " +
                                std::to_string((64 + s.base_channels - 1) / s.base_channels) +
                                " or a larger WIDTH_MULTIPLIER");
        s.small_image_stem = c.get<bool>("MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM");
        s.zero_init_residual = c.get<bool>("MODEL.TRUNK.RESNETS.ZERO_INIT_RESIDUAL");
        s.channels_last = c.get<bool>("MODEL.TRUNK.RESNETS.CHANNELS_LAST");
        s.channel_blocks = c.get<bool>("MODEL.TRUNK.RESNETS.CHANNEL_BLOCKS");
        trunk_out = (s.depth >= 50 ? 32 : 8) * s.base_channels;  // (a bottleneck's 4 x 8 x base)
      }));
  if (trunk_ok)
    problems.attempt([&] {
      const YAML::Node heads = c.at("MODEL.HEAD.PARAMS");
      // (swav_head_fsdp: the name VISSL's FSDP set-up gives the same head)
      if (heads.size() != 1 || !heads[0].IsSequence() || heads[0].size() != 2 ||
          !heads[0][0].IsScalar() ||
          (heads[0][0].Scalar() != "swav_head" && heads[0][0].Scalar() != "swav_head_fsdp") ||
          !heads[0][1].IsMap())
        throw detail::bad("MODEL.HEAD.PARAMS", detail::text_of(heads),
                          "give one head: [[\"swav_head\", {\"dims\": [...], \"use_bn\": True, "
                          "\"num_clusters\": [K]}]]");
      const YAML::Node head = heads[0][1];
      for (const auto& kv : head) {
        const std::string key = detail::value_as<std::string>(kv.first, "MODEL.HEAD.PARAMS[0][1]",
                                                              "a map with string keys");
        if (key != "dims" && key != "use_bn" && key != "num_clusters" && key != "use_bias" &&
            key != "skip_last_bn")
          throw detail::bad("MODEL.HEAD.PARAMS[0][1]." + key, detail::text_of(kv.second),
                            "swav_head takes dims, use_bn, num_clusters, use_bias and "
                            "skip_last_bn here");
      }
      const auto dims = detail::value_as<std::vector<std::int64_t>>(
          head["dims"], "MODEL.HEAD.PARAMS[0][1].dims", "a list of integers");
      const auto clusters = detail::value_as<std::vector<std::int64_t>>(
          head["num_clusters"], "MODEL.HEAD.PARAMS[0][1].num_clusters", "a list of one integer");
      if (dims.size() < 2 || dims[0] != trunk_out)
        throw detail::bad("MODEL.HEAD.PARAMS[0][1].dims", detail::text_of(head["dims"]),
                          "give [trunk features, hidden widths (any number), embedding]; this "
                          "trunk gives " +
                              std::to_string(trunk_out) + " features");
      for (std::size_t i = 1; i < dims.size(); ++i)
        if (dims[i] < 1)
          throw detail::bad("MODEL.HEAD.PARAMS[0][1].dims", detail::text_of(head["dims"]),
                            "every width must be >= 1");
      if (clusters.size() != 1 || clusters[0] < 2)
        throw detail::bad("MODEL.HEAD.PARAMS[0][1].num_clusters",
                          detail::text_of(head["num_clusters"]),
                          "give one prototype count >= 2 (one set of prototypes)");
      s.head_in = dims.front();
      s.head_hidden.assign(dims.begin() + 1, dims.end() - 1);
      s.embedding_dim = dims.back();
      s.prototypes = clusters[0];
      const auto flag = [&](const char* key, bool otherwise) {
        return head[key]
                   ? detail::value_as<bool>(
                         head[key], std::string("MODEL.HEAD.PARAMS[0][1].") + key, "True or False")
                   : otherwise;
      };
      s.head_bn = flag("use_bn", true);
      s.head_bias = flag("use_bias", true);
      s.head_skip_last_bn = flag("skip_last_bn", true);
      s.bn_eps = c.get<double>("MODEL.HEAD.BATCHNORM_EPS");
      s.bn_momentum = c.get<double>("MODEL.HEAD.BATCHNORM_MOMENTUM");
    });
  problems.attempt([&] {
    // VISSL's FreezeParametersHook matches `module.` + the model's parameter names with
    // FairScale FSDP's wrapper parts taken out, against the map's keys read into a dict. So
    // only a key written `module.NAME` can match there; here NAME alone names the parameter
    // too, and so does FSDP's wrapped form (`_fsdp_wrapped_module.heads.0._fsdp_wrapped_module.
    // _fpw_module.prototypes0...`, which VISSL's own SwAV configs list beside the plain one and
    // which never matches in VISSL). Where one parameter is named in several forms the count of
    // the form VISSL matches holds -- `module.NAME`, else NAME, else the wrapped form -- and of
    // one form the later (the dict's rule).
    std::vector<int> rank;  // per s.frozen entry: 2 `module.NAME`, 1 NAME, 0 wrapped
    for (const auto& entry : c.at("MODEL.TEMP_FROZEN_PARAMS_ITER_MAP")) {
      if (!entry.IsSequence() || entry.size() != 2)
        throw detail::bad("MODEL.TEMP_FROZEN_PARAMS_ITER_MAP", detail::text_of(entry),
                          "each entry is ['module.heads.0.prototypes0.weight', iterations]");
      const std::string given = detail::value_as<std::string>(
          entry[0], "MODEL.TEMP_FROZEN_PARAMS_ITER_MAP", "[parameter name, iterations]");
      const std::int64_t iterations = detail::value_as<std::int64_t>(
          entry[1], "MODEL.TEMP_FROZEN_PARAMS_ITER_MAP", "[parameter name, iterations]");
      std::string name = given;
      for (const std::string part : {"_fsdp_wrapped_module.", "_fpw_module."})
        for (auto at = name.find(part); at != std::string::npos; at = name.find(part))
          name.erase(at, part.size());
      const bool wrapped = name != given;
      const bool prefixed = name.rfind("module.", 0) == 0;
      if (prefixed) name = name.substr(7);  // VISSL's DDP prefix
      const int form = wrapped ? 0 : prefixed ? 2 : 1;
      std::size_t i = 0;
      while (i < s.frozen.size() && s.frozen[i].first != name) ++i;
      if (i == s.frozen.size()) {
        s.frozen.emplace_back(name, iterations);
        rank.push_back(form);
      } else if (form >= rank[i]) {
        s.frozen[i].second = iterations;
        rank[i] = form;
      }
    }
  });
  problems.attempt([&] {
    // VISSL's SYNC_BN_CONFIG.GROUP_SIZE: > 0 that many ranks, 0 the whole world, -1 the ranks of
    // one node (NUM_PROC_PER_NODE). SYNC_BN_TYPE apex and pytorch compute the same statistics.
    if (c.get<bool>("MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN")) {
      const auto type = c.get<std::string>("MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE");
      if (type != "apex" && type != "pytorch")
        throw detail::bad("MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE", type, "use apex or pytorch");
      const int group = c.get<int>("MODEL.SYNC_BN_CONFIG.GROUP_SIZE");
      if (group < -1)
        throw detail::bad("MODEL.SYNC_BN_CONFIG.GROUP_SIZE", std::to_string(group),
                          "use a group size > 0, 0 for all ranks, or -1 for the ranks of a node");
      s.sync_bn_group = group > 0    ? std::min(group, world)
                        : group == 0 ? world
                                     : std::min(c.get<int>("DISTRIBUTED.NUM_PROC_PER_NODE"), world);
    }
  });
  problems.attempt([&] {
    if (c.get<bool>("MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING")) {
      const int splits =
          c.get<int>("MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS");
      // (0 or fewer would checkpoint nothing without a word, with the option asked for)
      if (splits < 1)
        throw detail::bad("MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS",
                          std::to_string(splits),
                          "USE_ACTIVATION_CHECKPOINTING is True: split the trunk into at least "
                          "1 segment (VISSL's default is 2)");
      s.checkpoint_splits = splits;
    }
  });
  const bool stage_ok = problems.attempt([&] {
    // Stage, as VISSL picks its task: OPTIMIZER.name zero or use_zero -> ZeRO-1; USE_SDP (which
    // sets the SDP task) -> ZeRO-2; AUTO_SETUP_FSDP (which sets the FSDP task) or
    // TRAINER.TASK_NAME self_supervision_fsdp_task -> ZeRO-3.
    const std::string opt_name = c.get<std::string>("OPTIMIZER.name");
    const bool zero = opt_name == "zero" || c.get<bool>("OPTIMIZER.use_zero");
    const bool auto_sdp = c.get<bool>("MODEL.SHARDED_DDP_SETUP.USE_SDP");
    const bool auto_fsdp = c.get<bool>("MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP");
    if (auto_sdp && auto_fsdp)
      throw detail::bad("MODEL.SHARDED_DDP_SETUP.USE_SDP", "True",
                        "choose SDP or FSDP (MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP), not both");
    const std::string task = auto_fsdp  ? "self_supervision_fsdp_task"
                             : auto_sdp ? "self_supervision_sdp_task"
                                        : c.get<std::string>("TRAINER.TASK_NAME");
    if (task != "self_supervision_task" && task != "self_supervision_fsdp_task" &&
        task != "self_supervision_sdp_task")
      throw detail::bad("TRAINER.TASK_NAME", task,
                        "use self_supervision_task, self_supervision_fsdp_task (FSDP) or "
                        "self_supervision_sdp_task (ShardedDDP, with OPTIMIZER.use_zero True)");
    // (VISSL's SDP task wraps only a ZeRO optimizer, past one rank; USE_SDP turns use_zero on)
    if (task == "self_supervision_sdp_task" && !zero && !auto_sdp && world > 1)
      throw detail::bad("TRAINER.TASK_NAME", task,
                        "ShardedDDP needs the ZeRO optimizer: set OPTIMIZER.use_zero True (or "
                        "MODEL.SHARDED_DDP_SETUP.USE_SDP True, which sets both)");
    s.parallel.stage = task == "self_supervision_fsdp_task"  ? Stage::fsdp
                       : task == "self_supervision_sdp_task" ? Stage::sdp
                       : zero                                ? Stage::oss
                                                             : Stage::ddp;
  });
  // VISSL's DDP task refuses a model that holds FSDP units (regnet_fsdp's blocks,
  // swav_head_fsdp) when it runs more than one rank; its SDP task cannot shard their optimizer.
  if (stage_ok && s.parallel.stage != Stage::fsdp && world > 1)
    for (const auto& named :
         {std::pair<std::string, std::string>{"MODEL.TRUNK.NAME", "regnet_fsdp"},
          std::pair<std::string, std::string>{"MODEL.HEAD.PARAMS[0][0]", "swav_head_fsdp"}})
      problems.attempt([&] {
        // (named's parts, not a structured binding: clang 14's lambdas cannot capture one)
        const std::string& key = named.first;
        const std::string& fsdp_name = named.second;
        const std::string given =
            key == "MODEL.TRUNK.NAME" ? c.get<std::string>(key) : detail::first_head_name(c);
        if (given == fsdp_name)
          throw detail::bad(key, fsdp_name,
                            "VISSL's " + fsdp_name +
                                " wraps itself in FSDP units, which VISSL trains only under the "
                                "FSDP task: set TRAINER.TASK_NAME self_supervision_fsdp_task (or "
                                "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP True), or use the name " +
                                fsdp_name.substr(0, fsdp_name.size() - 5));
      });
  const bool optimizer_ok = problems.attempt([&] {
    const std::string opt_name = c.get<std::string>("OPTIMIZER.name");
    s.optimizer =
        detail::read_optimizer(c, opt_name == "zero" ? "OPTIMIZER.base_optimizer" : "OPTIMIZER");
    s.regularize_bn = c.get<bool>("OPTIMIZER.regularize_bn");
    s.regularize_bias = c.get<bool>("OPTIMIZER.regularize_bias");
    // (VISSL's FSDP set-up turns construct_single_param_group_only on)
    s.single_param_group = c.get<bool>("MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP") ||
                           c.get<bool>("OPTIMIZER.construct_single_param_group_only");
    for (const auto& [name, iters] : s.frozen)
      if (iters > 0 && s.optimizer.kind != shardkit::optim::OptimizerKind::larc_sgd &&
          s.optimizer.sgd.weight_decay != 0)
        throw detail::bad("MODEL.TEMP_FROZEN_PARAMS_ITER_MAP", name,
                          "freezing zeroes the gradient, which equals VISSL's skip only under LARC "
                          "(no decay for a zero gradient) or without weight decay; set "
                          "OPTIMIZER.use_larc True or weight_decay 0");
  });
  if (stage_ok && optimizer_ok)
    problems.attempt([&] {
      const std::string opt_name = c.get<std::string>("OPTIMIZER.name");
      // LARC's norms as VISSL takes them. Its sgd_fsdp sums each parameter's squares over the
      // ranks: under fsdp (with flatten_parameters False) the norm of each sharded parameter --
      // this trainer's LARC; under ddp, where every rank holds the same parameters and gradients,
      // both norms sqrt(world) too large, which leaves only eps's weight changed (eps / sqrt(world)
      // here, so the arithmetic is VISSL's); under ZeRO the ranks' optimizers hold different
      // parameters, whose sums VISSL's all-reduce mixes. Apex's LARC (sgd) under FSDP takes the
      // norms of each rank's shard, and with flatten_parameters True either takes one norm per
      // flat unit: VISSL's AUTO_SETUP_FSDP sets sgd_fsdp and flatten_parameters False under LARC.
      const std::string name_key =
          opt_name == "zero" ? "OPTIMIZER.base_optimizer.name" : "OPTIMIZER.name";
      const std::string name = c.get<std::string>(name_key);
      const bool larc = s.optimizer.kind == shardkit::optim::OptimizerKind::larc_sgd;
      if (larc && name == "sgd_fsdp" && world > 1) {
        if (s.parallel.stage == Stage::oss || s.parallel.stage == Stage::sdp)
          throw detail::bad(name_key, "sgd_fsdp",
                            "VISSL's sgd_fsdp all-reduces the norms of the parameters each rank's "
                            "optimizer holds, which under ZeRO (stage " +
                                std::string(shardkit::parallel::stage_name(s.parallel.stage)) +
                                ") differ between ranks; use sgd");
        if (s.parallel.stage == Stage::ddp)
          s.optimizer.larc.eps /= static_cast<float>(std::sqrt(double(world)));
      }
      if (larc && s.parallel.stage == Stage::fsdp &&
          !c.get<bool>("MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP")) {
        const std::string fix =
            "this trainer's LARC takes each whole parameter's norms, as VISSL's sgd_fsdp with "
            "flatten_parameters False, which VISSL's AUTO_SETUP_FSDP sets under LARC: set "
            "OPTIMIZER.name sgd_fsdp and MODEL.FSDP_CONFIG.flatten_parameters False";
        if (c.get<bool>("MODEL.FSDP_CONFIG.flatten_parameters"))
          throw detail::bad("MODEL.FSDP_CONFIG.flatten_parameters", "True",
                            "under FSDP VISSL's LARC would take one norm per flat unit; " + fix);
        if (name == "sgd" && world > 1)
          throw detail::bad(
              name_key, "sgd",
              "under FSDP apex's LARC would take the norms of each rank's shard; " + fix);
      }
    });
  problems.attempt([&] {
    // (MODEL.FSDP_CONFIG.flatten_parameters changes nothing computed here -- a unit is always
    // one flat buffer -- but VISSL's LARC: checked with the optimizer)
    // (VISSL: > 0 wraps a block's convolutions of at least that many parameters; rank_setup.hpp)
    s.fsdp_wrap_threshold =
        std::max<std::int64_t>(0, c.get<std::int64_t>("MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD"));
    s.parallel.fsdp.reshard_after_forward = c.get<bool>("MODEL.FSDP_CONFIG.reshard_after_forward");
    s.parallel.fsdp.reshard_group_size = c.get<int>("MODEL.FSDP_CONFIG.reshard_group_size");
    if (const double mb = c.get<double>("MODEL.FSDP_CONFIG.bucket_cap_mb"); mb > 0)
      s.parallel.buckets.bucket_bytes = static_cast<std::size_t>(mb * (1 << 20));
  });
  if (stage_ok)
    problems.attempt([&] {
      // CPU offload as FairScale's FSDP takes it (VISSL passes these keys through): gradient shards
      // to the CPU and the optimizer's state and step there; parameter shards too.
      auto& offload = s.parallel.offload;
      offload.params = c.get<bool>("MODEL.FSDP_CONFIG.move_params_to_cpu");
      offload.optimizer = offload.params || c.get<bool>("MODEL.FSDP_CONFIG.move_grads_to_cpu");
      if (offload.enabled() && s.parallel.stage != Stage::fsdp)
        throw detail::bad(
            offload.params ? "MODEL.FSDP_CONFIG.move_params_to_cpu"
                           : "MODEL.FSDP_CONFIG.move_grads_to_cpu",
            "True",
            "CPU offload is an FSDP setting; set MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP True "
            "as well");
      // DeepSpeed ZeRO++'s qwZ and qgZ (not FairScale or VISSL keys): quantised parameter
      // gathers and gradient reductions.
      auto& fsdp = s.parallel.fsdp;
      fsdp.quantized_weights = c.get<bool>("MODEL.FSDP_CONFIG.quantized_weights");
      fsdp.quantized_grads = c.get<bool>("MODEL.FSDP_CONFIG.quantized_grads");
      auto read_format = [&](const std::string& key) {
        const auto name = c.get<std::string>(key);
        const auto format = shardkit::find_name(name, shardkit::ops::kQuantFormatNames);
        if (!format) throw detail::bad(key, name, "pass int8, f8_e4m3 or int4");
        return *format;
      };
      fsdp.quantized_weights_format = read_format("MODEL.FSDP_CONFIG.quantized_weights_format");
      fsdp.quantized_grads_format = read_format("MODEL.FSDP_CONFIG.quantized_grads_format");
      {
        const auto name = c.get<std::string>("MODEL.FSDP_CONFIG.quantized_weights_scale");
        const auto scale = shardkit::find_name(name, shardkit::ops::kQuantScaleNames);
        if (!scale)
          throw detail::bad("MODEL.FSDP_CONFIG.quantized_weights_scale", name,
                            "pass block or tensor");
        fsdp.quantized_weights_scale = *scale;
        if (*scale == shardkit::ops::QuantScale::tensor &&
            (!fsdp.quantized_weights ||
             fsdp.quantized_weights_format != shardkit::ops::QuantFormat::f8_e4m3))
          throw detail::bad("MODEL.FSDP_CONFIG.quantized_weights_scale", name,
                            "a scale per tensor is E4M3's; set MODEL.FSDP_CONFIG."
                            "quantized_weights True and quantized_weights_format f8_e4m3 as "
                            "well, or leave the scale at block");
      }
      fsdp.grad_error_feedback = c.get<bool>("MODEL.FSDP_CONFIG.grad_error_feedback");
      fsdp.quantization_block = c.get<std::int64_t>("MODEL.FSDP_CONFIG.quantization_block");
      for (const auto& [key, on] :
           {std::pair{"MODEL.FSDP_CONFIG.quantized_weights", fsdp.quantized_weights},
            std::pair{"MODEL.FSDP_CONFIG.quantized_grads", fsdp.quantized_grads}})
        if (on && s.parallel.stage != Stage::fsdp)
          throw detail::bad(key, "True",
                            "quantised collectives are an FSDP setting; set "
                            "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP True as well");
      if (fsdp.reshard_group_size != 0 && s.parallel.stage != Stage::fsdp)
        throw detail::bad("MODEL.FSDP_CONFIG.reshard_group_size",
                          std::to_string(fsdp.reshard_group_size),
                          "partial resharding is an FSDP setting; set "
                          "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP True as well");
      if (fsdp.grad_error_feedback && !fsdp.quantized_grads)
        throw detail::bad("MODEL.FSDP_CONFIG.grad_error_feedback", "True",
                          "error feedback carries qgZ's rounding; set "
                          "MODEL.FSDP_CONFIG.quantized_grads True as well");
      if ((fsdp.quantized_weights || fsdp.quantized_grads) &&
          (fsdp.quantization_block < 1 || fsdp.quantization_block > shardkit::ops::kMaxQuantBlock))
        throw detail::bad("MODEL.FSDP_CONFIG.quantization_block",
                          std::to_string(fsdp.quantization_block),
                          "pass 1 to 16777216 values per scale (DeepSpeed uses 256)");
      for (const auto& [key, on, format] :
           {std::tuple{"MODEL.FSDP_CONFIG.quantized_weights_format", fsdp.quantized_weights,
                       fsdp.quantized_weights_format},
            std::tuple{"MODEL.FSDP_CONFIG.quantized_grads_format", fsdp.quantized_grads,
                       fsdp.quantized_grads_format}})
        if (on && !shardkit::ops::quant_block_fits(format, fsdp.quantization_block))
          throw detail::bad(key, "int4",
                            "int4 packs two codes to a byte and a block must start on one; set "
                            "MODEL.FSDP_CONFIG.quantization_block to an even number (" +
                                std::to_string(fsdp.quantization_block) + " is odd)");
      if (fsdp.quantized_weights && offload.params)
        throw detail::bad("MODEL.FSDP_CONFIG.quantized_weights", "True",
                          "the parameter shards live on the host with move_params_to_cpu; set "
                          "one of them False");
    });
  if (stage_ok)
    problems.attempt([&] {
      // Precision (apex O1/O2 and PyTorch AMP keep f32 masters and scale the loss dynamically).
      if (c.get<bool>("MODEL.AMP_PARAMS.USE_AMP")) {
        const std::string level =
            detail::value_as<std::string>(c.at("MODEL.AMP_PARAMS.AMP_ARGS")["opt_level"],
                                          "MODEL.AMP_PARAMS.AMP_ARGS.opt_level", "O1 or O2");
        if (level != "O1" && level != "O2")
          throw detail::bad(
              "MODEL.AMP_PARAMS.AMP_ARGS.opt_level", level,
              "use O1 or O2 (f32 masters, f16 compute, dynamic loss scaling); O3 keeps "
              "no f32 masters, which shardkit does not do");
        const std::string dtype = c.get<std::string>("MODEL.AMP_PARAMS.COMPUTE_DTYPE");
        if (dtype != "float16" && dtype != "bfloat16")
          throw detail::bad("MODEL.AMP_PARAMS.COMPUTE_DTYPE", dtype, "use float16 or bfloat16");
        s.parallel.precision =
            shardkit::parallel::MixedPrecision::of(dtype == "float16" ? DType::f16 : DType::bf16);
        if (s.parallel.stage == Stage::fsdp && c.get<bool>("MODEL.FSDP_CONFIG.fp32_reduce_scatter"))
          s.parallel.precision.reduce_dtype = DType::f32;
        s.loss_scaling = dtype == "float16";
      }
    });
  // Loss
  problems.attempt([&] {
    if (c.get<std::string>("LOSS.name") != "swav_loss")
      throw detail::bad("LOSS.name", c.get<std::string>("LOSS.name"),
                        "this trainer trains swav_loss");
    if (!c.get<bool>("LOSS.swav_loss.normalize_last_layer"))
      throw detail::bad("LOSS.swav_loss.normalize_last_layer", "False",
                        "the prototypes are always re-normalised after each step here");
    s.loss.num_crops = s.crops.total_crops();
    s.loss.crops_for_assign = c.get<std::vector<int>>("LOSS.swav_loss.crops_for_assign");
    s.loss.temperature = c.get<double>("LOSS.swav_loss.temperature");
    s.loss.epsilon = c.get<double>("LOSS.swav_loss.epsilon");
    s.loss.num_iters = c.get<int>("LOSS.swav_loss.num_iters");
    s.loss.use_double_precision = c.get<bool>("LOSS.swav_loss.use_double_precision");
    s.loss.temp_hard_assignment_iters = c.get<int>("LOSS.swav_loss.temp_hard_assignment_iters");
    // (refused here, by key and with the others, not at the first step after the data loaded)
    const auto number = [](double v) {
      std::ostringstream out;
      out << v;
      return out.str();
    };
    if (s.loss.crops_for_assign.empty())
      throw detail::bad("LOSS.swav_loss.crops_for_assign", "[]",
                        "name the crops that assign codes, e.g. [0, 1] (the large crops)");
    for (const int crop : s.loss.crops_for_assign)
      if (crop < 0 || crop >= s.loss.num_crops)
        throw detail::bad("LOSS.swav_loss.crops_for_assign", std::to_string(crop),
                          "a crop index in [0, " + std::to_string(s.loss.num_crops) +
                              ") (DATA.TRAIN.TRANSFORMS' crops)");
    if (!(s.loss.temperature > 0) || !std::isfinite(s.loss.temperature))
      throw detail::bad("LOSS.swav_loss.temperature", number(s.loss.temperature),
                        "a positive number (VISSL's default is 0.1)");
    if (!(s.loss.epsilon > 0) || !std::isfinite(s.loss.epsilon))
      throw detail::bad("LOSS.swav_loss.epsilon", number(s.loss.epsilon),
                        "a positive number (VISSL's default is 0.05)");
    if (s.loss.num_iters < 1)
      throw detail::bad("LOSS.swav_loss.num_iters", std::to_string(s.loss.num_iters),
                        "at least 1 Sinkhorn iteration (VISSL's default is 3)");
    if (s.loss.temp_hard_assignment_iters < 0)
      throw detail::bad("LOSS.swav_loss.temp_hard_assignment_iters",
                        std::to_string(s.loss.temp_hard_assignment_iters), "0 or more");
  });
  if (batch_ok)
    problems.attempt([&] {
      s.loss.queue_start_iter = c.get<std::int64_t>("LOSS.swav_loss.queue.start_iter");
      s.loss.local_queue_length = local_queue_length(
          c.get<std::int64_t>("LOSS.swav_loss.queue.queue_length"), s.batch_size, world);
      s.queue_length = s.loss.local_queue_length * world;
    });
  // Optimizer, schedule
  problems.attempt([&] {
    s.num_epochs = c.get<int>("OPTIMIZER.num_epochs");
    if (s.num_epochs < 1)
      throw detail::bad("OPTIMIZER.num_epochs", std::to_string(s.num_epochs), "must be >= 1");
  });
  problems.attempt([&] { s.ranks = configured_ranks(c); });
  if (batch_ok)
    problems.attempt([&] {
      s.lr = detail::read_lr(c, world, s.batch_size, c.get<int>("DISTRIBUTED.NUM_PROC_PER_NODE"),
                             c.get<int>("DISTRIBUTED.NUM_NODES"));
    });
  // Checkpoints, evaluation, metrics
  problems.attempt([&] {
    s.checkpoint_dir = c.get<std::string>("CHECKPOINT.DIR");
    s.auto_resume = c.get<bool>("CHECKPOINT.AUTO_RESUME");
    s.overwrite_existing = c.get<bool>("CHECKPOINT.OVERWRITE_EXISTING");
    s.checkpoint_every_epochs = c.get<int>("CHECKPOINT.CHECKPOINT_FREQUENCY");
    s.checkpoint_every_iters = c.get<std::int64_t>("CHECKPOINT.CHECKPOINT_ITER_FREQUENCY");
    const std::string layout = c.get<std::string>("CHECKPOINT.LAYOUT");
    if (layout != "sharded" && layout != "consolidated")
      throw detail::bad("CHECKPOINT.LAYOUT", layout, "use sharded or consolidated");
    s.consolidated = layout == "consolidated";
  });
  // The kNN evaluation's settings, read where it runs; under TEST_MODEL: False what asks for an
  // evaluation is refused (each on its own, so that one report says both).
  problems.attempt([&] {
    s.knn_every_epochs = c.get<int>("NEAREST_NEIGHBOR.FREQUENCY");
    if (!s.test_model && s.knn_every_epochs > 0)
      throw detail::bad("NEAREST_NEIGHBOR.FREQUENCY", std::to_string(s.knn_every_epochs),
                        std::string(detail::kEvaluationOff) + "FREQUENCY 0");
  });
  problems.attempt([&] {
    s.export_dir = c.get<std::string>("NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS");
    if (!s.test_model && !s.export_dir.empty())
      throw detail::bad("NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS", s.export_dir,
                        std::string(detail::kEvaluationOff) + "EXPORT_EMBEDDINGS \"\"");
  });
  if (reads_test)
    problems.attempt([&] {
      s.knn_topk = c.get<int>("NEAREST_NEIGHBOR.TOPK");
      if (s.knn_topk < 1)
        throw detail::bad("NEAREST_NEIGHBOR.TOPK", std::to_string(s.knn_topk),
                          "use 1 or more neighbours (VISSL's benchmarks: 200; 20 is common)");
      s.knn_sigma = c.get<double>("NEAREST_NEIGHBOR.SIGMA");
      if (!(s.knn_sigma > 0))
        throw detail::bad("NEAREST_NEIGHBOR.SIGMA", std::to_string(s.knn_sigma),
                          "the vote's temperature must be > 0 (ours: 0.07, InstDisc's; "
                          "VISSL's default: 0.1)");
      if (!c.get<bool>("NEAREST_NEIGHBOR.L2_NORM_FEATS"))
        throw detail::bad("NEAREST_NEIGHBOR.L2_NORM_FEATS", "False",
                          "this trainer's kNN always compares L2-normalised features (cosine "
                          "similarity, as InstDisc's and SwAV's evaluations do); leave it True");
      s.knn_features = detail::read_feature_pools(
          c.at("MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP"),
          "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP");
      s.memory_bank_limit = c.get<std::int64_t>("NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT");
      if (s.memory_bank_limit == 0 || s.memory_bank_limit < -1)
        throw detail::bad("NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT", std::to_string(s.memory_bank_limit),
                          "give the number of training images in the kNN bank (1 or more), or -1 "
                          "for all of them");
      // (an EfficientNet's features are its children's, the others' have none of those names;
      // an EfficientNet that failed to read has its report, and its features are not judged)
      const bool efficientnet_kind = trunk_kind == "efficientnet";
      if (efficientnet_kind == (s.trunk == "efficientnet")) {
        const auto blocks = efficientnet_kind
                                ? std::int64_t(sk::nn::efficientnet_blocks(s.efficientnet).size())
                                : 0;
        const std::string names = "conv1, block0 ... block" + std::to_string(blocks - 1) +
                                  ", conv_final or avgpool (res5avg)";
        for (const FeaturePool& pool : s.knn_features) {
          if (efficientnet_kind && pool.stage() >= 0)
            throw detail::bad("MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP",
                              pool.layer,
                              "an EfficientNet has no stages res2 ... res5; name " + names +
                                  ", as VISSL's efficientnet trunk");
          if (pool.stage() == -2 && !efficientnet_kind)
            throw detail::bad("MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP",
                              pool.layer,
                              "a feature block of VISSL's EfficientNet; this " + trunk_kind +
                                  " trunk's are res2 ... res5 and res5avg");
          if (pool.stage() == -2 && detail::feature_block_index(pool.layer) >= blocks)
            throw detail::bad("MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP",
                              pool.layer,
                              "EfficientNet-" + s.efficientnet_version + " has " + names);
        }
      }
      // (a ResNet has every stage res2 ... res5 names; a RegNet or AnyNet may have fewer)
      if (s.trunk == "regnet")
        for (const FeaturePool& pool : s.knn_features)
          if (pool.stage() >= static_cast<int>(s.regnet_stages.size()))
            throw detail::bad(
                "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP", pool.layer,
                "the trunk has " + std::to_string(s.regnet_stages.size()) + " stages, res2 to res" +
                    std::to_string(s.regnet_stages.size() + 1) +
                    "; name one of those, or avgpool (res5avg: the pooled output)");
    });
  problems.attempt([&] {
    s.metrics_path = c.get<std::string>("METRICS.JSONL");
    if (s.metrics_path.empty()) s.metrics_path = s.checkpoint_dir + "/metrics.jsonl";
    s.plot_metrics = c.get<bool>("METRICS.PLOT");
    s.max_iterations = c.get<std::int64_t>("MAX_ITERATIONS");
  });
  problems.check();
  return s;
}

}  // namespace swav
