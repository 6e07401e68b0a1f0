#!/usr/bin/env python3
"""Images/s of a SwAV training step: shardkit's trainer against PyTorch (eager) running the
same network and crops in the same run, on the CPU or on a CUDA GPU.

  swav_vs_torch.py path/to/swav [STEPS] [--device cpu|cuda] [--rounds R] [--network quick|gpu]
                   [--queue N] [--only shardkit|pytorch] [config.KEY=VALUE ...]

On the GPU both run one rank with the whole batch of 64 (ours: config.MACHINE.DEVICE=gpu);
config overrides pass through to ours (e.g. the dataset's folder on a machine without the
package). SWAV_LD_LIBRARY_PATH, when set, is the library path ours runs with (gpu-check's
CUDA libraries, which must not shadow PyTorch's own).

Ours: `swav` with the quick CPU config's network at this benchmark's batch of 64 (2 local ranks
of 32 images; the quick config itself takes 256), 2 x 20-pixel crops,
ResNet-18 a quarter wide with one input channel, swav_head 128-128-64, 100 prototypes learning
from the first step as PyTorch's, LARC-SGD), its own reported training images/s over the STEPS
steps after 5 warm-up steps (PyTorch's too). PyTorch: one process with 2
threads and a batch of 64 (the same global batch and FLOPs), the same network in torch.nn,
the same crop sizes, Sinkhorn-Knopp and the swapped-prediction loss, SGD with momentum (LARC's
per-tensor norms add little). Ours also makes its crops on worker threads on the same two
cores; PyTorch's reuses one random batch, so the ratio is, if anything, unfair to us.

--network gpu (with --device cuda) measures the GPU config instead: configs/gpu.yaml's full-width
ResNet-18 (one input channel, small stem), swav_head 512-512-128, 100 prototypes, one rank with a
batch of 256 (512 crops of 24 pixels), bf16 mixed precision (PyTorch: autocast to bf16, f32
masters); --queue N adds a queue of N past embeddings per assignment crop from the first step
(ours: config.LOSS.swav_loss.queue.queue_length=N, start_iter=0), scored with the prototypes and
appended to the batch's scores before Sinkhorn on both sides.

Both are measured in R rounds (default 3), alternating which goes first, and each side's median
is the figure: a lent GPU's host moved both sides' single runs by 30-40% between calls a minute
apart, more than the difference measured. Prints every round, then both medians and their
ratio (the last line). --only runs one side alone (for a profiler wrapped around this script)
and prints its figures without a ratio."""
import argparse
import contextlib
import statistics
import os
import re
import subprocess
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3", __file__] + sys.argv[1:])
    print("swav_vs_torch: needs PyTorch (apt-get install python3-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "autograd"))
from torch_resnet18 import ResNet18  # noqa: E402


# The two networks: trunk width, head dims and crop size of quick_cpu.yaml and gpu.yaml (ours
# reads them from the config; keep these in step), and the global batch measured (quick: 64,
# the batch its figures have been measured at since the start).
NETWORKS = {"quick": dict(width=16, dims=(128, 128, 64), crop=20, batch=64, config="quick_cpu.yaml"),
            "gpu": dict(width=64, dims=(512, 512, 128), crop=24, batch=256, config="gpu.yaml")}


class Swav(nn.Module):
    def __init__(self, width, dims):
        super().__init__()
        trunk = ResNet18(10, small_image_stem=True, base_channels=width)
        trunk.conv1 = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        trunk.fc = nn.Identity()
        self.trunk = trunk
        self.head = nn.Sequential(nn.Linear(dims[0], dims[1]), nn.BatchNorm1d(dims[1]), nn.ReLU(),
                                  nn.Linear(dims[1], dims[2]))
        self.prototypes = nn.Linear(dims[2], 100, bias=False)

    def forward(self, crops):
        z = F.normalize(self.head(self.trunk(crops)), dim=1)
        return z, self.prototypes(z)


def sinkhorn(scores, eps=0.05, iters=3):
    with torch.no_grad():
        q = torch.exp(scores / eps - (scores / eps).max()).t()
        q /= q.sum()
        k, b = q.shape
        for _ in range(iters):
            q /= q.sum(dim=1, keepdim=True)
            q /= k
            q /= q.sum(dim=0, keepdim=True)
            q /= b
        return (q * b).t()


# Steps both sides run before the timed ones (the first steps make cuDNN plans, capture a step
# graph, fill caches); the figures are over the STEPS after them on both sides.
WARM_UP_STEPS = 5


def torch_images_per_second(steps, device, network, queue_length):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    net = NETWORKS[network]
    batch = net["batch"]
    model = Swav(net["width"], net["dims"]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)
    crops = torch.randn(2 * batch, 1, net["crop"], net["crop"], device=device)
    # One queue per assignment crop, newest first, uniform in +-1/sqrt(D/3) to start.
    bound = 1 / (net["dims"][2] / 3) ** 0.5
    queues = [torch.empty(queue_length, net["dims"][2], device=device).uniform_(-bound, bound)
              for _ in range(2)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    amp = network == "gpu" and device == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    def step():
        opt.zero_grad()
        with autocast:
            embeddings, scores = model(crops)
        scores = scores.float()
        loss = 0
        for a in (0, 1):
            own = scores[a * batch:(a + 1) * batch].detach()
            if queue_length:
                with torch.no_grad():
                    own = torch.cat([own, model.prototypes(queues[a])])
                    queues[a] = torch.cat([embeddings[a * batch:(a + 1) * batch].detach().float(),
                                           queues[a][:-batch]])
            q = sinkhorn(own)[:batch]
            p = 1 - a
            loss = loss - (q * F.log_softmax(scores[p * batch:(p + 1) * batch] / 0.1, dim=1)).sum(1).mean()
        (loss / 2).backward()
        opt.step()
        with torch.no_grad():
            model.prototypes.weight.copy_(F.normalize(model.prototypes.weight, dim=1))
    for _ in range(WARM_UP_STEPS):
        step()
    sync()
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return steps * batch / (time.perf_counter() - begin)


def ours_images_per_second(swav, steps, device, network, queue_length, overrides):
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "samples", "swav",
                          "configs", NETWORKS[network]["config"])
    if queue_length:
        overrides = [f"config.LOSS.swav_loss.queue.queue_length={queue_length}",
                     "config.LOSS.swav_loss.queue.start_iter=0"] + overrides
    folder = f"/tmp/shardkit_swav_bench_{os.getpid()}"
    env = dict(os.environ)
    if "SWAV_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["SWAV_LD_LIBRARY_PATH"]
    # The prototypes learn from the first step, as PyTorch's do (the configs freeze them for the
    # first epoch, which would leave ours their update and gradient less to do).
    out = subprocess.run([swav, f"config={config}", f"config.CHECKPOINT.DIR={folder}",
                          f"config.MAX_ITERATIONS={WARM_UP_STEPS + steps}",
                          "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=-1",
                          "config.CHECKPOINT.CHECKPOINT_FREQUENCY=0",
                          "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[]",
                          "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT=200", "config.DATA.TEST.DATA_LIMIT=100",
                          f"config.LOG_FREQUENCY={WARM_UP_STEPS}"]
                         + (["config.MACHINE.DEVICE=gpu", "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
                             f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={NETWORKS[network]['batch']}"]
                            if device == "cuda"
                            else ["config.MACHINE.DEVICE=cpu",
                                  f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={NETWORKS[network]['batch'] // 2}"])
                         + overrides,
                         capture_output=True, text=True, env=env)
    subprocess.run(["rm", "-rf", folder])
    if out.returncode != 0:  # the trainer's own words: why it stopped (a refused capture, ...)
        sys.stderr.write(out.stdout[-2000:] + out.stderr[-4000:])
        out.check_returncode()
    lines = out.stdout.splitlines()
    # Whether the step ran as a graph (MACHINE.CUDA_GRAPH auto decides), beside the figure.
    print("  shardkit: " + next((line for line in lines if line.startswith("step graph")),
                                "no step graph (eager steps)"), flush=True)
    # Each progress line's img/s covers the steps since the line before (evaluations left out):
    # the rate over the steps after the warm-up is their steps over their summed seconds.
    windows, before = [], 0
    for line in lines:
        m = re.search(r"step (\d+)/\d+ .* ([0-9.]+) img/s", line)
        if m:
            at, rate = int(m[1]), float(m[2])
            if before >= WARM_UP_STEPS:
                windows.append((at - before, rate))
            before = at
    timed = sum(n for n, _ in windows)
    if timed != steps:
        sys.exit(f"swav_vs_torch: ours logged {timed} of the {steps} steps after its warm-up")
    return timed / sum(n / rate for n, rate in windows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("swav")
    parser.add_argument("steps", nargs="?", type=int, default=60)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--network", choices=tuple(NETWORKS), default="quick")
    parser.add_argument("--queue", type=int, default=0, metavar="N")
    parser.add_argument("--only", choices=("shardkit", "pytorch"))
    args, overrides = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    batch = NETWORKS[args.network]["batch"]
    if args.queue < 0 or args.queue % batch:
        parser.error(f"--queue must be a non-negative multiple of the batch ({batch}), got {args.queue}")
    if args.only:
        for index in range(args.rounds):
            rate = (ours_images_per_second(args.swav, args.steps, args.device, args.network, args.queue,
                                           overrides) if args.only == "shardkit"
                    else torch_images_per_second(args.steps, args.device, args.network, args.queue))
            print(f"round {index + 1}: {args.only} {rate:.1f} img/s", flush=True)
        return 0
    ours, theirs = [], []
    for index in range(args.rounds):
        measure = [lambda: ours.append(ours_images_per_second(args.swav, args.steps, args.device, args.network,
                                                              args.queue, overrides)),
                   lambda: theirs.append(torch_images_per_second(args.steps, args.device, args.network, args.queue))]
        for run in (measure if index % 2 == 0 else reversed(measure)):
            run()
        print(f"round {index + 1}: shardkit {ours[-1]:.1f} img/s, PyTorch {theirs[-1]:.1f} img/s, "
              f"ratio {ours[-1] / theirs[-1]:.2f}", flush=True)
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    ratios = [a / b for a, b in zip(ours, theirs)]
    where = "2 cores" if args.device == "cpu" else torch.cuda.get_device_name()
    what = f"{args.network} network, queue {args.queue}" if args.queue else f"{args.network} network"
    print(f"SwAV step ({what}), 2 x {NETWORKS[args.network]['crop']}px crops, global batch {batch}, {where}, median of {args.rounds} rounds: "
          f"shardkit {ours_median:.1f} img/s, PyTorch {torch.__version__} eager {theirs_median:.1f} img/s, "
          f"ratio {ours_median / theirs_median:.2f} (rounds' ratios {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
