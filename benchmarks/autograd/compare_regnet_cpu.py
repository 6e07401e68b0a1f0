#!/usr/bin/env python3
"""Our RegNetY-400MF training step (bench_autograd's BM_regnet_y_400mf_train_step) against
PyTorch eager's on this CPU, alternating in rounds so both see the same machine state.

  benchmarks/autograd/compare_regnet_cpu.py [BUILD_DIR] [--reps N] [--rounds R] [--threads T]
                                            [--config BATCHxHW]

The step on both sides: gradients cleared, a training-mode forward of ClassyVision's
regnet_y_400mf (torch_regnet.py builds PyTorch's from ClassyVision's code; ours is
nn::RegNet), cross-entropy against label 0, backward; images uniform in [-1, 1); 32-pixel
images take the CIFAR-style stem (res_stem_cifar) and 10 classes, 224-pixel ones RegNet's stem
and 1000. Each round times N steps on each side after a warm-up step (ours: N repetitions of the
benchmark, each the mean of the steps Google Benchmark runs in 2 s; PyTorch: N single steps) and
takes each side's median; the table gives the median of the rounds' ratios and their range.
Both sides run on T threads (default 1): ours through SHARDKIT_NUM_THREADS, PyTorch's through
torch.set_num_threads. Needs PyTorch (Debian: apt-get install python3-torch; this script re-runs
itself under /usr/bin/python3 when that one has it)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
from torch_support import ours_env, require_torch  # noqa: E402
from torch_regnet import regnet_in_torch, regnet_stages  # noqa: E402

CONFIGS = [(32, 32), (8, 224)]


def ours_ms(bench, config, reps, threads):
    batch, hw = config
    out = subprocess.run(
        [bench, f"--benchmark_filter=BM_regnet_y_400mf_train_step/batch:{batch}/HW:{hw}/",
         f"--benchmark_repetitions={reps}", "--benchmark_format=json"],
        capture_output=True, text=True, check=True,
        env=dict(ours_env(), SHARDKIT_NUM_THREADS=str(threads)))
    runs = [b for b in json.loads(out.stdout)["benchmarks"] if b.get("run_type") == "iteration"]
    if not runs:
        raise SystemExit(f"compare_regnet_cpu: {bench} ran no BM_regnet_y_400mf_train_step")
    return statistics.median(b["real_time"] for b in runs)  # (ms: the benchmark's unit)


def torch_ms(torch, config, reps):
    batch, hw = config
    small = hw <= 64
    torch.manual_seed(0)
    model = regnet_in_torch(torch, regnet_stages(16, 48, 27.89, 2.09, 8), 32, 10 if small else 1000,
                            stem="res_stem_cifar" if small else "simple_stem_in")
    model.train()
    images = torch.rand(batch, 3, hw, hw) * 2 - 1
    labels = torch.zeros(batch, dtype=torch.long)

    def step():
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.cross_entropy(model(images), labels).backward()

    step()  # (warm-up)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("build", nargs="?", default="build")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--config", action="append", metavar="BATCHxHW")
    args = p.parse_args()
    torch = require_torch("compare_regnet_cpu", __file__)
    torch.set_num_threads(args.threads)
    bench = os.path.join(args.build, "benchmarks", "autograd", "bench_autograd")
    if not os.access(bench, os.X_OK):
        raise SystemExit(f"compare_regnet_cpu: {bench} not built (ninja -C {args.build} {bench})")
    configs = [tuple(int(v) for v in c.split("x")) for c in args.config] if args.config else CONFIGS
    print(f"== {time.strftime('%F %T', time.gmtime())} UTC, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    rows = []
    for config in configs:
        pairs = []
        for r in range(args.rounds):
            ours = ours_ms(bench, config, args.reps, args.threads)
            theirs = torch_ms(torch, config, args.reps)
            print(f"   batch {config[0]}, {config[1]}x{config[1]}, round {r + 1}: ours {ours:.1f} "
                  f"ms, PyTorch {theirs:.1f} ms")
            pairs.append((ours, theirs))
        rows.append((config, pairs))
    print("| RegNetY-400MF step | threads | ours ms | ours img/s | PyTorch ms | PyTorch img/s | "
          "ours / PyTorch speed | rounds' range |")
    print("|---|---|---|---|---|---|---|---|")
    for (batch, hw), pairs in rows:
        ratios = [theirs / ours for ours, theirs in pairs]
        o = statistics.median(ours for ours, _ in pairs)
        t = statistics.median(theirs for _, theirs in pairs)
        print(f"| batch {batch}, {hw}x{hw} | {args.threads} | {o:.1f} | {batch * 1e3 / o:.1f} | "
              f"{t:.1f} | {batch * 1e3 / t:.1f} | {statistics.median(ratios):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)}) |")


if __name__ == "__main__":
    main()
