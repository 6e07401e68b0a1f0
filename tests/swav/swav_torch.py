#!/usr/bin/env python3
"""The SwAV loss in PyTorch, written from the published algorithm (Caron et al. 2020, with
VISSL's distributed Sinkhorn-Knopp), against ours: runs the fixture command (argv[1:], test_swav --fixture swav), which writes
every rank's embeddings, prototypes and queue and our loss and gradients, for 1 and 4 ranks
with and without the queue; recomputes them here (ranks emulated in one process: an
all-reduce is a sum over the ranks' tensors) and asks for agreement within 1e-5.

Exit 77 (skipped) when no python3 at hand has PyTorch (Debian: apt-get install python3-torch)."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_support import load_safetensors, ours_env, require_torch  # noqa: E402

torch = require_torch("swav_torch", __file__)

CROPS, ASSIGN, TEMPERATURE, EPSILON, ITERS = 4, (0, 1), 0.1, 0.05, 3


def sinkhorn(scores_per_rank):
    """Codes of each rank's rows: Q = exp(S / eps) over all ranks' rows, normalised to total 1;
    ITERS times every prototype's total (all ranks) to 1/K, then every sample's to 1/N; each
    sample's code normalised to 1."""
    with torch.no_grad():
        k = scores_per_rank[0].shape[1]
        n = sum(s.shape[0] for s in scores_per_rank)
        shift = max((s / EPSILON).max() for s in scores_per_rank)
        qs = [torch.exp(s / EPSILON - shift) for s in scores_per_rank]
        total = sum(q.sum() for q in qs)
        qs = [q / total for q in qs]
        for _ in range(ITERS):
            per_prototype = sum(q.sum(dim=0) for q in qs)
            qs = [q * (1.0 / k) / per_prototype for q in qs]
            qs = [q * (1.0 / n) / q.sum(dim=1, keepdim=True) for q in qs]
        return [q / q.sum(dim=1, keepdim=True) for q in qs]


def swav_losses(zs, prototypes, queues):
    """Each rank's loss: for every assignment crop, the other crops predict its codes through
    log_softmax(scores / tau); averaged over the predicting crops and the assignment crops."""
    b = zs[0].shape[0] // CROPS
    scores = [z @ prototypes.t() for z in zs]
    losses = [0.0 for _ in zs]
    for i, crop in enumerate(ASSIGN):
        rows = [s[crop * b:(crop + 1) * b].detach() for s in scores]
        if queues is not None:  # the queue's rows after the batch's, scored with the prototypes
            rows = [torch.cat([r, q[i] @ prototypes.detach().t()]) for r, q in zip(rows, queues)]
        codes = [c[:b] for c in sinkhorn(rows)]
        for r, s in enumerate(scores):
            term = 0.0
            for p in range(CROPS):
                if p == crop:
                    continue
                log_p = torch.log_softmax(s[p * b:(p + 1) * b] / TEMPERATURE, dim=1)
                term = term - (codes[r] * log_p).sum(dim=1).mean()
            losses[r] = losses[r] + term / (CROPS - 1)
    return [loss / len(ASSIGN) for loss in losses]


class Mismatch(Exception):
    pass


def within(what, error, limit):
    """error when it is at most limit; else Mismatch, naming what differed."""
    if not error <= limit:
        raise Mismatch(f"{what}: {error:.3g} (at most {limit:g} allowed)")
    return error


def main():
    try:
        return compare()
    except Mismatch as failure:
        print(f"FAIL: {failure}")
        return 1


def compare():
    with tempfile.TemporaryDirectory(prefix="shardkit_swav_torch_") as folder:
        path = os.path.join(folder, "swav.safetensors")
        subprocess.run(sys.argv[1:] + [path], check=True, env=ours_env())
        t = load_safetensors(path)
    torch.set_default_dtype(torch.float64)
    worst = 0.0
    for name in ("w1", "w1q", "w4", "w4q"):
        world = 4 if name.startswith("w4") else 1
        zs = [t[f"{name}.z.{r}"].double().requires_grad_() for r in range(world)]
        prototypes = t[f"{name}.prototypes"].double().requires_grad_()
        queues = [t[f"{name}.queue.{r}"].double() for r in range(world)] if name.endswith("q") else None
        # Gradients per rank (each rank's loss on its own, as before DDP averages them).
        for r in range(world):
            losses = swav_losses(zs, prototypes, queues)
            grad_z, grad_c = torch.autograd.grad(losses[r], [zs[r], prototypes])
            for what, theirs, ours in (("loss", losses[r].detach(), t[f"{name}.loss.{r}"]),
                                       ("grad_z", grad_z, t[f"{name}.grad_z.{r}"]),
                                       ("grad_c", grad_c, t[f"{name}.grad_c.{r}"])):
                ours = ours.double().reshape(theirs.shape)
                error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
                worst = max(worst, within(f"{name} rank {r} {what}: relative error", error, 1e-5))
    print(f"torch {torch.__version__}: SwAV loss and gradients (embeddings, prototypes) for 1 and 4 "
          f"ranks, with and without the queue: worst relative difference {worst:.2e}")
    # The kNN's feature pooling (swav_fixture.cpp's kPoolOps, kMorePoolOps, in order), as VISSL
    # applies LINEAR_EVAL_FEAT_POOL_OPS_MAP: the torch.nn module, then flatten per image.
    x = t["pool.x"].double()
    ops = [torch.nn.Identity(), torch.nn.AvgPool2d([2, 2], 1, 0), torch.nn.AvgPool2d([3, 3], 2, 1),
           torch.nn.AvgPool2d([2, 3], 2), torch.nn.AdaptiveAvgPool2d([2, 3]),
           torch.nn.AdaptiveAvgPool2d([3, 2]), torch.nn.AvgPool2d([4, 4])]
    pooled_worst = 0.0
    for i, op in enumerate(ops):
        theirs = torch.flatten(op(x), 1)
        ours = t[f"pool.{i}"].double()
        if ours.shape != theirs.shape:
            print(f"FAIL: pooling {op}: shape {tuple(ours.shape)}, torch {tuple(theirs.shape)}")
            return 1
        error = (ours - theirs).abs().max().item()
        pooled_worst = max(pooled_worst, within(f"pooling {op}: largest difference", error, 1e-6))
    print(f"kNN feature pooling (Identity, AvgPool2d, AdaptiveAvgPool2d; {len(ops)} settings) equals "
          f"torch.nn's: largest difference {pooled_worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
