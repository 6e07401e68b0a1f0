#!/usr/bin/env python3
"""The SwAV trainer on image files (DATA_SOURCES: [disk_folder]) against the IDX reader, and on
the synthetic source. Fashion-MNIST's first images are written out as an image folder (class
subfolders of PNG files, by tests/io/write_image_folder), and the same short run is made from
the IDX files and from the folder:
  - the network at initialisation sees the same images either way (a grey PNG decodes to the
    IDX bytes), so its kNN figure is the same to the last digit, and so is raw pixels';
  - after training the two runs differ in the order the sampler draws the images (the folder's
    order is by class, then shuffled), and a run this short is chaotic (seeds 1-3 end between
    53% and 64% from the same images), so the trained figures are only required to be learned
    ones (above a floor); the quick config's full-size comparison is in docs/swav.md;
  - the same images as JPEG files (lossy) and as RGB PNGs (a three-channel trunk) run too, their
    figures within a point of the IDX run's at initialisation.
Configs with problems in their data are refused with every problem in one report. Then the
synthetic source trains an RGB trunk end to end, and again under TEST_MODEL: False (no test
split, no kNN evaluation): the same parameters.
Usage: check_image_folder.py path/to/swav path/to/write_image_folder"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

FASHION = "/usr/share/datasets/fashion-mnist"
TRAIN, TEST = 6000, 2000
COMMON = [
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32",
    "config.DATA.TEST.BATCHSIZE_PER_REPLICA=100",
    "config.NEAREST_NEIGHBOR.TOPK=20",
    "config.DATA.NUM_DATALOADER_WORKERS=1",
    "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2, size_crops: [16],"
    " num_crops: [2], crop_scales: [[0.3, 1]]}, {name: RandomHorizontalFlip, p: 0.5},"
    " {name: ImgPilColorDistortion, strength: 0.5}, {name: ToTensor}, {name: Normalize,"
    " mean: MEAN, std: STD}]",
    # The network and optimizer of the shipped CPU configs (the defaults are VISSL's: a
    # ResNet-50 with ImageNet's stem, plain SGD)
    "config.MODEL.TRUNK.RESNETS.DEPTH=18",
    "config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=True",
    "config.OPTIMIZER.use_larc=True",
    "config.OPTIMIZER.weight_decay=0.000001",
    "config.OPTIMIZER.regularize_bn=True",
    "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=0.125",
    'config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [64, 32, 32], "use_bn": True, "num_clusters": [20]}]]',
    "config.OPTIMIZER.num_epochs=2",
    "config.LOG_FREQUENCY=20",
    "config.METRICS.PLOT=False",
    "config.CHECKPOINT.CHECKPOINT_FREQUENCY=100",
]
DONE = re.compile(r"kNN top-1 ([0-9.]+)% \(initial network ([0-9.]+)%, raw pixels ([0-9.]+)%\)")


def fingerprint(stdout):
    found = re.search(r"fingerprint ([0-9a-f]{16})", stdout)
    return found.group(1) if found else None


def arguments(swav, folder, sources, channels):
    mean, std = ("[0.286]", "[0.353]") if channels == 1 else ("[0.286, 0.286, 0.286]",
                                                              "[0.353, 0.353, 0.353]")
    args = [swav] + [a.replace("MEAN", mean).replace("STD", std) for a in COMMON]
    return args + [f"config.CHECKPOINT.DIR={folder}"] + sources


def run(swav, folder, sources, channels=1):
    out = subprocess.run(arguments(swav, folder, sources, channels), capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr)
        raise SystemExit(f"FAIL: swav exited {out.returncode}: {' '.join(sources)}")
    found = DONE.search(out.stdout)
    if not found:
        print(out.stdout)
        raise SystemExit("FAIL: no final kNN line")
    shutil.rmtree(folder, ignore_errors=True)
    return out.stdout, tuple(float(x) for x in found.groups())


def refused(swav, folder, sources, parts, channels=1):
    """The run stops before training with one report that says every one of `parts`."""
    out = subprocess.run(arguments(swav, folder, sources, channels), capture_output=True, text=True)
    missing = [p for p in parts if p not in out.stderr]
    if out.returncode != 1 or missing or "epoch 1/" in out.stdout:
        print(out.stdout, out.stderr)
        raise SystemExit(f"FAIL: exit {out.returncode}, the report lacks {missing}")
    print(f"refused, in one report that says all of: {parts[0]} ...")


def idx_sources():
    return [f"config.DATA.TRAIN.DATA_LIMIT={TRAIN}", f"config.DATA.TEST.DATA_LIMIT={TEST}"]


def folder_sources(train, test):
    return ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", f"config.DATA.TRAIN.DATA_PATHS=[{train}]",
            "config.DATA.TEST.DATA_SOURCES=[disk_folder]", f"config.DATA.TEST.DATA_PATHS=[{test}]"]


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    swav, writer = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(FASHION, "train-images-idx3-ubyte.gz")):
        print(f"SKIP: no Fashion-MNIST in {FASHION} (apt-get install dataset-fashion-mnist)")
        return 77
    work = tempfile.mkdtemp(prefix="swav_folder_")
    try:
        folders = {}
        for fmt in ("png", "jpg", "rgb-png"):
            for split, count in (("train", TRAIN), ("t10k", TEST)):
                path = os.path.join(work, f"{fmt}_{split}")
                subprocess.run([writer, FASHION, split, str(count), path, fmt], check=True)
                folders[fmt, split] = path
        ckpt = os.path.join(work, "ckpt")
        _, idx = run(swav, ckpt, idx_sources())
        out, png = run(swav, ckpt, folder_sources(folders["png", "train"], folders["png", "t10k"]))
        print(f"IDX: final {idx[0]:.2f}%, initial {idx[1]:.2f}%, raw pixels {idx[2]:.2f}%")
        print(f"PNG: final {png[0]:.2f}%, initial {png[1]:.2f}%, raw pixels {png[2]:.2f}%")
        if "data: images of" not in out or "grey, 28x28, 10 classes" not in out:
            print(out)
            raise SystemExit("FAIL: the run does not say it read a grey 28x28 image folder")
        failures = []
        if png[1] != idx[1] or png[2] != idx[2]:
            failures.append("the initial network's or raw pixels' kNN differ between IDX and PNG")
        if min(png[0], idx[0]) < 40:
            failures.append(f"final kNN {png[0]:.2f}% (PNG), {idx[0]:.2f}% (IDX): under 40%")
        _, jpg = run(swav, ckpt, folder_sources(folders["jpg", "train"], folders["jpg", "t10k"]))
        print(f"JPEG: final {jpg[0]:.2f}%, initial {jpg[1]:.2f}%, raw pixels {jpg[2]:.2f}%")
        if abs(jpg[1] - idx[1]) > 1.0 or abs(jpg[2] - idx[2]) > 1.0:
            failures.append("JPEG's initial or raw-pixel kNN more than a point from IDX's")
        out, rgb = run(swav, ckpt, folder_sources(folders["rgb-png", "train"],
                                                  folders["rgb-png", "t10k"]), channels=3)
        print(f"RGB PNG: final {rgb[0]:.2f}%, initial {rgb[1]:.2f}%, raw pixels {rgb[2]:.2f}%")
        if "RGB, 28x28" not in out:
            failures.append("the RGB folder was not read as RGB")
        if abs(rgb[2] - idx[2]) > 1e-9:
            failures.append("raw pixels of the RGB copies differ from the grey images'")
        if abs(rgb[1] - idx[1]) > 1.0:
            failures.append("the RGB trunk at initialisation is more than a point from the grey's")
        # Every problem of a config, its data's included, in the run's one report: a missing
        # folder (by path), DATA.TEST left at Fashion-MNIST, a misspelt key; then what only the
        # decoded images tell -- RGB training images against grey test images and a one-channel
        # Normalize --; then a frozen parameter the network does not have.
        missing = os.path.join(work, "no_such_folder")
        refused(swav, ckpt, ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                             f"config.DATA.TRAIN.DATA_PATHS=[{missing}]", "config.OPTIMIZER.num_epoch=1"],
                ["the config has 3 problems", f"config.DATA.TRAIN.DATA_PATHS = [{missing}]: image "
                 f"folder '{missing}'", "config.DATA.TEST is left at its default (fashion_mnist)",
                 "the nearest valid key is config.OPTIMIZER.num_epochs"])
        refused(swav, ckpt, folder_sources(folders["rgb-png", "train"], folders["png", "t10k"]),
                ["the config has 2 problems", "DATA.TRAIN's images have 3 channels and DATA.TEST's 1",
                 "DATA.TRAIN.TRANSFORMS' Normalize has 1 mean/std entries but the images have 3"])
        refused(swav, ckpt, idx_sources() + [
            "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[['module.heads.0.prototype0.weight', 3]]"],
                ["config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP names 'module.heads.0.prototype0.weight' "
                 "(the nearest is 'module.heads.0.prototypes0.weight')"])
        # The synthetic source: generated RGB images, 4 classes; the prototypes frozen for the
        # first steps, named as VISSL's SwAV configs name them (plain and FSDP-wrapped).
        training = [
            "config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_LIMIT=256",
            "config.DATA.TRAIN.DEFAULT_GRAY_IMG_SIZE=20", "config.DATA.TRAIN.RANDOM_SYNTHETIC_LABELS=4",
            "config.MAX_ITERATIONS=10",
            "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[['module.heads.0.prototypes0.weight', 4], "
            "['_fsdp_wrapped_module.heads.0._fsdp_wrapped_module._fpw_module.prototypes0."
            "_fsdp_wrapped_module.weight', 4]]"]
        out, syn = run(swav, ckpt, training + [
            "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_LIMIT=64",
            "config.DATA.TEST.DEFAULT_GRAY_IMG_SIZE=20"], channels=3)
        print(f"synthetic: final {syn[0]:.2f}%, initial {syn[1]:.2f}%, raw pixels {syn[2]:.2f}%")
        if "synthetic images (256, RGB, 20x20, 4 classes)" not in out:
            failures.append("the synthetic run does not describe its images")
        if syn[2] < 50:
            failures.append("raw-pixel kNN on the synthetic images is near chance (25%)")
        # TEST_MODEL: False (VISSL's pretraining configs say it, and give no DATA.TEST): the same
        # training without any kNN evaluation -- the same parameters bit for bit, which also
        # shows that the evaluations leave the training alone.
        untested = subprocess.run(arguments(swav, ckpt, training + ["config.TEST_MODEL=False"], 3),
                                  capture_output=True, text=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        print("TEST_MODEL False: " + next((line for line in untested.stdout.splitlines()
                                           if line.startswith("done:")), "no done line"))
        if (untested.returncode != 0 or "no kNN evaluation (TEST_MODEL: False)" not in untested.stdout
                or "kNN top-1" in untested.stdout or "raw-pixel" in untested.stdout):
            print(untested.stdout, untested.stderr)
            failures.append("TEST_MODEL False did not train without the kNN evaluations")
        elif fingerprint(out) is None or fingerprint(untested.stdout) != fingerprint(out):
            failures.append("TEST_MODEL False trained other parameters than the tested run")
        if failures:
            raise SystemExit("FAIL: " + "; ".join(failures))
        print("OK: image folders (PNG, JPEG, RGB) and the synthetic source")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
