// The SwAV trainer's configuration keys and their defaults, in VISSL's names and structure
// (vissl/config/defaults.yaml, the subset this trainer implements). Every key a config file or
// override may set is here; config_tree.hpp refuses others (VISSL keys without effect here are
// accepted and listed: vissl_keys.hpp). Keys marked "ours" are not VISSL's; docs/swav.md
// describes them.
//
// What a VISSL config leaves out means here what it means in VISSL: the network (the trunk's
// depth, width and ImageNet stem, a SwAV head on its features) and the optimizer (plain SGD
// unless use_larc, VISSL's weight decay, batch-norm parameters without it) default to VISSL's
// values (base_optimizer, which VISSL's defaults do not have, to OPTIMIZER's). What every SwAV
// config sets anyway -- crops, batch sizes, epochs, schedule -- defaults to a small run on a
// CPU, and the data to Fashion-MNIST; the shipped configs set the network and the optimizer.
#pragma once

namespace swav {

inline constexpr const char* kDefaultsYaml = R"yaml(
SEED_VALUE: 0
LOG_FREQUENCY: 10
TEST_MODEL: True                    # the kNN evaluations on DATA.TEST; False: none, DATA.TEST unread
MACHINE:
  DEVICE: auto                      # cpu | gpu | auto (ours: the GPU when built with CUDA and present)
  CUDA_GRAPH: auto                  # ours: capture the step once, replay it (auto: on a GPU where safe)
DATA:
  NUM_DATALOADER_WORKERS: 2         # per rank
  TRAIN:
    DATA_SOURCES: [fashion_mnist]     # fashion_mnist | disk_folder | synthetic
    DATA_PATHS: [/usr/share/datasets/fashion-mnist]
    DATA_LIMIT: -1
    DATA_LIMIT_SAMPLING:
      SEED: 0                       # disk_folder: the seed of the fixed shuffle of its files
    RANDOM_SYNTHETIC_LABELS: 0      # synthetic: labels i % N (0: all 0); both splits read this one
    DEFAULT_GRAY_IMG_SIZE: 224      # synthetic: the images' side
    BATCHSIZE_PER_REPLICA: 32
    DROP_LAST: True
    COLLATE_FUNCTION: multicrop_collator
    TRANSFORMS:
      - name: ImgPilToMultiCrop
        total_num_crops: 6
        size_crops: [24, 12]
        num_crops: [2, 4]
        crop_scales: [[0.14, 1], [0.05, 0.14]]
      - name: RandomHorizontalFlip
        p: 0.5
      - name: ImgPilColorDistortion
        strength: 1.0
      - name: ImgPilGaussianBlur
        p: 0.5
        radius_min: 0.1
        radius_max: 2.0
      - name: ToTensor
      - name: Normalize
        mean: [0.2860]
        std: [0.3530]
  TEST:
    DATA_SOURCES: [fashion_mnist]
    DATA_PATHS: [/usr/share/datasets/fashion-mnist]
    DATA_LIMIT: -1
    DATA_LIMIT_SAMPLING:
      SEED: 0
    DEFAULT_GRAY_IMG_SIZE: 224
    BATCHSIZE_PER_REPLICA: 256
    # The kNN evaluation's images: [] the whole image resized to the large crops' side and
    # normalised like them; else Resize (shorter side), CenterCrop and Normalize, torchvision's.
    TRANSFORMS: []
MODEL:
  TRUNK:
    NAME: resnet                    # resnet, regnet (ClassyVision's RegNet/AnyNet: REGNET) or
                                    # efficientnet (ClassyVision's EfficientNet: EFFICIENT_NETS)
    RESNETS:
      DEPTH: 50                     # 18, 34, 50, 101, 152
      WIDTH_MULTIPLIER: 1.0         # base channels = 64 x this (ours: fractions allowed)
      GROUPS: 1                     # ResNeXt (depth 50+): the 3 x 3 convolutions' groups
      WIDTH_PER_GROUP: 64           #   and their channels a group per 64 planes (32, 4: 32x4d)
      ZERO_INIT_RESIDUAL: False
      SMALL_IMAGE_STEM: False       # ours: 3x3 stride-1 stem without max-pool, for 28x28 images
      CHANNELS_LAST: False          # ours: activations NHWC on the CPU (docs/swav.md)
      CHANNEL_BLOCKS: True          # ours: activations in oneDNN's channel blocks on the CPU:
                                    # NCHW's kernels without its reorders (off when
                                    # CHANNELS_LAST; docs/swav.md)
    # NAME: regnet -- a registered model by name (regnet_y_400mf ... regnet_y_256gf,
    # regnet_x_400mf ... regnet_x_32gf); or RegNet's numbers (depth, w_0, w_a, w_m,
    # group_width, bottleneck_multiplier); or name: anynet with per-stage lists. The rest as
    # ClassyVision's RegNetParams/AnyNetParams.
    REGNET:
      name: ""
      depth: 0
      w_0: 0.0
      w_a: 0.0
      w_m: 0.0
      group_width: 0
      bottleneck_multiplier: 1.0
      depths: []
      widths: []
      group_widths: []
      bottleneck_multipliers: []
      strides: []
      stem_type: simple_stem_in     # simple_stem_in, res_stem_in, res_stem_cifar (small images)
      stem_width: 32
      block_type: res_bottleneck_block
      activation: relu
      use_se: True                  # RegNetY's squeeze-and-excitation (False: RegNetX)
      se_ratio: 0.25
      bn_epsilon: 1.0e-5
      bn_momentum: 0.1
    # NAME: efficientnet -- ClassyVision's EfficientNet B0 ... B7 (model_version), as VISSL's
    # efficientnet trunk builds it; features: conv1, block0 ..., conv_final, avgpool (res5avg).
    EFFICIENT_NETS:
      model_version: ""             # B0 ... B7: widths, depths and the features' dropout rate
      bn_momentum: 0.01
      bn_epsilon: 0.001
      drop_connect_rate: 0.2        # block i's branch dropped for rate x i / blocks of samples
      width_divisor: 8
      min_width: null               # null: the width divisor
      use_se: True
  HEAD:
    PARAMS: [["swav_head", {"dims": [2048, 2048, 128], "use_bn": True, "num_clusters": [3000]}]]
    BATCHNORM_EPS: 1.0e-5
    BATCHNORM_MOMENTUM: 0.1
  TEMP_FROZEN_PARAMS_ITER_MAP: []
  FEATURE_EVAL_SETTINGS:
    # The kNN's features: [] the trunk's output (res5avg); else [[layer, [op, args]], ...] with
    # layers res2-res5, res5avg (an EfficientNet's: conv1, block<i>, conv_final, avgpool) and
    # ops Identity, AvgPool2d, AdaptiveAvgPool2d, each evaluated (the first is the headline
    # figure).
    LINEAR_EVAL_FEAT_POOL_OPS_MAP: []
  SYNC_BN_CONFIG:
    CONVERT_BN_TO_SYNC_BN: False
    SYNC_BN_TYPE: pytorch
    GROUP_SIZE: -1
  AMP_PARAMS:
    USE_AMP: False
    AMP_TYPE: apex
    AMP_ARGS: {"opt_level": "O1", "keep_batchnorm_fp32": True, "master_weights": True, "loss_scale": "dynamic"}
    COMPUTE_DTYPE: float16          # ours: float16 (with dynamic loss scaling) or bfloat16
  ACTIVATION_CHECKPOINTING:
    USE_ACTIVATION_CHECKPOINTING: False
    NUM_ACTIVATION_CHECKPOINTING_SPLITS: 2
  SHARDED_DDP_SETUP:
    USE_SDP: False
    reduce_buffer_size: -1
  FSDP_CONFIG:
    AUTO_SETUP_FSDP: False
    AUTO_WRAP_THRESHOLD: 0
    AMP_TYPE: "01"
    FORCE_SYNC_CUDA: False
    flatten_parameters: True
    mixed_precision: True
    fp32_reduce_scatter: False
    compute_dtype: float32
    bucket_cap_mb: 0
    reshard_after_forward: True
    reshard_group_size: 0           # shardkit's: keep units sharded over a node after forward (hpZ)
    move_grads_to_cpu: False        # FairScale's: the optimizer's state and step on the CPU
    move_params_to_cpu: False       # FairScale's: the parameter shards too (implies the above)
    quantized_weights: False        # shardkit's: gather the parameters as int8 blocks (qwZ)
    quantized_weights_format: int8  # shardkit's: or f8_e4m3 (FSDP2's float8 gather), int4
    quantized_weights_scale: block  # shardkit's: or tensor (f8_e4m3: a scale per tensor)
    quantized_grads: False          # shardkit's: reduce the gradients as int8 blocks (qgZ)
    quantized_grads_format: int8    # shardkit's: or int4 (ZeRO++'s gradient width), f8_e4m3
    grad_error_feedback: False      # shardkit's: carry qgZ's rounding into the next step
    quantization_block: 256         # values per scale of those blocks
    clear_autocast_cache: True
    verbose: True
LOSS:
  name: swav_loss
  swav_loss:
    temperature: 0.1
    use_double_precision: False
    normalize_last_layer: True
    num_iters: 3
    epsilon: 0.05
    crops_for_assign: [0, 1]
    temp_hard_assignment_iters: 0
    embedding_dim: 128
    num_crops: 2
    num_prototypes: [3000]
    output_dir: .
    queue:
      queue_length: 0
      start_iter: 0
      local_queue_length: 0
OPTIMIZER:
  name: sgd
  use_zero: False
  use_larc: False
  larc_config:
    clip: False
    eps: 1.0e-8
    trust_coefficient: 0.001
  weight_decay: 1.0e-4
  momentum: 0.9
  nesterov: False
  num_epochs: 1
  regularize_bn: False
  regularize_bias: True
  construct_single_param_group_only: False  # True: one group, every parameter decayed
  base_optimizer:
    name: sgd
    use_larc: False
    larc_config: {clip: False, eps: 1.0e-8, trust_coefficient: 0.001}
    weight_decay: 1.0e-4
    momentum: 0.9
    nesterov: False
  param_schedulers:
    lr:
      auto_lr_scaling:
        auto_scale: False
        base_value: 0.3
        base_lr_batch_size: 256
        scaling_type: linear
      name: composite
      schedulers:
        - name: linear
          start_value: 0.03
          end_value: 0.3
        - name: cosine
          start_value: 0.3
          end_value: 0.0003
      interval_scaling: [rescaled, fixed]
      update_interval: step
      lengths: [0.1, 0.9]
      # VISSL's: what a single scheduler (lr: {name: cosine, ...}) leaves out
      start_value: 0.1
      end_value: 0.0
      value: 0.1
TRAINER:
  TASK_NAME: self_supervision_task  # _fsdp_task: FSDP (as AUTO_SETUP_FSDP); _sdp_task: SDP with ZeRO
DISTRIBUTED:
  BACKEND: nccl
  NUM_NODES: 1
  NUM_PROC_PER_NODE: 2              # local ranks as threads (ignored under mpirun / torchrun)
  INIT_METHOD: tcp
  RUN_ID: auto
  MANUAL_GRADIENT_REDUCTION: False
CHECKPOINT:
  DIR: ./swav_checkpoints
  AUTO_RESUME: True
  CHECKPOINT_FREQUENCY: 1           # epochs
  CHECKPOINT_ITER_FREQUENCY: -1     # iterations (-1: off)
  OVERWRITE_EXISTING: False
  LAYOUT: sharded                   # ours: sharded (a file per rank) | consolidated (one model file)
NEAREST_NEIGHBOR:
  TOPK: 200
  SIGMA: 0.07                       # ours: InstDisc's temperature (VISSL's default: 0.1)
  L2_NORM_FEATS: True               # ours: always (cosine similarity; VISSL's default False)
  FREQUENCY: 0                      # ours: every N epochs (0: at the end only)
  MEMORY_BANK_LIMIT: -1             # ours: first N training images as the memory bank (-1: all)
  EXPORT_EMBEDDINGS: ""             # ours: a folder for train/test embeddings as safetensors
METRICS:
  JSONL: ""                         # ours: metrics file (default: CHECKPOINT.DIR/metrics.jsonl)
  PLOT: True                        # ours: its curves as a PNG beside it at the end (matplotlib)
MAX_ITERATIONS: -1                  # ours: stop after this many iterations (-1: all epochs)
)yaml";

}  // namespace swav
