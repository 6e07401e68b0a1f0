#!/usr/bin/env python3
"""PyTorch's side of bench_op_overhead: the same chain of element-wise ops (y = relu((y + b) * s),
32 links) on CPU tensors of NUMEL elements and its backward, on one thread; prints the
microseconds per op (forward with its backward), the median of REPS timings.

  torch_op_overhead.py [NUMEL] [REPS]"""
import statistics
import sys
import time

import torch

LINKS = 32


def chain(x, b, s, seed):
    y = x
    for _ in range(LINKS):
        y = torch.relu((y + b) * s)
    y.backward(seed)
    return 3 * LINKS


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    torch.set_num_threads(1)
    torch.manual_seed(1)
    x = (torch.rand(numel) * 2 - 1).requires_grad_()
    b = (torch.rand(numel) - 0.5).requires_grad_()
    s = (torch.rand(numel) + 0.5).requires_grad_()
    seed = torch.ones(numel)
    chain(x, b, s, seed)  # warm-up
    timings = []
    for _ in range(reps):
        steps = 0
        start = time.perf_counter()
        while time.perf_counter() - start < 0.3:
            ops = chain(x, b, s, seed)
            steps += 1
        timings.append((time.perf_counter() - start) / (steps * ops) * 1e6)
    print(f"torch {torch.__version__} numel {numel}: {statistics.median(timings):.3f} us_per_op")


if __name__ == "__main__":
    main()
