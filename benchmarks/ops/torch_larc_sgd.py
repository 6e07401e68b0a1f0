#!/usr/bin/env python3
"""PyTorch's side of BM_larc_sgd_fused (bench_ops): LARC as apex and VISSL apply it, wrapped
around torch.optim.SGD, over torchvision ResNet-50's 161 parameter shapes, on the CPU.

Per step, for every tensor: the L2 norms of the parameter and its gradient; when both are
non-zero, rate = trust * |w| / (|g| + |w| * wd + eps) (clip off, as SwAV/VISSL configure it);
g += wd * w; g *= rate; then SGD with momentum 0.9 and lr 1e-3, its own weight decay 0 (LARC took
it over). The values and options are bench_ops' (w in [1, 2), g and the momentum buffers in
[0.5, 1.5), trust 0.001, wd 1e-6); the gradients' norms settle after a step, so every timed
step does the same work.

Timing: --warmup steps, then --reps repetitions of --steps steps each, timed with perf_counter
on --threads intra-op threads; prints one JSON line with the median and every repetition's
milliseconds per step. Needs Debian's python3-torch (run with /usr/bin/python3).

  /usr/bin/python3 benchmarks/ops/torch_larc_sgd.py --threads 2 --reps 5
"""
import argparse
import json
import statistics
import time

import torch


def resnet50_shapes():
    """torchvision ResNet-50's parameters in named_parameters() order (bench_ops' workload)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    assert len(shapes) == 161
    assert sum(torch.Size(s).numel() for s in shapes) == 25_557_032
    return shapes


def larc_then_sgd(params, optimizer, trust, weight_decay, eps):
    with torch.no_grad():
        for p in params:
            w_norm = torch.norm(p)
            g_norm = torch.norm(p.grad)
            if w_norm != 0 and g_norm != 0:
                rate = trust * w_norm / (g_norm + w_norm * weight_decay + eps)
                p.grad.add_(p, alpha=weight_decay)
                p.grad.mul_(rate)
    optimizer.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = []
    for shape in resnet50_shapes():
        p = torch.nn.Parameter(torch.empty(shape).uniform_(1, 2))
        p.grad = torch.empty(shape).uniform_(0.5, 1.5)
        params.append(p)
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    for _ in range(args.warmup):  # creates the momentum buffers, settles the gradients' norms
        larc_then_sgd(params, optimizer, 0.001, 1e-6, 1e-8)
    ms = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(args.steps):
            larc_then_sgd(params, optimizer, 0.001, 1e-6, 1e-8)
        ms.append((time.perf_counter() - start) * 1e3 / args.steps)
    print(json.dumps({"peer": "torch_larc_sgd", "torch": torch.__version__,
                      "threads": args.threads, "median_ms": statistics.median(ms), "ms": ms}))


if __name__ == "__main__":
    main()
