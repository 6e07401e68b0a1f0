#!/usr/bin/env python3
"""PyTorch's side of bench_core: the same operations on the same 2^24 f32 elements (a 4096 x
4096 matrix for the transposing copy), into buffers made once, on the CPU:

  copy_contiguous   dst.copy_(src)
  copy_transposed   dst.copy_(src.t())
  fill              t.fill_(0.5)
  uniform           t.uniform_(-1, 1)        (PyTorch's CPU generator: mt19937)
  normal            t.normal_(0, 1)          (its Box-Muller, in f32 where it vectorises)
  cast_f32_to_bf16  bf16.copy_(f32), and likewise f32 -> f16, f16 -> f32

Timing: one warm-up call, then --reps repetitions of --calls calls each, timed with
perf_counter on --threads intra-op threads; prints one JSON line: {name: {"median_ms",
"ms"}} plus the torch version. Needs Debian's python3-torch (run with /usr/bin/python3).

  /usr/bin/python3 benchmarks/core/torch_core.py --threads 2 --reps 5
"""
import argparse
import json
import statistics
import time

import torch

SIDE = 4096


def operations():
    src = torch.empty(SIDE * SIDE).uniform_(-1, 1)
    dst = torch.empty(SIDE * SIDE)
    square = src.view(SIDE, SIDE)
    square_dst = torch.empty(SIDE, SIDE)
    bf16 = torch.empty(SIDE * SIDE, dtype=torch.bfloat16)
    f16 = torch.empty(SIDE * SIDE, dtype=torch.float16).copy_(src)
    return {
        "copy_contiguous": lambda: dst.copy_(src),
        "copy_transposed": lambda: square_dst.copy_(square.t()),
        "fill": lambda: dst.fill_(0.5),
        "uniform": lambda: dst.uniform_(-1, 1),
        "normal": lambda: dst.normal_(0, 1),
        "cast_f32_to_bf16": lambda: bf16.copy_(src),
        "cast_f32_to_f16": lambda: f16.copy_(src),
        "cast_f16_to_f32": lambda: dst.copy_(f16),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = {}
    for name, op in operations().items():
        op()  # warm-up: first touch of the buffers, the kernels' dispatch
        ms = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for _ in range(args.calls):
                op()
            ms.append((time.perf_counter() - start) * 1e3 / args.calls)
        results[name] = {"median_ms": statistics.median(ms), "ms": ms}
    print(json.dumps({"peer": "torch_core", "torch": torch.__version__, "threads": args.threads,
                      "ops": results}))


if __name__ == "__main__":
    main()
