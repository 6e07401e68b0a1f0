#!/usr/bin/env python3
"""The custom loop's checkpoints, end to end: a run stopped after 13 of 30 steps and resumed under
another ZeRO stage ends with the same parameters, bit for bit (FNV-1a of their bytes), as a run
that never stopped -- FSDP's sharded checkpoint resumed under SDP, and OSS's full checkpoint
resumed under FSDP; a torn checkpoint (files from different saves) is refused. First, the four
stages trained straight through end with the same parameters, bit for bit, and DDP and FSDP
agree in bf16 and f16 mixed precision too.
Usage: check_resume.py PATH/TO/custom_loop"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

BASE = ["--ranks", "3", "--max-steps", "30", "--hidden", "128", "--device", "cpu",
        "--optimizer", "adamw"]


def run(binary, *extra):
    out = subprocess.run([binary, *BASE, *extra], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout, out.stderr)
        raise SystemExit(f"custom_loop {' '.join(extra)} exited {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    binary = sys.argv[1]
    folder = tempfile.mkdtemp(prefix="shardkit_resume_")
    try:
        straight = run(binary, "--stage", "oss")
        stages = {stage: run(binary, "--stage", stage)["params_fnv1a"]
                  for stage in ("ddp", "sdp", "fsdp")}
        print("straight runs:", stages, "oss", straight["params_fnv1a"])
        same_stages = all(h == straight["params_fnv1a"] for h in stages.values())
        # Mixed precision: the stages agree within each precision too (f16 with loss scaling).
        for precision in ("bf16", "f16"):
            hashes = {stage: run(binary, "--stage", stage, "--precision", precision)["params_fnv1a"]
                      for stage in ("ddp", "fsdp")}
            print(precision, hashes)
            same_stages = same_stages and hashes["ddp"] == hashes["fsdp"] != straight["params_fnv1a"]
        sharded = os.path.join(folder, "sharded")
        stopped = run(binary, "--stage", "fsdp", "--stop-after", "13", "--checkpoint", sharded,
                      "--checkpoint-layout", "sharded")
        resumed = run(binary, "--stage", "sdp", "--resume", sharded)
        full = os.path.join(folder, "full")
        run(binary, "--stage", "oss", "--stop-after", "13", "--checkpoint", full)
        resumed_fsdp = run(binary, "--stage", "fsdp", "--resume", full)
        print(f"straight {straight['params_fnv1a']}  fsdp stopped at 13 {stopped['params_fnv1a']}  "
              f"resumed under sdp {resumed['params_fnv1a']}  oss resumed under fsdp "
              f"{resumed_fsdp['params_fnv1a']}")
        ok = (same_stages and stopped["steps"] == 13 and resumed["steps"] == 30 and
              resumed["params_fnv1a"] == straight["params_fnv1a"] and
              resumed_fsdp["params_fnv1a"] == straight["params_fnv1a"] and
              stopped["params_fnv1a"] != straight["params_fnv1a"])
        # Tear it: the optimizer state of step 14 beside the model of step 13.
        torn = os.path.join(folder, "torn")
        shutil.copytree(full, torn)
        later = os.path.join(folder, "later")
        run(binary, "--stage", "oss", "--resume", full, "--stop-after", "1", "--checkpoint", later)
        shutil.copy(os.path.join(later, "optimizer.safetensors"), torn)
        out = subprocess.run([binary, *BASE, "--resume", torn], capture_output=True, text=True)
        refused = (out.returncode == 1 and "is torn: model.safetensors is from save" in out.stderr
                   and "(step 13)" in out.stderr and "(step 14)" in out.stderr)
        print("torn checkpoint:", out.stderr.strip())
        return 0 if ok and refused else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
