#!/usr/bin/env python3
"""The SwAV trainer's host memory when it prints the raw-pixel kNN figure, against what that
figure's floats must take. Eight ranks as threads of one process, the quick config's network on
224-pixel crops (ImageNet's stem), synthetic images: 1000 training images of 28 pixels as the
memory bank and 200 test images of 32, so that the raw pixels are resized to 224 x 224 x 3
floats (602 kB an image). The floor: the bank's floats once and every test image's once
(samples/swav/datasets.hpp's SharedRawBank, each rank making its own queries); a design where
every rank made both whole would take 8 times as much. Reported: the process's peak resident
set (VmHWM) when the figure is printed, the seconds to it, the figure, and the floor beside it.
The run is stopped there (the training itself is not measured).

  benchmarks/swav/raw_knn_memory.py [build/samples/swav/swav] [--runs 2]"""
import argparse
import os
import re
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANKS, BANK, TEST, SIDE = 8, 1000, 200, 224


def run(swav, work):
    args = [swav, f"config={os.path.join(ROOT, 'samples/swav/configs/quick_cpu.yaml')}",
            f"config.CHECKPOINT.DIR={work}", f"config.DISTRIBUTED.NUM_PROC_PER_NODE={RANKS}",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2", "config.METRICS.PLOT=False",
            "config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=False",
            "config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_PATHS=[]",
            f"config.DATA.TRAIN.DATA_LIMIT={BANK}", "config.DATA.TRAIN.DEFAULT_GRAY_IMG_SIZE=28",
            "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_PATHS=[]",
            f"config.DATA.TEST.DATA_LIMIT={TEST}", "config.DATA.TEST.DEFAULT_GRAY_IMG_SIZE=32",
            "config.DATA.TEST.TRANSFORMS=[{name: ToTensor}]",
            f"config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT={BANK}",
            "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2,"
            f" size_crops: [{SIDE}], num_crops: [2], crop_scales: [[0.3, 1]]}}, {{name: ToTensor}},"
            " {name: Normalize, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}]"]
    start = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in process.stdout:
        output.append(line)
        found = re.search(r"raw-pixel kNN .*: ([0-9.]+)%", line)
        if found:
            with open(f"/proc/{process.pid}/status") as status:
                peak = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))
            seconds = time.monotonic() - start
            process.kill()
            process.wait()
            return peak, seconds, found.group(1)
    process.wait()
    raise SystemExit("no raw-pixel kNN figure:\n" + "".join(output))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("swav", nargs="?", default=os.path.join(ROOT, "build/samples/swav/swav"))
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    floor = (BANK + TEST) * 3 * SIDE * SIDE * 4
    print(f"raw-pixel floats: {floor / 1e9:.2f} GB once (bank {BANK} + test {TEST} images of "
          f"{3 * SIDE * SIDE} floats); every one of {RANKS} ranks making both whole: "
          f"{RANKS * floor / 1e9:.2f} GB")
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="shardkit_raw_knn_") as work:
            peak, seconds, figure = run(args.swav, work)
        print(f"peak resident set at the raw-pixel figure: {peak / 1e9:.2f} GB "
              f"({peak / floor:.2f}x the floats' floor), after {seconds:.1f} s; figure {figure}%")


if __name__ == "__main__":
    main()
