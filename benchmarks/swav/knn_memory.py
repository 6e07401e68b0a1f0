#!/usr/bin/env python3
"""The SwAV trainer's host memory at its kNN figures, against what each figure's floats must
take. Eight ranks as threads of one process, synthetic images, batches of 2; the run is stopped
at the figure (the training itself is not measured). Reported: the process's peak resident set
(VmHWM) when the figure is printed, the seconds to it, the figure, and the floor beside it.

  --figure raw      The raw-pixel figure, on 224-pixel crops (ImageNet's stem): 1000 training
                    images of 28 pixels as the memory bank and 200 test images of 32, so that the
                    raw pixels are resized to 224 x 224 x 3 floats (602 kB an image). The floor:
                    the bank's floats once and every test image's once (samples/swav/datasets.hpp's
                    SharedRawBank, each rank making its own queries); every rank making both
                    whole would take 8 times as much.
  --figure network  The initial network's figure on the quick config's four feature sets (res3
                    pooled 2 x 2, res4, res5, res5avg: 6 880 floats an image): 10 000 bank images
                    and 2 000 test images of 28 pixels. The floor: the bank's features once (each
                    rank keeps its share, trainer.hpp's sharded_knn_accuracy) and every test
                    image's on each rank (each shard is asked every query); every rank holding
                    the whole bank would take 8 times the bank. The rise of the peak from the
                    raw-pixel figure to this one is set beside the floor.
  Beside each, the trainer's own estimate of the larger kNN figure's floats with the model states
  (its host-memory line), which its check holds against the available memory before the ranks
  start (samples/swav/rank_setup.hpp).

  benchmarks/swav/knn_memory.py [build/samples/swav/swav] [--figure raw|network] [--runs 2]"""
import argparse
import os
import re
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANKS = 8
# (bank images, their side, test images, their side, the crops' side)
SCENES = {"raw": (1000, 28, 200, 32, 224), "network": (10000, 28, 2000, 28, 20)}
NETWORK_FEATURES = 32 * 7 * 7 + 64 * 7 * 7 + 128 * 4 * 4 + 128  # the quick config's sets


def arguments(swav, work, figure):
    bank, bank_side, test, test_side, crop = SCENES[figure]
    args = [swav, f"config={os.path.join(ROOT, 'samples/swav/configs/quick_cpu.yaml')}",
            f"config.CHECKPOINT.DIR={work}", f"config.DISTRIBUTED.NUM_PROC_PER_NODE={RANKS}",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2", "config.METRICS.PLOT=False",
            "config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_PATHS=[]",
            f"config.DATA.TRAIN.DATA_LIMIT={bank}",
            f"config.DATA.TRAIN.DEFAULT_GRAY_IMG_SIZE={bank_side}",
            "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_PATHS=[]",
            f"config.DATA.TEST.DATA_LIMIT={test}",
            f"config.DATA.TEST.DEFAULT_GRAY_IMG_SIZE={test_side}",
            "config.DATA.TEST.TRANSFORMS=[{name: ToTensor}, {name: Normalize, mean: [0.5, 0.5, "
            "0.5], std: [0.25, 0.25, 0.25]}]",
            f"config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT={bank}",
            "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2,"
            f" size_crops: [{crop}], num_crops: [2], crop_scales: [[0.3, 1]]}}, {{name: ToTensor}},"
            " {name: Normalize, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}]"]
    if figure == "raw":
        args.append("config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=False")
    else:  # forward passes of 16 images: the features' floats, not the activations, rise
        args.append("config.DATA.TEST.BATCHSIZE_PER_REPLICA=16")
    return args


def peak_of(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))


def run(swav, work, figure):
    """(peak at the raw-pixel figure, peak at the figure, seconds to it, the figure)"""
    start = time.monotonic()
    process = subprocess.Popen(arguments(swav, work, figure), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output, raw_peak, estimate = [], None, None
    wanted = r"raw-pixel kNN .*: ([0-9.]+)%" if figure == "raw" else \
        r"initial network: kNN .*: ([0-9.]+)% \(raw"
    for line in process.stdout:
        output.append(line)
        said = re.search(r"at a kNN evaluation about ([0-9.]+) GB with the states", line)
        if said:
            estimate = float(said.group(1)) * 1e9
        if raw_peak is None and re.search(r"raw-pixel kNN", line):
            raw_peak = peak_of(process.pid)
        found = re.search(wanted, line)
        if found:
            peak = peak_of(process.pid)
            seconds = time.monotonic() - start
            process.kill()
            process.wait()
            return raw_peak, peak, seconds, found.group(1), estimate
    process.wait()
    raise SystemExit(f"no {figure} kNN figure:\n" + "".join(output))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("swav", nargs="?", default=os.path.join(ROOT, "build/samples/swav/swav"))
    parser.add_argument("--figure", choices=sorted(SCENES), default="raw")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    bank, _, test, _, crop = SCENES[args.figure]
    if args.figure == "raw":
        floor = (bank + test) * 3 * crop * crop * 4
        print(f"raw-pixel floats: {floor / 1e9:.2f} GB once (bank {bank} + test {test} images of "
              f"{3 * crop * crop} floats); every one of {RANKS} ranks making both whole: "
              f"{RANKS * floor / 1e9:.2f} GB")
    else:
        row = NETWORK_FEATURES * 4
        floor = (bank + RANKS * test) * row
        print(f"network features: {floor / 1e9:.2f} GB (the bank's {bank} images once, {test} "
              f"test images on each of {RANKS} ranks, {NETWORK_FEATURES} floats an image); every "
              f"rank holding both whole: {RANKS * (bank + test) * row / 1e9:.2f} GB")
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="shardkit_knn_memory_") as work:
            raw_peak, peak, seconds, figure, estimate = run(args.swav, work, args.figure)
        said = (f"; the trainer's estimate before the ranks start: {estimate / 1e9:.2f} GB with the "
                f"model states" if estimate else "")
        if args.figure == "raw":
            print(f"peak resident set at the raw-pixel figure: {peak / 1e9:.2f} GB "
                  f"({peak / floor:.2f}x the floats' floor), after {seconds:.1f} s; figure {figure}%"
                  f"{said}")
        else:
            rise = peak - raw_peak
            print(f"peak resident set at the raw-pixel figure {raw_peak / 1e9:.2f} GB, at the "
                  f"network's first figure {peak / 1e9:.2f} GB: a rise of {rise / 1e9:.2f} GB "
                  f"({rise / floor:.2f}x the features' floor), after {seconds:.1f} s; "
                  f"figure {figure}%{said}")


if __name__ == "__main__":
    main()
