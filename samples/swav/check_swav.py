#!/usr/bin/env python3
"""Short SwAV runs that must agree bit for bit (the parameters' FNV-1a fingerprint the trainer
prints): ddp, oss, sdp and fsdp, without and with activation checkpointing, with
SyncBatchNorm, with batch-norm parameters and biases out of the weight decay, channels-last
activations (ddp and fsdp alike; losses equal to NCHW's to rounding), ResNeXt, RegNet and
EfficientNet trunks (the last with its dropout masks, also across a resume), and with the
optimizer (and the parameter shards) offloaded to the host; bf16 and f16 fsdp equal to ddp; a run killed with
SIGKILL mid-epoch and resumed with AUTO_RESUME (under the same stage, and under another one)
equals the run that never stopped; MACHINE.CUDA_GRAPH=true (the step captured and replayed under
the capture's rules) equals the eager run, f32 and f16; and a run checkpointing every iteration, SIGKILLed again and
again at random moments and while a save is in progress, resumes each time from the newest
complete checkpoint and ends with the uninterrupted run's parameters (8 kills here, half of
them during a save; SHARDKIT_KILLS=200 for a long run). And the host memory the trainer estimates
before its ranks start, against what the process then holds. Usage: check_swav.py path/to/swav"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kill_chain  # noqa: E402  (samples/kill_chain.py)

TINY = [
    "config.DATA.TRAIN.DATA_LIMIT=320",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
    "config.DATA.TEST.DATA_LIMIT=60",
    "config.DATA.TEST.BATCHSIZE_PER_REPLICA=32",
    "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT=120",
    "config.NEAREST_NEIGHBOR.TOPK=20",
    "config.DATA.NUM_DATALOADER_WORKERS=1",
    "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 4, size_crops: [16, 8],"
    " num_crops: [2, 2], crop_scales: [[0.3, 1], [0.1, 0.3]]}, {name: RandomHorizontalFlip, p: 0.5},"
    " {name: ImgPilColorDistortion, strength: 1.0}, {name: ImgPilGaussianBlur, p: 0.5,"
    " radius_min: 0.1, radius_max: 2.0}, {name: ToTensor}, {name: Normalize, mean: [0.286],"
    " std: [0.353]}]",
    # The network and optimizer of the shipped CPU configs (the defaults are VISSL's: a
    # ResNet-50 with ImageNet's stem, plain SGD)
    "config.MODEL.TRUNK.RESNETS.DEPTH=18",
    "config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=True",
    "config.OPTIMIZER.use_larc=True",
    "config.OPTIMIZER.weight_decay=0.000001",
    "config.OPTIMIZER.regularize_bn=True",
    "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=0.125",
    'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [64, 32, 32], "use_bn": True, "num_clusters": [20]}]]',
    "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[['module.heads.0.prototypes0.weight', 3]]",
    "config.LOSS.swav_loss.queue.queue_length=32",
    "config.LOSS.swav_loss.queue.start_iter=2",
    "config.LOG_FREQUENCY=2",
    "config.METRICS.PLOT=False",
]
STAGES = {
    "ddp": [],
    "oss": ["config.OPTIMIZER.use_zero=True"],
    "sdp": ["config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True"],
    "fsdp": ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"],
}
CHECKPOINTING = ["config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True",
                 "config.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS=3"]


def run(swav, folder, extra, kill_after=None):
    args = [swav] + TINY + [f"config.CHECKPOINT.DIR={folder}"] + extra
    if kill_after is None:
        out = subprocess.run(args, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stdout, out.stderr)
            raise SystemExit(f"FAIL: swav exited {out.returncode}: {' '.join(extra)}")
        found = re.search(r"fingerprint ([0-9a-f]{16})", out.stdout)
        if not found:
            raise SystemExit(f"FAIL: no fingerprint in the output:\n{out.stdout}")
        return found.group(1), out.stdout
    # Run until the checkpoint of iteration `kill_after` is reported, then SIGKILL.
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if f"(iteration {kill_after})" in line:
            os.kill(process.pid, signal.SIGKILL)
            break
    process.wait()
    if process.returncode != -signal.SIGKILL:
        raise SystemExit(f"FAIL: the run to kill ended on its own ({process.returncode})")
    return None, None


def check_kill_chains(swav, work, kills):
    """An FSDP run checkpointing every iteration, killed `kills` times (../kill_chain.py), each
    restart resuming with AUTO_RESUME: every chain must end with the uninterrupted run's
    fingerprint and no temporary file."""
    chain_args = ["config.MAX_ITERATIONS=14", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1"]
    chain_args += STAGES["fsdp"]
    reference, _ = run(swav, os.path.join(work, "chain_reference"), chain_args)
    folder = os.path.join(work, "chain")

    def finish_chain():
        final, output = run(swav, folder, chain_args)
        leftovers = kill_chain.temporary_files(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if final != reference or leftovers:
            print(f"chain ended with {final} (uninterrupted {reference}), leftovers {leftovers}")
        return final == reference and not leftovers and "resumed from" in output

    killed, during_save, chains, good_chains = kill_chain.kill_chains(
        folder, lambda resume: [swav] + TINY + [f"config.CHECKPOINT.DIR={folder}"] + chain_args,
        finish_chain, kills, finish_from=11, max_advance=3, seed=11)
    print(f"killed {killed} times ({during_save} with a save in progress); {good_chains} of "
          f"{chains} chains of restarts ended with the uninterrupted run's parameters "
          f"({reference}) and no temporary file")
    if good_chains != chains or during_save == 0:
        raise SystemExit("FAIL: a killed and resumed run diverged, or no kill hit a save")


def check_memory_estimate(swav, work):
    """The host memory the trainer estimates before its ranks start (their model states and each
    rank's step, measured on one rank at a few images) against what the process then holds: its
    peak resident set, from the kernel. Two ranks of the quick config's width whose 96-pixel crops
    make their steps most of it (about 1 GB each)."""
    args = [swav] + TINY + [
        f"config.CHECKPOINT.DIR={os.path.join(work, 'memory')}", "config.MAX_ITERATIONS=2",
        "config.TEST_MODEL=False", "config.NEAREST_NEIGHBOR.FREQUENCY=0",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32",
        "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=0.25",
        'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [128, 64, 32], "use_bn": True,'
        ' "num_clusters": [20]}]]',
        "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 6, size_crops:"
        " [96, 48], num_crops: [2, 4], crop_scales: [[0.3, 1], [0.1, 0.3]]}, {name: ToTensor},"
        " {name: Normalize, mean: [0.286], std: [0.353]}]"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    estimate = re.search(r"host memory: about .* -- 2 ranks on this machine, about ([0-9.]+) of",
                         output)
    if status != 0 or not estimate:
        raise SystemExit(f"FAIL: the memory run failed or gave no estimate:\n{output}")
    resident = usage.ru_maxrss * 1024 / 1e9  # (Linux: kilobytes)
    ratio = float(estimate.group(1)) / resident
    print(f"host memory: estimated {estimate.group(1)} GB before the ranks started, the process "
          f"held at most {resident:.2f} GB ({ratio:.2f}x)")
    # Not much above what the process holds (a refusal would turn away runs that fit), and not
    # far below: the libraries, the data and the loaders' buffers are the process's own, and the
    # allocator keeps a few percent more than the steps' peak in use (0.92x on the Xeon; 0.85x
    # under meson test, whose MALLOC_PERTURB_ has glibc write the blocks it hands out).
    if not 0.75 <= ratio <= 1.1:
        raise SystemExit("FAIL: the estimate is off by more than the bounds (0.75x-1.1x)")


def main():
    swav = sys.argv[1]
    work = tempfile.mkdtemp(prefix="shardkit_check_swav_")
    try:
        check_memory_estimate(swav, work)
        steps = ["config.MAX_ITERATIONS=6"]
        prints = {}
        for stage, flags in STAGES.items():
            for checkpointing in (False, True):
                name = stage + (" + checkpointing" if checkpointing else "")
                folder = os.path.join(work, name.replace(" + ", "_"))
                prints[name], _ = run(swav, folder, steps + flags + (CHECKPOINTING if checkpointing else []))
                print(f"{name:<26} {prints[name]}")
        if len(set(prints.values())) != 1:
            raise SystemExit("FAIL: the stages' parameters differ")
        print("every stage, with and without activation checkpointing: the same parameters bit for bit")
        # Channel blocks (MODEL.TRUNK.RESNETS.CHANNEL_BLOCKS, on by default) run NCHW's oneDNN
        # kernels without its reorders: the same parameters as NCHW's, bit for bit, here.
        nchw, _ = run(swav, os.path.join(work, "nchw"),
                      steps + ["config.MODEL.TRUNK.RESNETS.CHANNEL_BLOCKS=False"])
        print(f"NCHW activations (CHANNEL_BLOCKS=False): {nchw}")
        if nchw != prints["ddp"]:
            raise SystemExit("FAIL: channel blocks changed the parameters' bits (docs/design.md "
                             "'Channel-blocked activations' says where they may differ)")
        # The same with ImageNet's stem (7 x 7 / 2 convolution and max-pool): its max-pool then
        # pools the blocks as they are.
        stem = ["config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=False"]
        stem_blocks, _ = run(swav, os.path.join(work, "stem_blocks"), steps + stem)
        stem_nchw, _ = run(swav, os.path.join(work, "stem_nchw"),
                           steps + stem + ["config.MODEL.TRUNK.RESNETS.CHANNEL_BLOCKS=False"])
        print(f"ImageNet's stem, channel blocks and NCHW: {stem_blocks} {stem_nchw}")
        if stem_blocks != stem_nchw:
            raise SystemExit("FAIL: with ImageNet's stem, channel blocks changed the parameters' bits")
        # Channels-last activations (MODEL.TRUNK.RESNETS.CHANNELS_LAST): the convolutions take
        # other oneDNN kernels, so other bits than NCHW's (and the channel blocks'), but the
        # stages still agree bit for bit and the losses agree with NCHW's to rounding.
        last, losses = {}, {}
        for stage in ("ddp", "fsdp"):
            last[stage], output = run(swav, os.path.join(work, f"channels_last_{stage}"),
                                      steps + STAGES[stage] +
                                      ["config.MODEL.TRUNK.RESNETS.CHANNELS_LAST=True"])
            losses[stage] = [float(v) for v in re.findall(r"loss ([0-9.]+)", output)]
        _, output = run(swav, os.path.join(work, "nchw_losses"), steps)
        nchw_losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", output)]
        print(f"channels-last, ddp and fsdp: {last['ddp']} {last['fsdp']}; losses {losses['ddp']} "
              f"against NCHW's {nchw_losses}")
        if last["ddp"] != last["fsdp"]:
            raise SystemExit("FAIL: channels-last ddp and fsdp differ")
        if (not nchw_losses or len(losses["ddp"]) != len(nchw_losses) or
                any(abs(a - b) > 2e-3 * max(1.0, abs(b)) for a, b in zip(losses["ddp"], nchw_losses))):
            raise SystemExit("FAIL: channels-last losses differ from NCHW's beyond rounding")
        # A ResNeXt trunk (VISSL's GROUPS and WIDTH_PER_GROUP: bottlenecks whose 3 x 3
        # convolutions are grouped, here 4 groups of 2 channels in the first stage): ddp, oss and
        # fsdp end with the same parameters, bit for bit, with channel blocks and NCHW.
        resnext = ["config.MODEL.TRUNK.RESNETS.DEPTH=50", "config.MODEL.TRUNK.RESNETS.GROUPS=4",
                   "config.MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP=16",
                   'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [256, 32, 32], "use_bn": '
                   'True, "num_clusters": [20]}]]', "config.MAX_ITERATIONS=3"]
        grouped = {}
        for stage in ("ddp", "oss", "fsdp"):
            grouped[stage], output = run(swav, os.path.join(work, f"resnext_{stage}"),
                                         resnext + STAGES[stage])
        grouped["nchw"], _ = run(swav, os.path.join(work, "resnext_nchw"),
                                 resnext + ["config.MODEL.TRUNK.RESNETS.CHANNEL_BLOCKS=False"])
        print(f"ResNeXt-50 4x16d, ddp / oss / fsdp / NCHW: {grouped}; {output.splitlines()[0]}")
        if len(set(grouped.values())) != 1 or "ResNeXt-50 4x16d" not in output:
            raise SystemExit(f"FAIL: the ResNeXt trunk's stages differ: {grouped}")
        # A RegNetY trunk (MODEL.TRUNK.REGNET as an AnyNet: grouped 3 x 3 convolutions and
        # squeeze-and-excitation in every block): ddp, oss, sdp and fsdp with activation
        # checkpointing end with the same parameters, bit for bit.
        regnet = ["config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.REGNET.name=anynet",
                  "config.MODEL.TRUNK.REGNET.depths=[1, 1, 2, 1]",
                  "config.MODEL.TRUNK.REGNET.widths=[8, 16, 24, 32]",
                  "config.MODEL.TRUNK.REGNET.group_widths=[8, 8, 8, 8]",
                  "config.MODEL.TRUNK.REGNET.bottleneck_multipliers=[1.0, 1.0, 1.0, 1.0]",
                  "config.MODEL.TRUNK.REGNET.strides=[2, 2, 2, 2]",
                  "config.MODEL.TRUNK.REGNET.stem_width=8",
                  'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [32, 48, 32, 32], "use_bn": '
                  'True, "num_clusters": [20]}]]', "config.MAX_ITERATIONS=4"]
        # (fsdp also with VISSL's AUTO_WRAP_THRESHOLD: the blocks' convolutions of >= 700
        # parameters -- the 3 x 3 ones past the first stage, the widest 1 x 1 -- nested units)
        wrap = ["config.MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD=700"]
        regnets = {}
        for stage in STAGES:
            regnets[stage], output = run(swav, os.path.join(work, f"regnet_{stage}"),
                                         regnet + STAGES[stage] +
                                         (CHECKPOINTING + wrap if stage == "fsdp" else []))
        print(f"AnyNet of RegNetY blocks, a head of two hidden widths, ddp / oss / sdp / fsdp + "
              f"checkpointing + nested units: {regnets}")
        if (len(set(regnets.values())) != 1 or "AnyNet of RegNetY blocks" not in output or
                "convolutions of >= 700 parameters nested" not in output):
            raise SystemExit(f"FAIL: the RegNet trunk's stages differ: {regnets}")
        # An EfficientNet-B0 trunk (VISSL's efficientnet, ClassyVision's blocks: depthwise
        # convolutions, squeeze-and-excitation, SiLU, drop connect on the blocks' branches and
        # dropout on the features, both drawing masks while training): ddp, oss, sdp and fsdp
        # with activation checkpointing (the recomputed blocks draw their forward's masks) end
        # with the same parameters, bit for bit, and so does a run resumed half-way (the masks
        # are keyed by the iteration; test_efficientnet counts that they are drawn at all); kNN
        # on VISSL's conv_final feature block beside res5avg.
        efficientnet = ["config.MODEL.TRUNK.NAME=efficientnet",
                        "config.MODEL.TRUNK.EFFICIENT_NETS.model_version=B0",
                        'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [1280, 32, 32], '
                        '"use_bn": True, "num_clusters": [20]}]]',
                        'config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP='
                        '[["conv_final", ["Identity", []]], ["res5avg", ["Identity", []]]]',
                        "config.MAX_ITERATIONS=4"]
        efficientnets = {}
        for stage in STAGES:
            efficientnets[stage], output = run(swav, os.path.join(work, f"efficientnet_{stage}"),
                                               efficientnet + STAGES[stage] +
                                               (CHECKPOINTING if stage == "fsdp" else []))
        resumed = os.path.join(work, "efficientnet_resumed")
        every_2 = ["config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2"]
        run(swav, resumed, efficientnet + every_2 + ["config.MAX_ITERATIONS=2"])
        efficientnets["resumed at 2"], resumed_output = run(swav, resumed, efficientnet + every_2)
        print(f"EfficientNet-B0, ddp / oss / sdp / fsdp + checkpointing / resumed: {efficientnets}")
        if (len(set(efficientnets.values())) != 1 or
                "EfficientNet-B0 (16 blocks, 1280 features)" not in output or
                "resumed from" not in resumed_output or
                "conv_final (1280 features)" not in output):
            raise SystemExit(f"FAIL: the EfficientNet runs differ: {efficientnets}")
        # kNN on two feature sets (VISSL's LINEAR_EVAL_FEAT_POOL_OPS_MAP: res5 unpooled, then
        # the trunk output): both reported, at initialisation and at the end, and the same
        # figures under ddp and under fsdp (whose forward gathers each block's shards).
        pools = ['config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP='
                 '[["res5", ["Identity", []]], ["res5avg", ["Identity", []]]]']
        knn = {}
        for stage in ("ddp", "fsdp"):
            _, output = run(swav, os.path.join(work, f"knn_{stage}"),
                            ["config.MAX_ITERATIONS=2"] + pools + STAGES[stage])
            knn[stage] = re.findall(r"kNN top-1 on \d+ test images, (res5\S*) \((\d+) features\): "
                                    r"([0-9.]+)%", output)
        print(f"kNN per feature set (layer, features, top-1 %): {knn['ddp']}")
        layers = [(layer, dim) for layer, dim, _ in knn["ddp"]]
        if layers != [("res5", "256"), ("res5avg", "64")] * 2 or knn["ddp"] != knn["fsdp"]:
            raise SystemExit(f"FAIL: kNN feature sets: ddp {knn['ddp']}, fsdp {knn['fsdp']}")
        # The network at initialisation on 1, 2 and 3 ranks (61 test images in batches of 8:
        # padded shares, a short last batch; a bank of 101 images sharded 101 / 51 + 50 /
        # 34 + 34 + 33, each query's 5 nearest merged from the shards): the same figures, so
        # every rank's rows land in place; and the raw pixels' beside them (each rank's share of
        # the queries made alone, the bank's floats shared by the ranks). The exported
        # embeddings (the bank's shards gathered) are the same bytes.
        uneven = ['config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP='
                  '[["res5", ["Identity", []]], ["res4", ["AvgPool2d", [[2, 2], 2, 0]]]]',
                  "config.DATA.TEST.DATA_LIMIT=61", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
                  "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT=101", "config.MAX_ITERATIONS=0",
                  "config.NEAREST_NEIGHBOR.TOPK=5", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4"]
        by_world, exported = {}, {}
        for world in (1, 2, 3):
            folder = os.path.join(work, f"knn_world{world}")
            _, output = run(swav, folder,
                            uneven + [f"config.DISTRIBUTED.NUM_PROC_PER_NODE={world}",
                                      f"config.NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS={folder}/emb"])
            by_world[world] = re.findall(r"kNN top-1 on 61 test images, (res\S*) [^:]*: ([0-9.]+)% "
                                         r"\(raw pixels ([0-9.]+)%\)", output)
            with open(os.path.join(folder, "emb", "embeddings.safetensors"), "rb") as f:
                exported[world] = f.read()
        print(f"kNN at initialisation on 1, 2, 3 ranks: {by_world[1]}")
        if len(by_world[1]) != 4 or not by_world[1] == by_world[2] == by_world[3]:
            raise SystemExit(f"FAIL: kNN differs between world sizes: {by_world}")
        header = json.loads(exported[1][8:8 + int.from_bytes(exported[1][:8], "little")])
        shapes = {name: header[name]["shape"] for name in header if name != "__metadata__"}
        print(f"exported embeddings: {shapes}")
        if shapes.get("train_features") != [101, 256] or shapes.get("test_features") != [61, 256] \
                or not exported[1] == exported[2] == exported[3]:
            raise SystemExit(f"FAIL: exported embeddings differ between world sizes: {shapes}")
        # CPU offload through FairScale's FSDP keys: the same bits as FSDP on the device.
        for key in ("move_grads_to_cpu", "move_params_to_cpu"):
            offloaded, output = run(swav, os.path.join(work, key),
                                    steps + STAGES["fsdp"] + [f"config.MODEL.FSDP_CONFIG.{key}=True"])
            print(f"fsdp + {key}: {offloaded}")
            if offloaded != prints["fsdp"] or "offloaded to the host per rank" not in output:
                raise SystemExit(f"FAIL: fsdp with {key} differs from fsdp (or did not offload)")
        # Mixed precision (bf16; f16 with dynamic loss scaling): ZeRO-3 equals DDP.
        for dtype in ("bfloat16", "float16"):
            amp = ["config.MODEL.AMP_PARAMS.USE_AMP=True", f"config.MODEL.AMP_PARAMS.COMPUTE_DTYPE={dtype}"]
            ddp, _ = run(swav, os.path.join(work, f"ddp_{dtype}"), steps + amp)
            fsdp, _ = run(swav, os.path.join(work, f"fsdp_{dtype}"), steps + amp + STAGES["fsdp"])
            print(f"{dtype}: ddp {ddp}, fsdp {fsdp}")
            if ddp != fsdp or ddp == prints["ddp"]:
                raise SystemExit(f"FAIL: {dtype} fsdp differs from ddp (or equals the f32 run)")

        # MACHINE.CUDA_GRAPH=true on the CPU: the step captured once (per key: the queue starts
        # at iteration 2, the prototypes thaw at 3) and replayed under the capture's rules -- no
        # host wait, no drifting host value -- with the eager run's parameters, f32 and f16
        # (loss-scaled: the prototypes' normalisation reads the step gate, not the verdict), and
        # with SyncBatchNorm (its exchanges ordered on the stream, none waited for on the host).
        nine = ["config.MAX_ITERATIONS=9"]
        graph = ["config.MACHINE.CUDA_GRAPH=true"]
        f16 = ["config.MODEL.AMP_PARAMS.USE_AMP=True", "config.MODEL.AMP_PARAMS.COMPUTE_DTYPE=float16"]
        sync_bn = ["config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
                   "config.MODEL.SYNC_BN_CONFIG.GROUP_SIZE=0"]
        for name, flags in (("ddp", []), ("fsdp", STAGES["fsdp"]), ("fsdp float16", STAGES["fsdp"] + f16),
                            ("ddp sync_bn", sync_bn)):
            eager, _ = run(swav, os.path.join(work, f"eager_{name.replace(' ', '_')}"), nine + flags)
            graphed, output = run(swav, os.path.join(work, f"graph_{name.replace(' ', '_')}"),
                                  nine + flags + graph)
            replays = re.search(r"(\d+) captured, (\d+) replayed", output)
            print(f"{name}: eager {eager}, captured and replayed {graphed} "
                  f"({replays.group(0) if replays else 'no step graph'})")
            if graphed != eager or not replays or int(replays.group(2)) == 0:
                raise SystemExit(f"FAIL: {name}: the graphed run differs from the eager one "
                                 "(or replayed nothing)")

        # CUDA_GRAPH=true where the step waits on the host: refused at the start, naming why.
        refused = subprocess.run([swav] + TINY + nine + graph + [
            f"config.CHECKPOINT.DIR={os.path.join(work, 'graph_offload')}",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
            "config.MODEL.FSDP_CONFIG.move_grads_to_cpu=True"], capture_output=True, text=True)
        if refused.returncode == 0 or "an offloaded step" not in refused.stderr + refused.stdout:
            raise SystemExit("FAIL: CUDA_GRAPH=true with CPU offload was not refused by name:\n"
                             + refused.stdout + refused.stderr)

        # A diverged run (plain SGD at a rate of 1e30) stops at its first logged non-finite
        # loss, as VISSL's CheckNanLossHook does, instead of training NaN weights to the end.
        diverged_dir = os.path.join(work, "diverged")
        diverged = subprocess.run([swav] + TINY + nine + [
            f"config.CHECKPOINT.DIR={diverged_dir}", "config.OPTIMIZER.use_larc=False",
            "config.OPTIMIZER.weight_decay=0",
            "config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: 1e30, "
            "end_value: 1e30}, {name: cosine, start_value: 1e30, end_value: 1e30}]"],
            capture_output=True, text=True)
        said = diverged.stdout + diverged.stderr
        if diverged.returncode == 0 or "the run stops before a checkpoint keeps diverged" not in said:
            raise SystemExit("FAIL: a diverged run did not stop at its non-finite loss:\n" + said)
        print("diverged run stopped: " + re.search(r"iteration \d+: the loss[^;]*", said).group(0))

        # SyncBatchNorm over all ranks (GROUP_SIZE 0): every stage alike, and not per-rank BN.
        sync = ["config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
                "config.MODEL.SYNC_BN_CONFIG.GROUP_SIZE=0"]
        synced = {}
        for stage, flags in STAGES.items():
            extra = CHECKPOINTING if stage == "fsdp" else []  # recomputation re-syncs the same
            synced[stage], _ = run(swav, os.path.join(work, f"sync_{stage}"),
                                   steps + sync + flags + extra)
        print(f"SyncBatchNorm: {synced}")
        if len(set(synced.values())) != 1 or synced["ddp"] == prints["ddp"]:
            raise SystemExit("FAIL: SyncBatchNorm differs between stages (or equals per-rank BN)")

        # Batch-norm parameters and biases without weight decay (regularize_bn / regularize_bias
        # False, a visible decay): every stage alike, and not the run that decays everything.
        decay = sync + ["config.OPTIMIZER.weight_decay=0.05"]
        groups = decay + ["config.OPTIMIZER.regularize_bn=False",
                          "config.OPTIMIZER.regularize_bias=False"]
        # (fsdp as VISSL's FSDP task: its AUTO_SETUP_FSDP also makes the optimizer one group,
        # construct_single_param_group_only, which decays everything -- checked last)
        everything, _ = run(swav, os.path.join(work, "decay_all"), steps + decay)
        grouped = {}
        for stage, flags in STAGES.items():
            if stage == "fsdp":  # (with LARC as VISSL's set-up writes it)
                flags = ["config.TRAINER.TASK_NAME=self_supervision_fsdp_task",
                         "config.OPTIMIZER.name=sgd_fsdp",
                         "config.MODEL.FSDP_CONFIG.flatten_parameters=False"]
            grouped[stage], _ = run(swav, os.path.join(work, f"groups_{stage}"), steps + groups + flags)
        one_group, _ = run(swav, os.path.join(work, "groups_auto_fsdp"),
                           steps + groups + STAGES["fsdp"])
        print(f"no decay on batch-norm and biases: {grouped} (decay on all: {everything}; "
              f"AUTO_SETUP_FSDP's one group: {one_group})")
        if len(set(grouped.values())) != 1 or grouped["ddp"] == everything:
            raise SystemExit("FAIL: the no-decay group differs between stages (or has no effect)")
        if one_group != everything:
            raise SystemExit("FAIL: AUTO_SETUP_FSDP's one parameter group does not decay all")

        # Kill mid-epoch (20 iterations per epoch here), resume, compare.
        longer = ["config.MAX_ITERATIONS=12", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=4"]
        reference, _ = run(swav, os.path.join(work, "uninterrupted"), longer + STAGES["sdp"])
        for first, second in (("sdp", "sdp"), ("fsdp", "oss")):
            folder = os.path.join(work, f"killed_{first}_{second}")
            run(swav, folder, longer + STAGES[first], kill_after=8)
            resumed, output = run(swav, folder, longer + STAGES[second])
            if "resumed from" not in output:
                raise SystemExit(f"FAIL: the second run did not resume:\n{output}")
            print(f"killed under {first} after the checkpoint of iteration 8, resumed under "
                  f"{second}: {resumed}")
            if resumed != reference:
                raise SystemExit(f"FAIL: resumed {resumed} != uninterrupted {reference}")
        print(f"resumed runs equal the uninterrupted one ({reference})")

        # Resumed on twice the ranks (the queue off: it is per rank): the checkpoint's 10 steps
        # of 2 x 8 images are this run's 5 of 4 x 8, in the same epoch, and the run ends with
        # its schedule, at its own 10th step.
        no_queue = ["config.LOSS.swav_loss.queue.queue_length=0"]
        folder = os.path.join(work, "resized")
        run(swav, folder, no_queue + ["config.MAX_ITERATIONS=10",
                                      "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=5"])
        _, output = run(swav, folder, no_queue + ["config.DISTRIBUTED.NUM_PROC_PER_NODE=4"])
        moved = "the checkpoint's iteration 10 at 16 images a step is iteration 5 at this run's 32"
        if moved not in output or "resumed from" not in output or "step 10/10" not in output:
            raise SystemExit(f"FAIL: a resume on 4 ranks did not continue at step 5 of 10:\n{output}")
        print("resumed on 4 ranks from 2: " + moved)
        check_kill_chains(swav, work, int(os.environ.get("SHARDKIT_KILLS", "8")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
