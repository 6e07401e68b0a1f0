#!/usr/bin/env python3
"""The checkpoint tool (tools/shardkit-ckpt) end to end, on a real checkpoint: a narrow ResNet-18
trained under FSDP on two ranks and saved sharded (tests/autograd/torch_fixture.cpp writes it
with the model's eval logits). Usage: check_ckpt_tool.py SHARDKIT_CKPT FIXTURE_COMMAND...
(test_autograd --fixture torch)

  inspect / verify        say what the checkpoint is; verify names a tensor with a flipped bit
  reshard --world-size 3  then consolidate: the same values, bit for bit, as consolidating the
                          original
  to-torch                PyTorch loads the state dict strictly into the same architecture and
                          its eval logits equal ours (within float rounding of two conv
                          implementations)
  from-torch              PyTorch's own save of that model (safetensors.torch.save_file) and the
                          optimizer file come back as a checkpoint whose every tensor equals the
                          original's, bit for bit
  bad arguments / files   one line on stderr, non-zero exit"""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_support import load_safetensors, ours_env, require_torch  # noqa: E402

torch = require_torch("ckpt_tool", __file__)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "autograd"))
from torch_resnet18 import ResNet18  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def tool(*args, expect=0):
    run = subprocess.run([TOOL, *args], capture_output=True, text=True, env=ours_env())
    if run.returncode != expect:
        print(run.stdout, run.stderr)
    check(run.returncode == expect, f"shardkit-ckpt {' '.join(args[:1])} exits {expect}")
    return run


def same_tensors(a, b):
    """Every tensor of two dicts equal bit for bit (same names, dtypes, shapes, bytes)."""
    if set(a) != set(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
               torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
               for k in a)


def main():
    global TOOL
    TOOL, fixture = sys.argv[1], sys.argv[2:]
    tmp = tempfile.mkdtemp(prefix="shardkit_ckpt_tool_")
    try:
        subprocess.run(fixture + [tmp], check=True, capture_output=True, env=ours_env())
        src = os.path.join(tmp, "ours_sharded")
        path = lambda *p: os.path.join(tmp, *p)  # noqa: E731

        out = tool("inspect", src).stdout
        check("sharded, 2 files" in out and "stage fsdp, world size 2" in out and
              "optimizer   sgd" in out and "momentum_buffer" in out, "inspect describes the save")
        check("checksums   " in out and " of " in out, "inspect reports the checksums")
        out = tool("verify", src).stdout
        check(out.startswith("ok: ") and "checksums verified" in out, "verify passes a good save")

        tool("consolidate", src, path("full"))
        tool("reshard", src, path("three"), "--world-size", "3")
        check(sorted(os.listdir(path("three"))) ==
              [f"shard-0000{r}-of-00003.safetensors" for r in range(3)], "reshard writes 3 shards")
        tool("verify", path("three"))
        tool("consolidate", path("three"), path("full_from_three"))
        for name in ("model.safetensors", "optimizer.safetensors"):
            check(same_tensors(load_safetensors(path("full", name)),
                               load_safetensors(path("full_from_three", name))),
                  f"2 -> 3 ranks -> full equals 2 -> full bit for bit ({name})")

        tool("to-torch", src, path("state.safetensors"), "--optimizer", path("optimizer.safetensors"))
        state = load_safetensors(path("state.safetensors"))
        model = ResNet18(10, small_image_stem=True, base_channels=16)
        model.load_state_dict(state, strict=True)
        model.eval()
        io = load_safetensors(path("sharded_io.safetensors"))
        with torch.no_grad():
            logits = model(io["images"])
        scale = io["logits"].abs().max().item()
        diff = (logits - io["logits"]).abs().max().item()
        print(f"     PyTorch {torch.__version__} loads {len(state)} tensors strictly; "
              f"max |torch - shardkit| logits = {diff:.3g} (logits up to {scale:.3g})")
        check(diff <= 1e-4 * scale + 1e-7, "PyTorch's forward of the exported model equals ours")

        try:
            from safetensors.torch import save_file
        except ImportError:
            print("ckpt_tool: the safetensors package is missing (scripts/setup installs it)")
            return 1
        save_file(model.state_dict(), path("torch_saved.safetensors"), metadata={"format": "pt"})
        tool("from-torch", path("torch_saved.safetensors"), path("back"),
             "--optimizer", path("optimizer.safetensors"))
        tool("verify", path("back"))
        for name in ("model.safetensors", "optimizer.safetensors"):
            check(same_tensors(load_safetensors(path("full", name)), load_safetensors(path("back", name))),
                  f"ours -> to-torch -> PyTorch -> from-torch equals ours bit for bit ({name})")

        # Corruption and bad arguments: one line, non-zero.
        shard = path("three", "shard-00001-of-00003.safetensors")
        blob = bytearray(open(shard, "rb").read())
        blob[-5] ^= 0x10
        open(shard, "wb").write(blob)
        run = tool("verify", path("three"), expect=1)
        check("is corrupt" in run.stderr and run.stderr.count("\n") == 1,
              "verify names the corrupt tensor in one line: " + run.stderr.strip()[:160])
        run = tool("inspect", path("nothing"), expect=1)
        check("no checkpoint folder" in run.stderr, "a missing folder is named")
        run = tool("reshard", src, path("x"), "--world-size", "0", expect=2)
        check("--world-size" in run.stderr and run.stderr.count("\n") == 1,
              "a world size of 0 is refused in one line: " + run.stderr.strip())
        run = tool("consolidate", src, src, expect=1)
        check("same folder" in run.stderr, "rewriting a checkpoint onto itself is refused")
        run = tool("from-torch", path("state.safetensors"), path("y"), "--optimizer-kind", "rmsprop",
                   expect=2)
        check("rmsprop" in run.stderr, "an unknown optimizer kind is named: " + run.stderr.strip())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
