#!/usr/bin/env python3
"""PNG curves from SwAV metrics files (the trainer's JSON lines): loss, learning rate, kNN
accuracy (a line per feature set when a run evaluates several) and peak memory per rank against
the iteration, one line per run.

  plot_metrics.py OUT.png RUN.jsonl [RUN2.jsonl ...]     (Debian: python3-matplotlib)

Each run is labelled by its file's folder name (the checkpoint folder) and its stage."""
import json
import os
import sys

try:
    import matplotlib
except ImportError:
    if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3", __file__] + sys.argv[1:])
    sys.exit("plot_metrics: needs matplotlib (apt-get install python3-matplotlib)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    steps, knn = [], []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row:
                steps.append(row)
            if "knn" in row or "knn_init" in row:
                headline = row.get("knn", row.get("knn_init"))
                knn.append((row["iteration"], headline, row.get("raw_knn"),
                            row.get("knn_by_layer", {})))
    return steps, knn


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (loss_ax, lr_ax), (knn_ax, mem_ax) = axes
    raw = None
    for path in sys.argv[2:]:
        steps, knn = read(path)
        stage = steps[0].get("stage", "?") if steps else "?"
        label = f"{os.path.basename(os.path.dirname(os.path.abspath(path)))} ({stage})"
        it = [s["iteration"] for s in steps]
        loss_ax.plot(it, [s["loss"] for s in steps], label=label)
        lr_ax.plot(it, [s["lr"] for s in steps], label=label)
        mem_ax.plot(it, [s["peak_bytes_per_rank"] / 1e6 for s in steps], label=label)
        if knn:
            # A run that evaluates several feature sets (LINEAR_EVAL_FEAT_POOL_OPS_MAP) gets a
            # line per set, in its colour; otherwise the headline figure alone.
            layers = list(knn[0][3]) if len(knn[0][3]) > 1 else []
            if layers:
                colour = loss_ax.get_lines()[-1].get_color()
                for layer, marker in zip(layers, "osd^v<>p*"):
                    points = [(k[0], k[3][layer]) for k in knn if layer in k[3]]
                    knn_ax.plot([p[0] for p in points], [100 * p[1] for p in points],
                                marker + "-", color=colour, label=f"{label} {layer}")
            else:
                knn_ax.plot([k[0] for k in knn], [100 * k[1] for k in knn], "o-", label=label)
            raw = next((k[2] for k in knn if k[2] is not None), raw)
    if raw is not None:
        knn_ax.axhline(100 * raw, color="gray", linestyle="--", label="raw pixels")
    for ax, title, unit in ((loss_ax, "SwAV loss", ""), (lr_ax, "learning rate", ""),
                            (knn_ax, "kNN top-1 on the test set", "%"),
                            (mem_ax, "peak memory per rank (largest rank)", "MB")):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        if unit:
            ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
        elif ax is knn_ax:  # runs under TEST_MODEL: False evaluate nothing
            ax.text(0.5, 0.5, "no kNN evaluation (TEST_MODEL: False)", ha="center",
                    va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
