// VISSL's configuration keys (the leaves under `config:` of vissl/config/defaults.yaml on VISSL's
// main branch, 599 of them) and what each one does in VISSL, in our words: the SwAV trainer
// quotes the meaning when a config sets a key that this trainer does not have, so that a VISSL
// user learns at once whether it matters (config_tree.hpp). One line a key: PATH <tab> MEANING.
#pragma once

#include <map>
#include <sstream>
#include <string>
#include <string_view>

namespace swav {

inline constexpr const char* kVisslKeysTsv = R"tsv(
VERBOSE	Verbosity switch; declared in defaults but not read anywhere in VISSL's Python code at HEAD
LOG_FREQUENCY	Emit training log line (loss, lr, ETA, batch time) every N iterations
TEST_ONLY	Skip training; only run evaluation phases on DATA.TEST
TEST_MODEL	Whether evaluation phases on DATA.TEST are interleaved with training phases
TEST_EVERY_NUM_EPOCH	Insert an evaluation phase after every N train epochs (plus after the last)
SEED_VALUE	Base seed; per-rank RNG seed = (SEED_VALUE + rank) * num_epochs; stateful-sampler seed
MULTI_PROCESSING_METHOD	Python multiprocessing start method (forkserver/spawn/fork) for loader workers
REPRODUCIBILITY.CUDDN_DETERMINISTIC	Sets torch.backends.cudnn.deterministic for reproducible debugging runs
HOOKS.CHECK_NAN	Install a hook that aborts the run when the loss or model output becomes NaN/inf
HOOKS.EMA_MODEL.SAVE_EMA_MODEL	Keep (and checkpoint) an exponential-moving-average copy of the weights
HOOKS.EMA_MODEL.ENABLE_EMA_METERS	Also evaluate the meters on the EMA copy of the model
HOOKS.EMA_MODEL.UPDATE_ITER	Refresh the EMA weights every N iterations
HOOKS.EMA_MODEL.WARMUP	Fraction of total training after which EMA tracking begins
HOOKS.EMA_MODEL.DECAY	Decay factor of the weight EMA
HOOKS.EMA_MODEL.EMA_DEVICE	Device holding the EMA copy (gpu or cpu)
HOOKS.PERF_STATS.MONITOR_PERF_STATS	Time forward/backward/loss/data stages and log the breakdown
HOOKS.PERF_STATS.PERF_STAT_FREQUENCY	Print perf timings every N iterations (-1 = once per phase)
HOOKS.PERF_STATS.ROLLING_BTIME_FREQ	Window (iterations) for a rolling average batch time on rank 0 (-1 = off)
HOOKS.MEMORY_SUMMARY.PRINT_MEMORY_SUMMARY	Log torch.cuda.memory_summary() for memory profiling
HOOKS.MEMORY_SUMMARY.LOG_ITERATION_NUM	Iteration at which the CUDA memory summary is printed
HOOKS.MEMORY_SUMMARY.DUMP_MEMORY_ON_EXCEPTION	On an exception (e.g. OOM) dump the tensors still alive in memory
HOOKS.LOG_GPU_STATS	Log nvidia-smi output at training start and again at iteration 50 (primary rank)
HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY	Count FLOPs, parameters and activations with a dummy forward pass
HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE	C,H,W of the dummy input used for the complexity count
HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD	Write TensorBoard events (into <checkpoint dir>/tb_logs)
HOOKS.TENSORBOARD_SETUP.LOG_DIR	TensorBoard root dir; not read at HEAD (dir is derived from CHECKPOINT.DIR)
HOOKS.TENSORBOARD_SETUP.EXPERIMENT_LOG_DIR	TensorBoard sub-dir name; not read at HEAD (tb_logs is hard-coded)
HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN	Flush interval (minutes) of the TensorBoard writer
HOOKS.TENSORBOARD_SETUP.LOG_PARAMS	Write parameter histograms to TensorBoard
HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_GRADIENTS	Write gradient histograms to TensorBoard
HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS	Histogram logging period in iterations (-1 = only at epoch end)
MONITORING.MONITOR_ACTIVATION_STATISTICS	Log activation statistics every N iterations (0 = disabled)
PROFILING.START_ITERATION	Iteration at which the profiler is switched on
PROFILING.WARMUP_ITERATIONS	Profiler warm-up iterations before traces are recorded
PROFILING.NUM_ITERATIONS	How many iterations are profiled
PROFILING.STOP_TRAINING_AFTER_PROFILING	Exit the run once profiling has finished
PROFILING.OUTPUT_FOLDER	Where profiler traces are written
PROFILING.PROFILED_RANKS	Global ranks on which the profiler runs
PROFILING.MEMORY_PROFILING.TRACK_BY_LAYER_MEMORY	Trace per-layer memory use (activations and their grads) in fwd/bwd
PROFILING.RUNTIME_PROFILING.USE_PROFILER	Turn on the runtime (autograd/kineto) profiler
PROFILING.RUNTIME_PROFILING.PROFILE_CPU	Record CPU activity in the runtime profiler
PROFILING.RUNTIME_PROFILING.PROFILE_GPU	Record CUDA activity in the runtime profiler
PROFILING.RUNTIME_PROFILING.LEGACY_PROFILER	Use the old autograd profiler even if the kineto one exists
DATA.NUM_DATALOADER_WORKERS	DataLoader worker processes per training process
DATA.PIN_MEMORY	Use page-locked host memory for batches (faster H2D copies)
DATA.ENABLE_ASYNC_GPU_COPY	Wrap loader so the next batch is copied to GPU while the current one runs
DATA.DDP_BUCKET_CAP_MB	DistributedDataParallel gradient bucket size (MB)
DATA.TRAIN.USE_DEBUGGING_SAMPLER	Use a deterministic distributed sampler + seeded workers (debugging)
DATA.TRAIN.STRATIFIED_SAMPLER.ENABLED	Batch sampler drawing each batch from a limited set of classes
DATA.TRAIN.STRATIFIED_SAMPLER.CLASSES_PER_BATCH	Distinct classes per batch for the stratified sampler
DATA.TRAIN.STRATIFIED_SAMPLER.STEP_PER_EPOCH	Iterations per epoch produced by the stratified sampler
DATA.TRAIN.STRATIFIED_SAMPLER.UNIQUE_CLASSES	Give every rank a disjoint subset of the batch's classes
DATA.TRAIN.POWER_LAW_SAMPLER.ENABLED	Batch sampler that skews class frequencies along a power law
DATA.TRAIN.POWER_LAW_SAMPLER.POWER	Exponent of the power-law class distribution
DATA.TRAIN.USE_STATEFUL_DISTRIBUTED_SAMPLER	Sampler that can resume mid-epoch from a checkpointed iteration
DATA.TRAIN.DROP_LAST	Drop the last incomplete per-process batch of an epoch
DATA.TRAIN.REMOVE_IMG_PATH_PREFIX	Path prefix to strip from filelist image paths (disk_filelist only)
DATA.TRAIN.NEW_IMG_PATH_PREFIX	Replacement prefix for REMOVE_IMG_PATH_PREFIX
DATA.TRAIN.BASE_DATASET	Dataset wrapper class; only generic_ssl (GenericSSLDataset) in OSS
DATA.TRAIN.DATASET_NAMES	Catalog names, one per data source; paths come from dataset_catalog.json if DATA_PATHS empty
DATA.TRAIN.DATA_SOURCES	Reader per dataset: disk_folder, disk_filelist, synthetic, torchvision_dataset, ...
DATA.TRAIN.DATA_PATHS	Explicit data locations (folder root or .npy list), parallel to DATA_SOURCES
DATA.TRAIN.LABEL_SOURCES	Label reader per dataset (disk_folder, disk_filelist, synthetic...); empty = no labels
DATA.TRAIN.LABEL_PATHS	Explicit label locations (folder root or .npy), parallel to LABEL_SOURCES
DATA.TRAIN.LABEL_TYPE	standard / sample_index / zero; auto-set to sample_index if no LABEL_SOURCES (unless zero)
DATA.TRAIN.MMAP_MODE	Memory-map .npy filelists/label arrays instead of reading them fully into RAM
DATA.TRAIN.DEFAULT_GRAY_IMG_SIZE	Side of the gray placeholder image for unreadable files; also the synthetic image size
DATA.TRAIN.RANDOM_SYNTHETIC_IMAGES	synthetic source: blurred random-noise images instead of flat gray ones
DATA.TRAIN.RANDOM_SYNTHETIC_LABELS	synthetic source: number of distinct labels (i % N); 0 = all labels zero
DATA.TRAIN.BATCHSIZE_PER_REPLICA	Images per batch per process (global batch = this x world size)
DATA.TRAIN.TRANSFORMS	Ordered list of augmentation specs ({name: ..., args}) applied to each sample
DATA.TRAIN.COLLATE_FUNCTION	Name of the batch collator (default_collate, multicrop_collator, ...)
DATA.TRAIN.COLLATE_FUNCTION_PARAMS	Open map of kwargs passed to the collator
DATA.TRAIN.DATA_LIMIT	Use only this many samples (-1 = whole dataset)
DATA.TRAIN.DATA_LIMIT_SAMPLING.SEED	Seed of the random subset picked when DATA_LIMIT >= 0
DATA.TRAIN.DATA_LIMIT_SAMPLING.IS_BALANCED	Pick the DATA_LIMIT subset with equal samples per class
DATA.TRAIN.DATA_LIMIT_SAMPLING.SKIP_NUM_SAMPLES	Exclude this many samples before drawing the subset
DATA.TRAIN.COPY_TO_LOCAL_DISK	Read data from a local-disk copy (made by a copy step) if one exists
DATA.TRAIN.COPY_DESTINATION_DIR	Local directory holding that copy
DATA.TRAIN.INPUT_KEY_NAMES	Sample-dict key(s) used as model input
DATA.TRAIN.TARGET_KEY_NAMES	Sample-dict key(s) used as target
DATA.TRAIN.ENABLE_QUEUE_DATASET	Replace unreadable images by a previously seen valid image (not gray)
DATA.TEST.USE_DEBUGGING_SAMPLER	Use a deterministic distributed sampler + seeded workers (debugging) (test split)
DATA.TEST.STRATIFIED_SAMPLER.ENABLED	Batch sampler drawing each batch from a limited set of classes (test split)
DATA.TEST.STRATIFIED_SAMPLER.CLASSES_PER_BATCH	Distinct classes per batch for the stratified sampler (test split)
DATA.TEST.STRATIFIED_SAMPLER.STEP_PER_EPOCH	Iterations per epoch produced by the stratified sampler (test split)
DATA.TEST.STRATIFIED_SAMPLER.UNIQUE_CLASSES	Give every rank a disjoint subset of the batch's classes (test split)
DATA.TEST.POWER_LAW_SAMPLER.ENABLED	Batch sampler that skews class frequencies along a power law (test split)
DATA.TEST.POWER_LAW_SAMPLER.POWER	Exponent of the power-law class distribution (test split)
DATA.TEST.USE_STATEFUL_DISTRIBUTED_SAMPLER	Sampler that can resume mid-epoch from a checkpointed iteration (test split)
DATA.TEST.REMOVE_IMG_PATH_PREFIX	Path prefix to strip from filelist image paths (disk_filelist only) (test split)
DATA.TEST.NEW_IMG_PATH_PREFIX	Replacement prefix for REMOVE_IMG_PATH_PREFIX (test split)
DATA.TEST.DROP_LAST	Drop the last incomplete per-process batch of an epoch (test split)
DATA.TEST.DATA_SOURCES	Reader per dataset: disk_folder, disk_filelist, synthetic, torchvision_dataset, ...
DATA.TEST.DATA_PATHS	Explicit data locations (folder root or .npy list), parallel to DATA_SOURCES
DATA.TEST.LABEL_SOURCES	Label reader per dataset (disk_folder, disk_filelist, synthetic...); empty = no labels
DATA.TEST.LABEL_PATHS	Explicit label locations (folder root or .npy), parallel to LABEL_SOURCES (test split)
DATA.TEST.MMAP_MODE	Memory-map .npy filelists/label arrays instead of reading them fully into RAM
DATA.TEST.DEFAULT_GRAY_IMG_SIZE	Side of the gray placeholder image for unreadable files; also the synthetic image size
DATA.TEST.RANDOM_SYNTHETIC_IMAGES	synthetic source: blurred random-noise images instead of flat gray ones (test split)
DATA.TEST.RANDOM_SYNTHETIC_LABELS	Test-split copy; the synthetic source actually reads the DATA.TRAIN value
DATA.TEST.BATCHSIZE_PER_REPLICA	Images per batch per process (global batch = this x world size) (test split)
DATA.TEST.TRANSFORMS	Ordered list of augmentation specs ({name: ..., args}) applied to each sample
DATA.TEST.COLLATE_FUNCTION	Name of the batch collator (default_collate, multicrop_collator, ...) (test split)
DATA.TEST.COLLATE_FUNCTION_PARAMS	Open map of kwargs passed to the collator (test split)
DATA.TEST.DATA_LIMIT	Use only this many samples (-1 = whole dataset) (test split)
DATA.TEST.DATA_LIMIT_SAMPLING.SEED	Seed of the random subset picked when DATA_LIMIT >= 0 (test split)
DATA.TEST.DATA_LIMIT_SAMPLING.IS_BALANCED	Pick the DATA_LIMIT subset with equal samples per class (test split)
DATA.TEST.DATA_LIMIT_SAMPLING.SKIP_NUM_SAMPLES	Exclude this many samples before drawing the subset (test split)
DATA.TEST.BASE_DATASET	Dataset wrapper class; only generic_ssl (GenericSSLDataset) in OSS (test split)
DATA.TEST.DATASET_NAMES	Catalog names, one per data source; paths come from dataset_catalog.json if DATA_PATHS empty
DATA.TEST.COPY_TO_LOCAL_DISK	Read data from a local-disk copy (made by a copy step) if one exists (test split)
DATA.TEST.COPY_DESTINATION_DIR	Local directory holding that copy (test split)
DATA.TEST.LABEL_TYPE	standard / sample_index / zero for the test split; auto sample_index if no labels
DATA.TEST.INPUT_KEY_NAMES	Sample-dict key(s) used as model input (test split)
DATA.TEST.TARGET_KEY_NAMES	Sample-dict key(s) used as target (test split)
DATA.TEST.ENABLE_QUEUE_DATASET	Replace unreadable images by a previously seen valid image (not gray) (test split)
METERS.name	Deprecated single meter name; merged into METERS.names
METERS.names	Registered meters to compute (accuracy_list_meter, mean_ap_list_meter, ...)
METERS.enable_training_meter	Also compute meters on training batches
METERS.model_output_mask	Mask logits of classes absent from the test labels to -inf
METERS.accuracy_list_meter.num_meters	How many top-k accuracy meters (one per evaluated output/layer)
METERS.accuracy_list_meter.topk_values	k values reported by the top-k accuracy meter
METERS.accuracy_list_meter.meter_names	Display names of the top-k accuracy meters (auto for linear eval)
METERS.precision_at_k_list_meter.num_meters	How many precision@k meters (one per evaluated output/layer)
METERS.precision_at_k_list_meter.topk_values	k values reported by the precision@k meter
METERS.precision_at_k_list_meter.meter_names	Display names of the precision@k meters (auto for linear eval)
METERS.recall_at_k_list_meter.num_meters	How many recall@k meters (one per evaluated output/layer)
METERS.recall_at_k_list_meter.topk_values	k values reported by the recall@k meter
METERS.recall_at_k_list_meter.meter_names	Display names of the recall@k meters (auto for linear eval)
METERS.mean_ap_list_meter.num_classes	Number of classes for the mean-AP meter
METERS.mean_ap_list_meter.num_meters	How many mean-AP meters (one per evaluated output)
METERS.mean_ap_list_meter.max_cpu_capacity	Max samples buffered by the meter (-1 = unlimited); not read at HEAD
METERS.mean_ap_list_meter.meter_names	Display names of the mean-AP meters
MACHINE.DEVICE	gpu or cpu training
MODEL.BASE_MODEL_NAME	Registered model class wrapping trunk + heads
MODEL.CUDA_CACHE.CLEAR_CUDA_CACHE	Periodically call torch.cuda.empty_cache() to fight fragmentation OOMs
MODEL.CUDA_CACHE.CLEAR_FREQ	Iterations between cache clears
MODEL.NON_TRAINABLE_PARAMS	Parameter names excluded from the optimizer (never trained)
MODEL.TEMP_FROZEN_PARAMS_ITER_MAP	[[param_name, N], ...]: grads of param dropped until iteration N
MODEL.INPUT_TYPE	Channel layout fed to the trunk: rgb, bgr (channel flip) or lab (L only)
MODEL.MULTI_INPUT_HEAD_MAPPING	Map input keys to the trunk features/heads that consume them
MODEL.SINGLE_PASS_EVERY_CROP	Forward each crop separately instead of grouping crops by resolution
MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING	Recompute activations in backward to save memory
MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS	Number of checkpoint segments the trunk is cut into
MODEL.SHARDED_DDP_SETUP.USE_SDP	Use fairscale ShardedDDP (ZeRO-2) instead of DDP
MODEL.SHARDED_DDP_SETUP.reduce_buffer_size	Gradient reduce buffer size for ShardedDDP (-1 = default)
MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP	Switch to FullyShardedDataParallel and auto-fill related settings
MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD	Param-count threshold above which a layer gets its own FSDP wrap
MODEL.FSDP_CONFIG.AMP_TYPE	FSDP mixed-precision flavor (O1 / O2) used by the auto setup
MODEL.FSDP_CONFIG.FORCE_SYNC_CUDA	CUDA-synchronize between layers (debug FSDP memory; slows down)
MODEL.FSDP_CONFIG.flatten_parameters	fairscale FSDP option: flatten parameters into one buffer
MODEL.FSDP_CONFIG.mixed_precision	fairscale FSDP option: fp16 compute/communication
MODEL.FSDP_CONFIG.fp32_reduce_scatter	fairscale FSDP option: reduce-scatter gradients in fp32
MODEL.FSDP_CONFIG.compute_dtype	fairscale FSDP option: float32 or float16 compute dtype
MODEL.FSDP_CONFIG.bucket_cap_mb	fairscale FSDP option: reduce-scatter bucket size (MB)
MODEL.FSDP_CONFIG.clear_autocast_cache	fairscale FSDP option: clear autocast cache after forward
MODEL.FSDP_CONFIG.verbose	fairscale FSDP option: verbose repr
MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON	Benchmark/evaluation mode (frozen parts, feature extraction)
MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY	Freeze the trunk; train only the heads (linear eval)
MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD	Freeze both trunk and head
MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY	Output trunk features only (no head)
MODEL.FEATURE_EVAL_SETTINGS.EVAL_TRUNK_AND_HEAD	Load head weights too and evaluate the full model
MODEL.FEATURE_EVAL_SETTINGS.ASSERT_HEAD_LAYER_SHAPE_INIT	Require head weight shapes to match exactly when loading
MODEL.FEATURE_EVAL_SETTINGS.SHOULD_FLATTEN_FEATS	Flatten extracted features to N x D
MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP	[[layer, [pool_op, args]], ...]: layers to evaluate and their pooling
MODEL.GRAD_CLIP.USE_GRAD_CLIP	Clip the global gradient norm before the optimizer step
MODEL.GRAD_CLIP.NORM_TYPE	p of the norm used for clipping (2, inf, ...)
MODEL.GRAD_CLIP.MAX_NORM	Norm threshold for clipping
MODEL.TRUNK.NAME	Registered trunk name (resnet, regnet, efficientnet, vision_transformer, ...)
MODEL.TRUNK.RESNETS.DEPTH	ResNet depth: 18, 34, 50, 101, 152 or 200
MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER	Channel multiplier of the stem and all stages (w2, w4, w5 models)
MODEL.TRUNK.RESNETS.NORM	Norm layer: BatchNorm, LayerNorm or GroupNorm
MODEL.TRUNK.RESNETS.GROUPNORM_GROUPS	Group count when NORM is GroupNorm
MODEL.TRUNK.RESNETS.STANDARDIZE_CONVOLUTIONS	Weight-standardized convs flag; not read by any trunk at HEAD
MODEL.TRUNK.RESNETS.GROUPS	Grouped-conv cardinality (ResNeXt when > 1)
MODEL.TRUNK.RESNETS.ZERO_INIT_RESIDUAL	Zero-init the last BN gamma in each residual block
MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP	Channels per group in bottlenecks (64 = plain ResNet)
MODEL.TRUNK.RESNETS.LAYER4_STRIDE	Stride of the last stage (2 standard, 1 keeps resolution)
MODEL.TRUNK.RESNETS_SK.DEPTH	Depth of the SimCLR-v2 selective-kernel ResNet
MODEL.TRUNK.RESNETS_SK.WIDTH_MULTIPLIER	Width multiplier of the selective-kernel ResNet
MODEL.TRUNK.RESNETS_SK.SK_RATIO	Channel reduction ratio in the selective-kernel attention
MODEL.TRUNK.EFFICIENT_NETS	Open map of ClassyVision EfficientNet kwargs (model_version, bn_momentum...)
MODEL.TRUNK.MOBILE_NET.NAME	timm MobileNet variant name
MODEL.TRUNK.MOBILE_NET.TIMM_BN	Keep timm's own BatchNorm settings
MODEL.TRUNK.REGNET	Open map of RegNet kwargs (name, or depth/w_0/w_a/w_m/group_width...)
MODEL.TRUNK.VISION_TRANSFORMERS.name	Preset ViT name (vit_b_16, ...) overriding the fields below; empty = custom (written empty)
MODEL.TRUNK.VISION_TRANSFORMERS.IMAGE_SIZE	ViT input resolution
MODEL.TRUNK.VISION_TRANSFORMERS.PATCH_SIZE	ViT patch side in pixels
MODEL.TRUNK.VISION_TRANSFORMERS.NUM_LAYERS	Number of transformer blocks
MODEL.TRUNK.VISION_TRANSFORMERS.NUM_HEADS	Attention heads per block
MODEL.TRUNK.VISION_TRANSFORMERS.HIDDEN_DIM	Token embedding width
MODEL.TRUNK.VISION_TRANSFORMERS.MLP_DIM	Hidden width of the block MLP
MODEL.TRUNK.VISION_TRANSFORMERS.DROPOUT_RATE	Dropout in MLP and projections
MODEL.TRUNK.VISION_TRANSFORMERS.ATTENTION_DROPOUT_RATE	Dropout on attention weights
MODEL.TRUNK.VISION_TRANSFORMERS.CLASSIFIER	Pooling for the output; only the class token is supported
MODEL.TRUNK.VISION_TRANSFORMERS.DROP_PATH_RATE	Stochastic-depth rate (DeiT-style regularization)
MODEL.TRUNK.VISION_TRANSFORMERS.QKV_BIAS	Bias terms in the q/k/v projections
MODEL.TRUNK.VISION_TRANSFORMERS.QK_SCALE	Custom q.k scale; False = 1/sqrt(head_dim)
MODEL.TRUNK.VISION_TRANSFORMERS.CHECKPOINT_MLP	Activation-checkpoint each block's MLP
MODEL.TRUNK.VISION_TRANSFORMERS.CHECKPOINT_BLOCK	Activation-checkpoint whole blocks
MODEL.TRUNK.VISION_TRANSFORMERS.MASKED_IMAGE_MODELING.NAME	Masked-image-modeling variant: '' (off), ibot or msn
MODEL.TRUNK.VISION_TRANSFORMERS.MASKED_IMAGE_MODELING.PARAMS	Open map of kwargs for the mask generator
MODEL.TRUNK.XCIT.name	Preset XCiT name; empty = use the fields below (written empty)
MODEL.TRUNK.XCIT.IMAGE_SIZE	XCiT input resolution
MODEL.TRUNK.XCIT.PATCH_SIZE	XCiT patch side
MODEL.TRUNK.XCIT.HIDDEN_DIM	XCiT embedding width
MODEL.TRUNK.XCIT.NUM_LAYERS	XCiT block count
MODEL.TRUNK.XCIT.NUM_HEADS	XCiT heads per block
MODEL.TRUNK.XCIT.MLP_RATIO	XCiT MLP width as a multiple of HIDDEN_DIM
MODEL.TRUNK.XCIT.DROPOUT_RATE	XCiT MLP/projection dropout
MODEL.TRUNK.XCIT.ATTENTION_DROPOUT_RATE	XCiT attention dropout
MODEL.TRUNK.XCIT.DROP_PATH_RATE	XCiT stochastic-depth rate
MODEL.TRUNK.XCIT.ETA	XCiT LayerScale initial value
MODEL.TRUNK.XCIT.TOKENS_NORM	XCiT: normalize all tokens (not only CLS) in class-attention layers
MODEL.TRUNK.XCIT.QKV_BIAS	XCiT q/k/v bias
MODEL.TRUNK.XCIT.QK_SCALE	XCiT custom q.k scale (False = default)
MODEL.TRUNK.XCIT.CHECKPOINT_XCA_BLOCK	Activation-checkpoint XCA blocks
MODEL.TRUNK.XCIT.CHECKPOINT_ATTN_BLOCK	Activation-checkpoint class-attention blocks
MODEL.TRUNK.SWIN_TRANSFORMER.name	Preset Swin name; empty = use fields below (written empty)
MODEL.TRUNK.SWIN_TRANSFORMER.IMAGE_SIZE	Swin input resolution
MODEL.TRUNK.SWIN_TRANSFORMER.PATCH_SIZE	Swin patch side
MODEL.TRUNK.SWIN_TRANSFORMER.EMBED_DIM	Swin stage-1 embedding width
MODEL.TRUNK.SWIN_TRANSFORMER.DEPTHS	Blocks per Swin stage
MODEL.TRUNK.SWIN_TRANSFORMER.NUM_HEADS	Attention heads per Swin stage
MODEL.TRUNK.SWIN_TRANSFORMER.WINDOW_SIZE	Local attention window side
MODEL.TRUNK.SWIN_TRANSFORMER.MLP_RATIO	Swin MLP width multiple
MODEL.TRUNK.SWIN_TRANSFORMER.DROPOUT_RATE	Swin MLP/projection dropout
MODEL.TRUNK.SWIN_TRANSFORMER.ATTENTION_DROPOUT_RATE	Swin attention dropout
MODEL.TRUNK.SWIN_TRANSFORMER.DROP_PATH_RATE	Swin stochastic-depth rate
MODEL.TRUNK.SWIN_TRANSFORMER.QKV_BIAS	Swin q/k/v bias
MODEL.TRUNK.SWIN_TRANSFORMER.QK_SCALE	Swin custom q.k scale (False = default)
MODEL.TRUNK.BEIT.IMAGE_SIZE	BEiT input resolution
MODEL.TRUNK.BEIT.PATCH_SIZE	BEiT patch side
MODEL.TRUNK.BEIT.NUM_LAYERS	BEiT block count
MODEL.TRUNK.BEIT.NUM_HEADS	BEiT heads per block
MODEL.TRUNK.BEIT.HIDDEN_DIM	BEiT embedding width
MODEL.TRUNK.BEIT.MLP_RATIO	BEiT MLP width multiple
MODEL.TRUNK.BEIT.DROPOUT_RATE	BEiT MLP/projection dropout
MODEL.TRUNK.BEIT.ATTENTION_DROPOUT_RATE	BEiT attention dropout
MODEL.TRUNK.BEIT.DROP_PATH_RATE	BEiT stochastic-depth rate
MODEL.TRUNK.BEIT.QKV_BIAS	BEiT q/k/v bias
MODEL.TRUNK.BEIT.QK_SCALE	BEiT custom q.k scale (False = default)
MODEL.TRUNK.BEIT.USE_ABS_POS_EMB	BEiT: learned absolute position embeddings
MODEL.TRUNK.BEIT.USE_REL_POS_BIAS	BEiT: per-block relative position bias
MODEL.TRUNK.BEIT.USE_SHARED_REL_POS_BIAS	BEiT: one relative position bias shared by all blocks
MODEL.TRUNK.BEIT.USE_MEAN_POOLING	BEiT: average patch tokens instead of using the class token
MODEL.TRUNK.BEIT.INIT_VALUES	BEiT LayerScale init value (False = no LayerScale)
MODEL.TRUNK.CONVNEXT.DEPTH	ConvNeXt blocks per stage
MODEL.TRUNK.CONVNEXT.DIMS	ConvNeXt channel width per stage
MODEL.TRUNK.CONVNEXT.DROP_PATH_RATE	ConvNeXt stochastic-depth rate
MODEL.TRUNK.CONVIT.N_GPSA_LAYERS	ConViT: how many leading blocks use gated positional self-attention
MODEL.TRUNK.CONVIT.CLASS_TOKEN_IN_LOCAL_LAYERS	ConViT: feed the class token into the GPSA blocks too
MODEL.TRUNK.CONVIT.LOCALITY_STRENGTH	ConViT: sharpness of the initial positional attention (alpha)
MODEL.TRUNK.CONVIT.LOCALITY_DIM	ConViT: size of the relative positional encoding
MODEL.TRUNK.CONVIT.USE_LOCAL_INIT	ConViT: initialize GPSA to mimic convolutions
MODEL.HEAD.PARAMS	List of [head_name, kwargs] (or lists of them) stacked on the trunk output
MODEL.HEAD.BATCHNORM_EPS	eps of BatchNorm1d layers inside mlp/swav heads
MODEL.HEAD.BATCHNORM_MOMENTUM	momentum of BatchNorm1d layers inside mlp/swav heads
MODEL.HEAD.PARAMS_MULTIPLIER	Scale factor applied to the head's initial weights (mlp heads)
MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN	Replace BatchNorm by synchronized BatchNorm across GPUs
MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE	SyncBN implementation: apex or pytorch
MODEL.SYNC_BN_CONFIG.GROUP_SIZE	GPUs per SyncBN group (-1 = GPUs per node, 0 = all ranks)
MODEL.AMP_PARAMS.USE_AMP	Enable automatic mixed precision
MODEL.AMP_PARAMS.AMP_ARGS	Open map passed to apex amp.initialize (opt_level etc.)
MODEL.AMP_PARAMS.AMP_TYPE	AMP backend: apex or pytorch
MODEL.WEIGHTS_INIT.PARAMS_FILE	Checkpoint (path or URL) used to initialize the model
MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME	Key under which the state dict sits in that file ('' = top level)
MODEL.WEIGHTS_INIT.SKIP_LAYERS	Substrings of param names not copied from the checkpoint
MODEL.WEIGHTS_INIT.REMOVE_PREFIX	Prefix stripped from checkpoint keys before loading
MODEL.WEIGHTS_INIT.APPEND_PREFIX	Prefix prepended to checkpoint keys (e.g. trunk._feature_blocks.)
LOSS.name	Which loss is built; names a PyTorch loss or a VISSL-registered one
LOSS.CrossEntropyLoss.ignore_index	nn.CrossEntropyLoss kwarg: target value to ignore
LOSS.cross_entropy_multiple_output_single_target.weight	Per-class weights (null = uniform)
LOSS.cross_entropy_multiple_output_single_target.reduction	Reduction over the batch (mean/sum/none)
LOSS.cross_entropy_multiple_output_single_target.ignore_index	Target value ignored by the loss
LOSS.cross_entropy_multiple_output_single_target.normalize_output	L2-normalize logits before the loss
LOSS.cross_entropy_multiple_output_single_target.temperature	Divide logits by this before softmax
LOSS.bce_logits_multiple_output_single_target.reduction	BCE-with-logits reduction
LOSS.bce_logits_multiple_output_single_target.world_size	Filled in from DISTRIBUTED at startup
LOSS.bce_logits_multiple_output_single_target.normalize_output	L2-normalize outputs before BCE
LOSS.nce_loss_with_memory.loss_type	nce or cross_entropy (InfoNCE) formulation
LOSS.nce_loss_with_memory.norm_embedding	L2-normalize embeddings
LOSS.nce_loss_with_memory.temperature	Softmax temperature
LOSS.nce_loss_with_memory.loss_weights	Weights of each pair term
LOSS.nce_loss_with_memory.norm_constant	NCE normalization constant (-1 = estimate it)
LOSS.nce_loss_with_memory.update_mem_with_emb_index	Which embedding updates the memory bank (-100 = default)
LOSS.nce_loss_with_memory.negative_sampling_params.num_negatives	Negatives drawn from the memory bank
LOSS.nce_loss_with_memory.negative_sampling_params.type	How negatives are drawn (random)
LOSS.nce_loss_with_memory.memory_params.memory_size	Memory bank rows (-1 = dataset size)
LOSS.nce_loss_with_memory.memory_params.embedding_dim	Memory bank embedding width
LOSS.nce_loss_with_memory.memory_params.momentum	Momentum of memory bank updates
LOSS.nce_loss_with_memory.memory_params.norm_init	Normalize the random initial memory
LOSS.nce_loss_with_memory.memory_params.update_mem_on_forward	Update the bank during the forward call
LOSS.nce_loss_with_memory.num_train_samples	Dataset size, auto-filled before building the loss
LOSS.simclr_info_nce_loss.temperature	SimCLR softmax temperature
LOSS.simclr_info_nce_loss.buffer_params.world_size	Auto-filled world size
LOSS.simclr_info_nce_loss.buffer_params.embedding_dim	Projection output width
LOSS.simclr_info_nce_loss.buffer_params.effective_batch_size	Auto-filled: 2 x batch per GPU x world size
LOSS.multicrop_simclr_info_nce_loss.temperature	Multi-crop SimCLR temperature
LOSS.multicrop_simclr_info_nce_loss.num_crops	Crops per image, auto-filled from the multicrop transform
LOSS.multicrop_simclr_info_nce_loss.buffer_params.world_size	World size used for gathering
LOSS.multicrop_simclr_info_nce_loss.buffer_params.embedding_dim	Projection output width
LOSS.multicrop_simclr_info_nce_loss.buffer_params.effective_batch_size	Auto-filled: batch per GPU x world size
LOSS.swav_loss.embedding_dim	Projection width; auto-set from the last entry of the swav_head dims
LOSS.swav_loss.temperature	Temperature of the softmax over prototype scores
LOSS.swav_loss.use_double_precision	Run Sinkhorn-Knopp in float64
LOSS.swav_loss.normalize_last_layer	L2-normalize prototype vectors after every optimizer update
LOSS.swav_loss.num_iters	Sinkhorn-Knopp iterations per assignment
LOSS.swav_loss.epsilon	Entropy regularization of the Sinkhorn assignment (codes = exp(s/eps))
LOSS.swav_loss.num_crops	Total crops per image; auto-set from ImgPilToMultiCrop.total_num_crops
LOSS.swav_loss.crops_for_assign	Indices of crops whose codes are computed and predicted by the others
LOSS.swav_loss.num_prototypes	Prototype counts per head; auto-set from swav_head num_clusters
LOSS.swav_loss.temp_hard_assignment_iters	Use hard (argmax) codes for the first N iterations
LOSS.swav_loss.output_dir	Where NaN debug dumps go; auto-set to the checkpoint folder
LOSS.swav_loss.queue.queue_length	Global feature-queue size; rounded down to a multiple of global batch
LOSS.swav_loss.queue.start_iter	Iteration from which the queue is used in code computation
LOSS.swav_loss.queue.local_queue_length	Per-rank queue size, auto-set to queue_length // world_size
LOSS.swav_momentum_loss.momentum	EMA momentum of the momentum (teacher) network
LOSS.swav_momentum_loss.momentum_eval_mode_iter_start	Iteration after which the momentum net runs in eval mode
LOSS.swav_momentum_loss.embedding_dim	Momentum SwAV: projection width; auto-set from the last entry of the swav_head dims
LOSS.swav_momentum_loss.temperature	Momentum SwAV: temperature of the softmax over prototype scores
LOSS.swav_momentum_loss.use_double_precision	Momentum SwAV: run Sinkhorn-Knopp in float64
LOSS.swav_momentum_loss.normalize_last_layer	Momentum SwAV: l2-normalize prototype vectors after every optimizer update
LOSS.swav_momentum_loss.num_iters	Momentum SwAV: sinkhorn-Knopp iterations per assignment
LOSS.swav_momentum_loss.epsilon	Momentum SwAV: entropy regularization of the Sinkhorn assignment (codes = exp(s/eps))
LOSS.swav_momentum_loss.num_crops	Momentum SwAV: total crops per image; auto-set from ImgPilToMultiCrop.total_num_crops
LOSS.swav_momentum_loss.crops_for_assign	Momentum SwAV: indices of crops whose codes are computed and predicted by the others
LOSS.swav_momentum_loss.num_prototypes	Momentum SwAV: prototype counts per head; auto-set from swav_head num_clusters
LOSS.swav_momentum_loss.queue.queue_length	Momentum SwAV: global feature-queue size; rounded down to a multiple of global batch
LOSS.swav_momentum_loss.queue.start_iter	Momentum SwAV: iteration from which the queue is used in code computation
LOSS.swav_momentum_loss.queue.local_queue_length	Momentum SwAV: per-rank queue size, auto-set to queue_length // world_size
LOSS.dino_loss.momentum	Teacher EMA momentum
LOSS.dino_loss.student_temp	Student softmax temperature
LOSS.dino_loss.teacher_temp_min	Teacher temperature at the start of warm-up
LOSS.dino_loss.teacher_temp_max	Teacher temperature after warm-up
LOSS.dino_loss.teacher_temp_warmup_iters	Iterations of teacher-temperature warm-up
LOSS.dino_loss.crops_for_teacher	Crops fed to the teacher
LOSS.dino_loss.ema_center	EMA factor of the output centering vector
LOSS.dino_loss.output_dim	Head output width, auto-set from the head's num_clusters
LOSS.ibot_loss.teacher_momentum	iBOT teacher EMA momentum
LOSS.ibot_loss.warmup_teacher_temp	Initial teacher temperature (CLS)
LOSS.ibot_loss.teacher_temp	Final teacher temperature (CLS)
LOSS.ibot_loss.warmup_teacher_patch_temp	Initial teacher temperature (patch tokens)
LOSS.ibot_loss.teacher_patch_temp	Final teacher temperature (patch tokens)
LOSS.ibot_loss.warmup_teacher_temp_epochs	Epochs of teacher temperature warm-up
LOSS.ibot_loss.student_temp	Student temperature
LOSS.ibot_loss.center_momentum	Centering EMA (CLS)
LOSS.ibot_loss.center_momentum2	Centering EMA (patch)
LOSS.ibot_loss.lambda1	Weight of the CLS (DINO-style) term
LOSS.ibot_loss.lambda2	Weight of the masked-patch term
LOSS.ibot_loss.mim_start_epoch	Epoch at which masked image modeling starts
LOSS.ibot_loss.num_global_crops	Auto-filled number of global crops
LOSS.ibot_loss.num_local_crops	Auto-filled number of local crops
LOSS.ibot_loss.out_dim	Auto-filled CLS head width
LOSS.ibot_loss.patch_out_dim	Auto-filled patch head width
LOSS.ibot_loss.num_epochs	Auto-filled from OPTIMIZER.num_epochs
LOSS.msn_loss.momentum	MSN target-encoder EMA momentum
LOSS.msn_loss.temperature	MSN temperature
LOSS.msn_loss.output_dim	Auto-filled prototype count
LOSS.deepclusterv2_loss.DROP_LAST	Copied from DATA.TRAIN.DROP_LAST
LOSS.deepclusterv2_loss.BATCHSIZE_PER_REPLICA	Copied from DATA.TRAIN.BATCHSIZE_PER_REPLICA
LOSS.deepclusterv2_loss.num_crops	Auto-filled crop count
LOSS.deepclusterv2_loss.temperature	Softmax temperature
LOSS.deepclusterv2_loss.num_clusters	k of each k-means clustering (one per head)
LOSS.deepclusterv2_loss.kmeans_iters	k-means iterations per epoch
LOSS.deepclusterv2_loss.memory_params.crops_for_mb	Crops whose features enter the memory bank
LOSS.deepclusterv2_loss.memory_params.embedding_dim	Memory bank feature width
LOSS.deepclusterv2_loss.num_train_samples	Dataset size, auto-filled
LOSS.moco_loss.embedding_dim	MoCo embedding width
LOSS.moco_loss.queue_size	Number of negatives kept in the queue
LOSS.moco_loss.momentum	Key-encoder EMA momentum
LOSS.moco_loss.temperature	Contrastive temperature
LOSS.barlow_twins_loss.lambda_	Weight of the off-diagonal redundancy term
LOSS.barlow_twins_loss.scale_loss	Global scale of the loss
LOSS.barlow_twins_loss.embedding_dim	Projector output width
LOSS.swav_distillation_loss.temperature	Student temperature in SwAV distillation
LOSS.swav_distillation_loss.use_double_precision	Sinkhorn in float64
LOSS.swav_distillation_loss.num_iters	Sinkhorn iterations
LOSS.swav_distillation_loss.epsilon	Sinkhorn entropy regularization
LOSS.swav_distillation_loss.num_crops	Student crop count
LOSS.swav_distillation_loss.num_prototypes	Prototype counts
LOSS.swav_distillation_loss.output_dir	Debug dump folder
LOSS.swav_distillation_loss.temp_hard_assignment_iters	Hard-assignment warm-up iterations
LOSS.swav_distillation_loss.local_queue_length	Per-rank queue size
LOSS.swav_distillation_loss.queue_start_iter	Iteration at which the queue kicks in
LOSS.swav_distillation_loss.normalize_student_feats	L2-normalize student features
LOSS.swav_distillation_loss.use_student_prototypes	Score student features with the student's prototypes
LOSS.swav_distillation_loss.use_teacher_prototypes	Score student features with the teacher's prototypes
LOSS.swav_distillation_loss.use_two_crops_for_teacher	Teacher codes come from two crops
LOSS.swav_distillation_loss.swapped_assignment	Predict the code of the other crop (swapped prediction)
LOSS.dino_distillation_loss.swapped_assignment	Swapped crop prediction
LOSS.dino_distillation_loss.teacher_num_crops	Crops seen by the teacher
LOSS.dino_distillation_loss.teacher_temperature	Teacher temperature
LOSS.dino_distillation_loss.student_num_crops	Crops seen by the student
LOSS.dino_distillation_loss.student_temperature	Student temperature
LOSS.ibot_distillation_loss.swapped_assignment	Swapped crop prediction
LOSS.ibot_distillation_loss.use_teacher_prototypes	Use the teacher's prototypes for the student
LOSS.ibot_distillation_loss.num_global_crops	Global crop count
LOSS.ibot_distillation_loss.student_num_crops	Crops seen by the student
LOSS.ibot_distillation_loss.student_temp	Student temperature
LOSS.ibot_distillation_loss.teacher_temp	Teacher temperature (CLS)
LOSS.ibot_distillation_loss.teacher_patch_temp	Teacher temperature (patch)
LOSS.ibot_distillation_loss.lambda1	Weight of the CLS term
LOSS.ibot_distillation_loss.lambda2	Weight of the patch term
LOSS.msn_distillation_loss.swapped_assignment	Swapped crop prediction
LOSS.msn_distillation_loss.student_temperature	Student temperature
LOSS.msn_distillation_loss.teacher_num_crops	Crops seen by the teacher
LOSS.msn_distillation_loss.student_num_crops	Crops seen by the student
OPTIMIZER.name	Optimizer: sgd, adam, adamw, lars, zero, sgd_fsdp ...
OPTIMIZER.use_zero	Shard optimizer state (fairscale OSS / ZeRO)
OPTIMIZER.use_larc	Wrap SGD in apex LARC (layer-wise adaptive LR)
OPTIMIZER.larc_config.clip	LARC clipping mode (True) vs scaling mode (False)
OPTIMIZER.larc_config.eps	LARC epsilon in the trust-ratio denominator
OPTIMIZER.larc_config.trust_coefficient	LARC trust coefficient
OPTIMIZER.weight_decay	L2 weight decay
OPTIMIZER.momentum	SGD momentum
OPTIMIZER.nesterov	Nesterov momentum
OPTIMIZER.num_epochs	Training epochs (train phases); also feeds the per-rank seed
OPTIMIZER.betas	Adam/AdamW beta1, beta2
OPTIMIZER.regularize_bn	Apply weight decay to BatchNorm params (False = wd 0 for them)
OPTIMIZER.regularize_bias	Apply weight decay to bias params
OPTIMIZER.non_regularized_parameters	Substrings of param names excluded from weight decay
OPTIMIZER.head_optimizer_params.use_different_lr	Head gets its own LR schedule (param_schedulers.lr_head)
OPTIMIZER.head_optimizer_params.use_different_wd	Head gets its own weight decay
OPTIMIZER.head_optimizer_params.weight_decay	Head weight decay; copied from OPTIMIZER.weight_decay unless overridden
OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale	Rescale the schedule for the actual global batch size
OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_value	Reference LR that gets scaled
OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size	Batch size at which base_value applies
OPTIMIZER.param_schedulers.lr.auto_lr_scaling.scaling_type	linear or sqrt scaling of base_value by global_batch/base_batch
OPTIMIZER.param_schedulers.lr.name	Schedule type: multistep, step, cosine, linear, constant, composite, ...
OPTIMIZER.param_schedulers.lr.update_interval	Advance the schedule every step or every epoch
OPTIMIZER.param_schedulers.lr.values	LR value for each multistep segment (absolute values, not gammas)
OPTIMIZER.param_schedulers.lr.milestones	Epochs where multistep switches to the next value
OPTIMIZER.param_schedulers.lr.schedulers	composite: list of sub-schedules ({name, start_value, end_value, ...})
OPTIMIZER.param_schedulers.lr.interval_scaling	composite: per sub-schedule, rescaled (local 0..1 progress) or fixed (global)
OPTIMIZER.param_schedulers.lr.lengths	composite: fraction of training taken by each sub-schedule
OPTIMIZER.param_schedulers.lr.start_value	cosine/linear: value at the start
OPTIMIZER.param_schedulers.lr.end_value	cosine/linear: value at the end
OPTIMIZER.param_schedulers.lr.value	constant schedule value
OPTIMIZER.param_schedulers.lr_head.auto_lr_scaling.auto_scale	Head LR: rescale the schedule for the actual global batch size
OPTIMIZER.param_schedulers.lr_head.auto_lr_scaling.base_value	Head LR: reference LR that gets scaled
OPTIMIZER.param_schedulers.lr_head.auto_lr_scaling.base_lr_batch_size	Head LR: batch size at which base_value applies
OPTIMIZER.param_schedulers.lr_head.auto_lr_scaling.scaling_type	Head LR: linear or sqrt batch-size scaling of base_value
OPTIMIZER.param_schedulers.lr_head.name	Head LR: schedule type: multistep, step, cosine, linear, constant, composite, ...
OPTIMIZER.param_schedulers.lr_head.update_interval	Head LR: advance the schedule every step or every epoch
OPTIMIZER.param_schedulers.lr_head.values	Head LR: lR value for each multistep segment (absolute values, not gammas)
OPTIMIZER.param_schedulers.lr_head.milestones	Head LR: epochs where multistep switches to the next value
OPTIMIZER.param_schedulers.lr_head.schedulers	Head LR: composite: list of sub-schedules ({name, start_value, end_value, ...})
OPTIMIZER.param_schedulers.lr_head.interval_scaling	Head LR: composite: per sub-schedule, rescaled (local 0..1 progress) or fixed (global)
OPTIMIZER.param_schedulers.lr_head.lengths	Head LR: composite: fraction of training taken by each sub-schedule
OPTIMIZER.param_schedulers.lr_head.start_value	Head LR: cosine/linear: value at the start
OPTIMIZER.param_schedulers.lr_head.end_value	Head LR: cosine/linear: value at the end
OPTIMIZER.param_schedulers.lr_head.value	Head LR: constant schedule value
OPTIMIZER.construct_single_param_group_only	Put all params in one group (needed with flattened FSDP)
OPTIMIZER.param_group_constructor	Registered param-group builder (default, lr_decay, ...)
OPTIMIZER.layer_wise_lr_decay.decay	Per-layer LR decay factor for the lr_decay constructor (BEiT-style)
EXTRACT_FEATURES.OUTPUT_DIR	Where extract_features writes features ('' = checkpoint folder)
EXTRACT_FEATURES.CHUNK_THRESHOLD	Features buffered before a disk write (0 = immediately, -1 = at end)
EXTRACT_FEATURES.MAP_FEATURES_TO_IMG_NAME	Save one <image_name>.npy per image
DISTILLATION.eager_teacher_init	Build/load the teacher at task creation instead of lazily
DISTILLATION.TEACHER_MODEL.BASE_MODEL_NAME	Teacher: registered model class wrapping trunk + heads
DISTILLATION.TEACHER_MODEL.INPUT_TYPE	Teacher: channel layout fed to the trunk: rgb, bgr (channel flip) or lab (L only)
DISTILLATION.TEACHER_MODEL.MULTI_INPUT_HEAD_MAPPING	Teacher: map input keys to the trunk features/heads that consume them
DISTILLATION.TEACHER_MODEL.SINGLE_PASS_EVERY_CROP	Teacher: forward each crop separately instead of grouping crops by resolution
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON	Teacher: benchmark/evaluation mode (frozen parts, feature extraction)
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY	Teacher: freeze the trunk; train only the heads (linear eval)
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD	Teacher: freeze both trunk and head
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY	Teacher: output trunk features only (no head)
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.ASSERT_HEAD_LAYER_SHAPE_INIT	Teacher: require head weight shapes to match exactly when loading
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.EVAL_TRUNK_AND_HEAD	Teacher: load head weights too and evaluate the full model
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.SHOULD_FLATTEN_FEATS	Teacher: flatten extracted features to N x D
DISTILLATION.TEACHER_MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP	Teacher: [[layer, [pool_op, args]], ...]: layers to evaluate and their pooling
DISTILLATION.TEACHER_MODEL.TRUNK.NAME	Teacher trunk name; other teacher fields are completed from config.MODEL
DISTILLATION.TEACHER_MODEL.HEAD.PARAMS	Teacher head spec ([name, kwargs] list)
DISTILLATION.TEACHER_MODEL.HEAD.BATCHNORM_EPS	Teacher: eps of BatchNorm1d layers inside mlp/swav heads
DISTILLATION.TEACHER_MODEL.HEAD.BATCHNORM_MOMENTUM	Teacher: momentum of BatchNorm1d layers inside mlp/swav heads
DISTILLATION.TEACHER_MODEL.HEAD.PARAMS_MULTIPLIER	Teacher: scale factor applied to the head's initial weights (mlp heads)
DISTILLATION.TEACHER_MODEL.WEIGHTS_INIT.PARAMS_FILE	Teacher checkpoint path; the placeholder default must be replaced for distillation
DISTILLATION.TEACHER_MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME	Teacher: key under which the state dict sits in that file ('' = top level)
DISTILLATION.TEACHER_MODEL.WEIGHTS_INIT.SKIP_LAYERS	Teacher: substrings of param names not copied from the checkpoint
DISTILLATION.TEACHER_MODEL.WEIGHTS_INIT.REMOVE_PREFIX	Teacher: prefix stripped from checkpoint keys before loading
DISTILLATION.TEACHER_MODEL.WEIGHTS_INIT.APPEND_PREFIX	Teacher: prefix prepended to checkpoint keys (e.g. trunk._feature_blocks.)
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP	Teacher: switch to FullyShardedDataParallel and auto-fill related settings
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD	Teacher: param-count threshold above which a layer gets its own FSDP wrap
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.flatten_parameters	Teacher: fairscale FSDP option: flatten parameters into one buffer
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.mixed_precision	Teacher: fairscale FSDP option: fp16 compute/communication
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.fp32_reduce_scatter	Teacher: fairscale FSDP option: reduce-scatter gradients in fp32
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.compute_dtype	Teacher: fairscale FSDP option: float32 or float16 compute dtype
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.bucket_cap_mb	Teacher: fairscale FSDP option: reduce-scatter bucket size (MB)
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.clear_autocast_cache	Teacher: fairscale FSDP option: clear autocast cache after forward
DISTILLATION.TEACHER_MODEL.FSDP_CONFIG.verbose	Teacher: fairscale FSDP option: verbose repr
DISTILLATION.TEACHER_MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING	Teacher: recompute activations in backward to save memory
DISTILLATION.TEACHER_MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS	Teacher: number of checkpoint segments the trunk is cut into
CLUSTERFIT.OUTPUT_DIR	Output folder for the ClusterFit pseudo-label dataset
CLUSTERFIT.NUM_ITER	k-means iterations
CLUSTERFIT.NUM_CLUSTERS	Number of clusters (pseudo-classes)
CLUSTERFIT.DATA_LIMIT	Features used to fit centroids (-1 = all)
CLUSTERFIT.DATA_LIMIT_SAMPLING.SEED	Seed for that subset
CLUSTERFIT.CLUSTER_BACKEND	Clustering library (faiss only)
CLUSTERFIT.FEATURES.EXTRACT	Extract features first rather than reading them from PATH
CLUSTERFIT.FEATURES.PATH	Folder of pre-extracted features
CLUSTERFIT.FEATURES.DATA_PARTITION	Split whose features are clustered
CLUSTERFIT.FEATURES.TEST_PARTITION	Split that gets assigned to the clusters
CLUSTERFIT.FEATURES.DATASET_NAME	Dataset name used in feature file names
CLUSTERFIT.FEATURES.LAYER_NAME	Model layer whose features are clustered
CLUSTERFIT.FEATURES.DIMENSIONALITY_REDUCTION	PCA target dimension before clustering (0 = none)
RANKING.USE_GPU	Run faiss ranking on GPU
RANKING.RANKING_BACKEND	Ranking library (faiss only)
RANKING.NORMALIZE_FEATS	L2-normalize features before ranking
RANKING.APPLY_PCA	PCA-reduce features before ranking
RANKING.PCA_DIM	PCA output dimension
RANKING.FEATURES.DATA_PARTITION	Split whose features are ranked
RANKING.FEATURES.DATASET_NAME	Dataset name used in feature file names
RANKING.FEATURES.LAYER_NAME	Layer whose features are ranked
TRAINER.TRAIN_STEP_NAME	Registered per-iteration train step; only standard_train_step ships
TRAINER.TASK_NAME	Registered ClassyVision task (self_supervision_task, _fsdp_task, _sdp_task)
CHECKPOINT.DIR	Folder for checkpoints, logs, dumped train_config.yaml, tb_logs
CHECKPOINT.APPEND_DISTR_RUN_ID	Append the distributed run id to DIR (multi-node only)
CHECKPOINT.BACKEND	Storage backend for checkpoints (disk)
CHECKPOINT.AUTO_RESUME	Resume from the newest checkpoint found in DIR
CHECKPOINT.CHECKPOINT_FREQUENCY	Checkpoint when train epoch index % N == 0, and always at the final epoch
CHECKPOINT.CHECKPOINT_ITER_FREQUENCY	Also save every N iterations (-1 = off)
CHECKPOINT.OVERWRITE_EXISTING	Retrain even if DIR already holds a finished run
CHECKPOINT.LATEST_CHECKPOINT_RESUME_FILE_NUM	Resume from the N-th most recent checkpoint (1 = latest)
CHECKPOINT.USE_SYMLINK_CHECKPOINT_FOR_RESUME	Keep a symlink pointing at the newest checkpoint and resume through it
DISTRIBUTED.BACKEND	torch.distributed backend (nccl for GPU, gloo for CPU)
DISTRIBUTED.NCCL_DEBUG	Export NCCL_DEBUG=INFO
DISTRIBUTED.NCCL_SOCKET_NTHREADS	Export NCCL_SOCKET_NTHREADS if set
DISTRIBUTED.BROADCAST_BUFFERS	DDP broadcast_buffers (sync BN buffers from rank 0 each forward)
DISTRIBUTED.NUM_NODES	Number of machines; world size = NUM_NODES x NUM_PROC_PER_NODE
DISTRIBUTED.NUM_PROC_PER_NODE	Processes (GPUs) per machine
DISTRIBUTED.INIT_METHOD	Process-group rendezvous: tcp, env or file
DISTRIBUTED.RUN_ID	Rendezvous address/id (auto = pick a free local port)
DISTRIBUTED.MANUAL_GRADIENT_REDUCTION	All-reduce grads by hand instead of through DDP hooks
SLURM.USE_SLURM	Submit the run to SLURM via submitit
SLURM.NAME	SLURM job name
SLURM.COMMENT	SLURM job comment
SLURM.PARTITION	SLURM partition (required when submitting)
SLURM.LOG_FOLDER	Folder for SLURM job logs
SLURM.TIME_HOURS	Requested wall time, hours
SLURM.TIME_MINUTES	Requested wall time, extra minutes
SLURM.CONSTRAINT	Hardware constraint string (e.g. volta)
SLURM.MEM_GB	RAM per node, GB
SLURM.PORT_ID	TCP port for the torch.distributed rendezvous
SLURM.NUM_CPU_PER_PROC	CPUs requested per process
SLURM.ADDITIONAL_PARAMETERS	Open map of extra submitit/SLURM parameters
SVM.normalize	L2-normalize features before SVM training
SVM.cls_list	Classes to train SVMs for (empty = all)
SVM.loss	sklearn LinearSVC loss
SVM.penalty	sklearn LinearSVC penalty
SVM.dual	sklearn dual formulation
SVM.max_iter	sklearn max iterations
SVM.cross_val_folds	Cross-validation folds for picking the cost
SVM.costs.costs_list	Explicit cost (C) values tried
SVM.costs.base	Base for power-generated costs (-1 = none)
SVM.costs.power_range	Exponent range for power-generated costs
SVM.force_retrain	Retrain even when a saved SVM exists
SVM.low_shot.dataset_name	Low-shot benchmark dataset (voc or places205)
SVM.low_shot.sample_inds	Indices of independent low-shot samplings
SVM.low_shot.k_values	Positives per class used in low-shot runs
SVM_FEATURES_PATH	Pre-extracted features for SVM ('' = extract first)
IMG_RETRIEVAL.TRAIN_DATASET_NAME	Dataset used to fit PCA/whitening
IMG_RETRIEVAL.EVAL_DATASET_NAME	Retrieval benchmark evaluated
IMG_RETRIEVAL.DATASET_PATH	Root of the retrieval datasets
IMG_RETRIEVAL.WHITEN_IMG_LIST	Image list for the whitening dataset
IMG_RETRIEVAL.EVAL_BINARY_PATH	compute_ap binary for Oxford/Paris scoring
IMG_RETRIEVAL.DEBUG_MODE	Cap training/query/database sizes for debugging
IMG_RETRIEVAL.NUM_TRAINING_SAMPLES	Training images used (-1 = all)
IMG_RETRIEVAL.NUM_QUERY_SAMPLES	Queries used (-1 = all)
IMG_RETRIEVAL.NUM_DATABASE_SAMPLES	Database images used (-1 = all)
IMG_RETRIEVAL.USE_DISTRACTORS	Add the distractor set (revisited benchmarks)
IMG_RETRIEVAL.IMG_SCALINGS	Image scales whose features are averaged
IMG_RETRIEVAL.SIMILARITY_MEASURE	cosine_similarity or l2
IMG_RETRIEVAL.RESIZE_IMG	Resize longer image side to this many pixels
IMG_RETRIEVAL.SPATIAL_LEVELS	R-MAC spatial pyramid levels
IMG_RETRIEVAL.N_PCA	PCA output dimension
IMG_RETRIEVAL.TRAIN_PCA_WHITENING	Fit and apply PCA whitening
IMG_RETRIEVAL.FEATS_PROCESSING_TYPE	Feature pooling: gem or rmac
IMG_RETRIEVAL.GEM_POOL_POWER	GeM exponent (1 = average pooling)
IMG_RETRIEVAL.CROP_QUERY_ROI	Crop queries to their annotated region
IMG_RETRIEVAL.NORMALIZE_FEATURES	L2-normalize processed features
IMG_RETRIEVAL.CENTER_CROP	Center-crop images
IMG_RETRIEVAL.SAVE_RETRIEVAL_RANKINGS_SCORES	Save metrics, rankings and similarity scores
IMG_RETRIEVAL.SAVE_FEATURES	Save extracted features
IMG_RETRIEVAL.USE_FEATURE_EXTRACTION_ENGINE	Use the generic extract_features engine
IMG_RETRIEVAL.FEATURE_EXTRACTION_DIR	Load features previously extracted there
NEAREST_NEIGHBOR.SIGMA	Temperature for similarity-weighted k-NN voting
NEAREST_NEIGHBOR.TOPK	k (or list of k) neighbours
NEAREST_NEIGHBOR.L2_NORM_FEATS	L2-normalize features before k-NN
NEAREST_NEIGHBOR.USE_CUDA	Keep features on GPU for k-NN
NEAREST_NEIGHBOR.OPTIMIZE_MEMORY	Lower-memory k-NN implementation
NEAREST_NEIGHBOR.FEATURES.PATH	Pre-extracted features ('' = extract first)
LOW_SHOT_BENCHMARK.METHOD	Low-shot classifier: logistic_regression or svm
LOW_SHOT_BENCHMARK.LOGISTIC_REGRESSION.LAMBDA	L2 penalty of the logistic regression
LOW_SHOT_BENCHMARK.LOGISTIC_REGRESSION.SEEDS	Seeds of the train-set splits
LOW_SHOT_BENCHMARK.FEATURES.PATH	Pre-extracted features ('' = extract first)
GEO_LOCALIZATION.TRAIN_LABEL_MAPPING	JSON mapping predicted labels to latitude/longitude
GEO_LOCALIZATION.ACC_KM_THRESHOLDS	Distance thresholds (km) for accuracy: street..continent
)tsv";

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
    {"VERBOSE"}, {"TEST_ONLY", "False"}, {"TEST_MODEL", "False"}, {"TEST_EVERY_NUM_EPOCH"},
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
    {"DATA.TRAIN.COLLATE_FUNCTION_PARAMS"},
    {"DATA.TRAIN.RANDOM_SYNTHETIC_IMAGES"},  // ours are always patterned noise (synthetic_images.hpp)
    {"DATA.TEST.*"},
    // evaluation meters and tasks (the trainer's own kNN is NEAREST_NEIGHBOR's)
    {"METERS.*"}, {"EXTRACT_FEATURES.*"}, {"CLUSTERFIT.*"}, {"RANKING.*"}, {"SVM.*"},
    {"SVM_FEATURES_PATH"}, {"IMG_RETRIEVAL.*"}, {"LOW_SHOT_BENCHMARK.*"}, {"GEO_LOCALIZATION.*"},
    // model plumbing, other trunks and heads
    {"MODEL.BASE_MODEL_NAME"}, {"MODEL.CUDA_CACHE.*"}, {"MODEL.MULTI_INPUT_HEAD_MAPPING"},
    {"MODEL.TRUNK.RESNETS.STANDARDIZE_CONVOLUTIONS"}, {"MODEL.TRUNK.RESNETS.GROUPNORM_GROUPS"},
    {"MODEL.TRUNK.RESNETS.NORM", "BatchNorm"}, {"MODEL.TRUNK.RESNETS.GROUPS", "1"},
    {"MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP", "64"}, {"MODEL.TRUNK.RESNETS.LAYER4_STRIDE", "2"},
    {"MODEL.TRUNK.RESNETS_SK.*"}, {"MODEL.TRUNK.EFFICIENT_NETS.*"}, {"MODEL.TRUNK.MOBILE_NET.*"},
    {"MODEL.TRUNK.REGNET.*"}, {"MODEL.TRUNK.VISION_TRANSFORMERS.*"}, {"MODEL.TRUNK.XCIT.*"},
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
    // optimizer plumbing that SGD with one parameter-group rule does not read
    {"OPTIMIZER.construct_single_param_group_only"}, {"OPTIMIZER.param_group_constructor"},
    {"OPTIMIZER.layer_wise_lr_decay.*"}, {"OPTIMIZER.betas"},
    {"OPTIMIZER.head_optimizer_params.use_different_lr", "False"},
    {"OPTIMIZER.head_optimizer_params.use_different_wd", "False"},
    {"OPTIMIZER.head_optimizer_params.*"}, {"OPTIMIZER.param_schedulers.lr_head.*"},
    // the train step, checkpoint and launcher plumbing
    {"TRAINER.TRAIN_STEP_NAME", "standard_train_step"}, {"TRAINER.TASK_NAME"},
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
