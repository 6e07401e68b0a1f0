#!/usr/bin/env python3
"""PyTorch eager peer of the ResNet-18 training step in bench_autograd (CPU) and
bench_gpu (GPU, benchmarks/autograd/bench_autograd_gpu.cu): the same network, batch, image
size, classes, stem and step, timed the same way, so the ratio between the two means something.

The step matches autograd_workloads.hpp's resnet18_step: parameters' gradients set to None
(our zero_grad clears them), forward in training mode (batch statistics), cross-entropy against
all-zero labels, backward. No optimizer, as in ours; --sgd adds torch.optim.SGD's step for
reference. Inputs are uniform in [-1, 1); the small-image stem (3x3 stride-1 conv, no max-pool)
and 10 classes are used for images of 64 px or less, the ImageNet stem and 1000 classes otherwise.

Timing: CPU, --warmup steps (default 1: bench_autograd runs one before timing) then --iters
steps timed one by one with perf_counter, on --threads threads (default 1: bench_autograd is
single-threaded). GPU: cudnn.benchmark on, TF32 on for convolutions and matmuls (as
bench_gpu sets for cuDNN and cuBLAS), 3 warm-up steps as bench_gpu, each step
timed with CUDA events on the current stream. Reports median and mean ms/step and images/s
(batch / median).

Install: Debian/Ubuntu `sudo apt-get install python3-torch` (1.13, CPU only) and run it with
/usr/bin/python3; a GPU machine's python3 with a CUDA build of PyTorch (`pip install torch`)
runs --device cuda. torchvision is used when present, else the same BasicBlock ResNet-18 built
here from torch.nn.

  /usr/bin/python3 benchmarks/autograd/resnet18_torch_peer.py                  # CPU configs
  python3 benchmarks/autograd/resnet18_torch_peer.py --device cuda --json      # GPU configs
  ... --config 32x32 --iters 5                                                 # one config
"""
import argparse
import json
import os
import statistics
import sys
import time

# The configurations of BM_resnet18_train_step (CPU) and BM_resnet18_train_step_gpu:
# (batch, image size, base width). The last is host-bound: 4 channels on 8x8 images.
CONFIGS = {"cpu": [(32, 32, 64), (8, 224, 64), (64, 20, 16), (2, 8, 4)],
           "cuda": [(256, 32, 64), (64, 224, 64), (2, 8, 4)]}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--config", action="append", metavar="BATCHxHW[xWIDTH]",
                   help="batch x image size [x base width, default 64], e.g. 32x32 or 2x8x4; "
                        "repeatable (default: the bench's configs)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on the CPU (default 1)")
    p.add_argument("--channels-last", action="store_true",
                   help="the model and images in torch.channels_last (NHWC activations)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: 1 CPU, 3 GPU)")
    p.add_argument("--iters", type=int, help="timed steps (default: 5 CPU, 20 GPU)")
    p.add_argument("--sgd", action="store_true", help="add an SGD step (ours has no optimizer)")
    p.add_argument("--compile", action="store_true",
                   help="GPU: the model under torch.compile(mode='reduce-overhead') (Inductor's "
                        "kernels replayed as CUDA graphs), with 10 warm-up steps for compiling "
                        "and recording")
    p.add_argument("--json", action="store_true", help="also print one JSON line per config")
    p.add_argument("--profile", action="store_true",
                   help="after timing, run the timed steps again under PyTorch's profiler and "
                        "print where the time goes per op (self time, summed over those steps)")
    return p.parse_args()


args = parse_args()
if args.device == "cpu":
    # OpenMP and BLAS pools size themselves when torch loads: fix them before the import.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    # A note, not a failure: scripts/gpu-check runs this wherever python3 may lack PyTorch.
    print(f"resnet18_torch_peer: no PyTorch for {sys.executable} (see the install note at the top)")
    sys.exit(0)

from torch_resnet18 import build_model  # noqa: E402  (after the torch check)


def measure(device, batch, hw, width):
    classes = 10 if hw <= 64 else 1000
    small_stem = hw <= 64
    model, source = build_model(classes, small_stem, width)
    model = model.to(device).train()
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model, mode="reduce-overhead")
    images = torch.empty(batch, 3, hw, hw, device=device).uniform_(-1, 1)
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if args.sgd else None

    def step():
        if args.compile:  # a new step: the graphs' outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        if optimizer is not None:
            optimizer.step()

    gpu = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if args.compile else 3 if gpu else 1)
    iters = args.iters if args.iters is not None else (20 if gpu else 5)
    for _ in range(warmup):
        step()
    # A timing covers `repeat` steps, enough for 0.2 s on the CPU: a host-bound step of a
    # millisecond is too short to time alone (ours, Google Benchmark, repeats it for 2 s).
    repeat = 1
    if not gpu:
        t0 = time.perf_counter()
        step()
        repeat = max(1, int(0.2 / max(time.perf_counter() - t0, 1e-6)))
    times_ms = []
    if gpu:
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            start.record()
            step()
            stop.record()
            stop.synchronize()
            times_ms.append(start.elapsed_time(stop))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(repeat):
                step()
            times_ms.append((time.perf_counter() - t0) * 1e3 / repeat)
    median = statistics.median(times_ms)
    if args.profile:
        with torch.autograd.profiler.profile() as prof:
            for _ in range(iters):
                step()
        print(f"== PyTorch's profiler, {iters} steps, batch {batch}, {hw}x{hw}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return {
        "peer": "pytorch-compile" if args.compile else "pytorch", "torch": torch.__version__,
        "model": source, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if gpu else None,
        "threads": None if gpu else torch.get_num_threads(), "batch": batch, "hw": hw,
        "width": width, "channels_last": args.channels_last,
        "classes": classes, "stem": "small" if small_stem else "imagenet", "sgd": args.sgd,
        "warmup": warmup, "iters": iters, "ms_median": median,
        "ms_mean": statistics.fmean(times_ms), "ms_min": min(times_ms),
        "images_per_s": batch * 1e3 / median,
    }


def main():
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"resnet18_torch_peer: torch {torch.__version__} has no usable CUDA device")
            return 0
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = True
        device = torch.device("cuda")
    else:
        torch.set_num_threads(args.threads)
        torch.set_num_interop_threads(1)
        device = torch.device("cpu")
    configs = CONFIGS[args.device]
    if args.config:
        configs = [tuple(int(v) for v in c.lower().split("x")) for c in args.config]
        configs = [c if len(c) == 3 else (*c, 64) for c in configs]
    torch.manual_seed(0)
    for batch, hw, width in configs:
        r = measure(device, batch, hw, width)
        where = r["gpu"] if r["gpu"] else f"{r['threads']} thread(s)"
        mode = " torch.compile(reduce-overhead)" if args.compile else " eager"
        wide = "" if width == 64 else f", base width {width}"
        print(f"pytorch {r['torch']}{mode} ({r['model']}) ResNet-18 step, batch {batch}, {hw}x{hw}{wide}, "
              f"{r['stem']} stem, {r['classes']} classes, {where}: {r['ms_median']:.1f} ms/step "
              f"median (mean {r['ms_mean']:.1f}, {r['iters']} steps), "
              f"{r['images_per_s']:.2f} images/s", flush=True)
        if args.json:
            print("JSON " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
