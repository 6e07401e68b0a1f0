// VISSL's configuration keys (the leaves under `config:` of vissl/config/defaults.yaml on VISSL's
// main branch, 599 of them) and what each one does in VISSL, in our words: the SwAV trainer
// quotes the meaning when a config sets a key that this trainer does not have, so that a VISSL
// user learns at once whether it matters (config_tree.hpp). The table is data, kept in
// vissl_keys.tsv (one line a key: PATH <tab> MEANING); the build writes it into
// vissl_keys_tsv.hpp as the string kVisslKeysTsv.
#pragma once

#include <map>
#include <sstream>
#include <string>
#include <string_view>

#include "vissl_keys_tsv.hpp"

namespace swav {

// A VISSL key this trainer accepts and ignores because it has no effect on what is trained here
// (logging, monitors, data-loader plumbing, evaluation tasks, other trunks and losses). `path` is
// a key, or every key of a section when it ends in ".*". `only`, when set, is the one value under
// which ignoring the key is right; another value asks for something this trainer does not do
// (TEST_ONLY: True would train nothing), which is a problem to report, not to ignore.
struct IgnoredVisslKey {
  std::string_view path;
  std::string_view only = {};
};

// clang-format off
inline constexpr IgnoredVisslKey kIgnoredVisslKeys[] = {
    // workflow switches and logging
    {"VERBOSE"}, {"TEST_ONLY", "False"}, {"TEST_EVERY_NUM_EPOCH"},
    {"MULTI_PROCESSING_METHOD"}, {"REPRODUCIBILITY.*"}, {"MONITORING.*"}, {"PROFILING.*"},
    {"HOOKS.CHECK_NAN"}, {"HOOKS.PERF_STATS.*"}, {"HOOKS.MEMORY_SUMMARY.*"}, {"HOOKS.LOG_GPU_STATS"},
    {"HOOKS.MODEL_COMPLEXITY.*"}, {"HOOKS.TENSORBOARD_SETUP.*"},
    {"HOOKS.EMA_MODEL.SAVE_EMA_MODEL", "False"}, {"HOOKS.EMA_MODEL.ENABLE_EMA_METERS", "False"},
    {"HOOKS.EMA_MODEL.*"},
    // data-loader plumbing: the trainer reads its own sources (DATA_SOURCES, DATA_PATHS)
    {"DATA.PIN_MEMORY"}, {"DATA.ENABLE_ASYNC_GPU_COPY"}, {"DATA.DDP_BUCKET_CAP_MB"},
    {"DATA.TRAIN.DATASET_NAMES"}, {"DATA.TRAIN.LABEL_TYPE"}, {"DATA.TRAIN.LABEL_SOURCES"},
    {"DATA.TRAIN.LABEL_PATHS"}, {"DATA.TRAIN.MMAP_MODE"}, {"DATA.TRAIN.COPY_TO_LOCAL_DISK", "False"},
    {"DATA.TRAIN.COPY_DESTINATION_DIR"}, {"DATA.TRAIN.REMOVE_IMG_PATH_PREFIX"},
    {"DATA.TRAIN.NEW_IMG_PATH_PREFIX"}, {"DATA.TRAIN.BASE_DATASET"}, {"DATA.TRAIN.INPUT_KEY_NAMES"},
    {"DATA.TRAIN.TARGET_KEY_NAMES"}, {"DATA.TRAIN.ENABLE_QUEUE_DATASET"},
    {"DATA.TRAIN.COLLATE_FUNCTION_PARAMS.*"},  // multicrop_collator's tensor packing only
    {"DATA.TRAIN.RANDOM_SYNTHETIC_IMAGES"},  // ours are always patterned noise (synthetic_images.hpp)
    // our sampler always resumes mid-epoch from the checkpoint's position, VISSL's stateful one;
    // False (start the epoch over) is refused rather than ignored
    {"DATA.TRAIN.USE_STATEFUL_DISTRIBUTED_SAMPLER", "True"},
    {"DATA.TEST.*"},
    // evaluation meters and tasks (the trainer's own kNN is NEAREST_NEIGHBOR's)
    {"METERS.*"}, {"EXTRACT_FEATURES.*"}, {"CLUSTERFIT.*"}, {"RANKING.*"}, {"SVM.*"},
    {"SVM_FEATURES_PATH"}, {"IMG_RETRIEVAL.*"}, {"LOW_SHOT_BENCHMARK.*"}, {"GEO_LOCALIZATION.*"},
    // model plumbing, other trunks and heads
    {"MODEL.BASE_MODEL_NAME"}, {"MODEL.CUDA_CACHE.*"}, {"MODEL.MULTI_INPUT_HEAD_MAPPING"},
    {"MODEL.TRUNK.RESNETS.STANDARDIZE_CONVOLUTIONS"}, {"MODEL.TRUNK.RESNETS.GROUPNORM_GROUPS"},
    {"MODEL.TRUNK.RESNETS.NORM", "BatchNorm"}, {"MODEL.TRUNK.RESNETS.LAYER4_STRIDE", "2"},
    {"MODEL.TRUNK.RESNETS_SK.*"}, {"MODEL.TRUNK.MOBILE_NET.*"},
    {"MODEL.TRUNK.REGNET.stage_checkpoints"}, {"MODEL.TRUNK.REGNET.stage_checkpointing"},
    {"MODEL.TRUNK.VISION_TRANSFORMERS.*"}, {"MODEL.TRUNK.XCIT.*"},
    {"MODEL.TRUNK.SWIN_TRANSFORMER.*"}, {"MODEL.TRUNK.BEIT.*"}, {"MODEL.TRUNK.CONVNEXT.*"},
    {"MODEL.TRUNK.CONVIT.*"}, {"MODEL.HEAD.PARAMS_MULTIPLIER"},
    {"MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON", "False"}, {"MODEL.FEATURE_EVAL_SETTINGS.*"},
    {"MODEL.WEIGHTS_INIT.PARAMS_FILE", ""}, {"MODEL.WEIGHTS_INIT.*"},
    // the other losses' settings (LOSS.name picks swav_loss)
    {"LOSS.CrossEntropyLoss.*"}, {"LOSS.cross_entropy_multiple_output_single_target.*"},
    {"LOSS.bce_logits_multiple_output_single_target.*"}, {"LOSS.nce_loss_with_memory.*"},
    {"LOSS.simclr_info_nce_loss.*"}, {"LOSS.multicrop_simclr_info_nce_loss.*"},
    {"LOSS.deepclusterv2_loss.*"}, {"LOSS.moco_loss.*"}, {"LOSS.barlow_twins_loss.*"},
    {"LOSS.dino_loss.*"}, {"LOSS.swav_momentum_loss.*"}, {"LOSS.msn_loss.*"}, {"LOSS.ibot_loss.*"},
    {"LOSS.dino_distillation_loss.*"}, {"LOSS.ibot_distillation_loss.*"},
    {"LOSS.msn_distillation_loss.*"}, {"LOSS.swav_distillation_loss.*"},
    // in VISSL's SwAV ablation configs (swav_8node_resnet_powerlaw*), read by no VISSL code
    {"LOSS.swav_loss.shk_powerlaw"},
    // optimizer plumbing that SGD with one parameter-group rule does not read
    {"OPTIMIZER.param_group_constructor"},
    {"OPTIMIZER.layer_wise_lr_decay.*"}, {"OPTIMIZER.betas"},
    {"OPTIMIZER.head_optimizer_params.use_different_lr", "False"},
    {"OPTIMIZER.head_optimizer_params.use_different_wd", "False"},
    {"OPTIMIZER.head_optimizer_params.*"}, {"OPTIMIZER.param_schedulers.lr_head.*"},
    // the train step, checkpoint and launcher plumbing
    {"TRAINER.TRAIN_STEP_NAME", "standard_train_step"},
    {"CHECKPOINT.APPEND_DISTR_RUN_ID"}, {"CHECKPOINT.BACKEND"},
    {"CHECKPOINT.LATEST_CHECKPOINT_RESUME_FILE_NUM"}, {"CHECKPOINT.USE_SYMLINK_CHECKPOINT_FOR_RESUME"},
    {"DISTRIBUTED.NCCL_DEBUG"}, {"DISTRIBUTED.NCCL_SOCKET_NTHREADS"},
    {"DISTRIBUTED.BROADCAST_BUFFERS"},
};
// clang-format on

// The rule for `path` (an exact key first, else the longest section), or nullptr.
inline const IgnoredVisslKey* ignored_vissl_key(std::string_view path) {
  const IgnoredVisslKey* best = nullptr;
  for (const auto& rule : kIgnoredVisslKeys) {
    if (rule.path == path) return &rule;
    if (rule.path.ends_with(".*")) {
      const std::string_view section = rule.path.substr(0, rule.path.size() - 1);  // "X."
      const bool inside =
          path.starts_with(section) || path == section.substr(0, section.size() - 1);
      if (inside && (best == nullptr || rule.path.size() > best->path.size())) best = &rule;
    }
  }
  return best;
}

// VISSL's meaning of key `path`, or empty when VISSL has no such key.
inline std::string_view vissl_meaning(const std::string& path) {
  static const std::map<std::string, std::string, std::less<>> meanings = [] {
    std::map<std::string, std::string, std::less<>> out;
    std::istringstream in(kVisslKeysTsv);
    for (std::string line; std::getline(in, line);) {
      const auto tab = line.find('\t');
      if (tab != std::string::npos) out.emplace(line.substr(0, tab), line.substr(tab + 1));
    }
    return out;
  }();
  const auto it = meanings.find(path);
  return it == meanings.end() ? std::string_view() : std::string_view(it->second);
}

}  // namespace swav
