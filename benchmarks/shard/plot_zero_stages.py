#!/usr/bin/env python3
"""Draws the per-category peak memory of one training step per ZeRO stage as stacked bars.

Usage: build/benchmarks/shard/zero_stages --csv peaks.csv
       benchmarks/shard/plot_zero_stages.py peaks.csv docs/zero_stages_peaks.png
Needs Debian's python3-matplotlib.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = ["parameters", "gradients", "optimizer_state", "communication", "activations", "other"]


def main(source, target):
    rows = list(csv.DictReader(open(source)))
    stages = [r["stage"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for category in CATEGORIES:
        values = [float(r[category]) for r in rows]
        ax.bar(stages, values, bottom=bottom, label=category.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values)]
    # Categories peak at different moments: the stack can exceed the peak of the total, which
    # is written above each bar.
    for x, r in enumerate(rows):
        ax.text(x, bottom[x] + 5, f'total {float(r["total"]):.0f}', ha="center", fontsize=8)
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.set_ylabel("MB per rank (each category's own peak)")
    ax.set_title("ResNet-50, Adam, N = 4, 8 images of 64x64 per rank:\n"
                 "peak memory over one training step", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_zero_stages.py PEAKS.csv OUT.png")
    main(sys.argv[1], sys.argv[2])
