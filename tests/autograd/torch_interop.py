#!/usr/bin/env python3
"""Our ResNet-18 checkpoint in PyTorch: runs torch_fixture (argv[1]), loads its safetensors file
into a torchvision-layout ResNet-18 with load_state_dict(strict=True), and checks that PyTorch's
eval-mode logits equal ours. Proves names, shapes, weight layouts and batch-norm buffers map
onto torchvision. The file is read here from the format's specification (8-byte little-endian
header length, JSON header, raw data) with no safetensors package: a second, independent reader.

Exit 77 (skipped) when no python3 at hand has PyTorch (Debian: apt-get install python3-torch)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    # Debian's python3-torch lives under /usr/bin/python3, which may not be the python3 on PATH.
    if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
        probe = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
        if probe.returncode == 0:
            os.execv("/usr/bin/python3", ["/usr/bin/python3", __file__] + sys.argv[1:])
    print("torch_interop: no PyTorch for any python3 here (apt-get install python3-torch): skipped")
    sys.exit(77)

# The same torchvision-layout ResNet-18 the benchmark peer measures.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "autograd"))
from torch_resnet18 import ResNet18  # noqa: E402

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    data = blob[8 + length:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[entry["dtype"]]) if end > begin \
            else torch.empty(0, dtype=DTYPES[entry["dtype"]])
        out[name] = t.reshape(entry["shape"])
    return out


def main():
    fixture = sys.argv[1]
    folder = tempfile.mkdtemp(prefix="shardkit_torch_interop_")
    try:
        subprocess.run([fixture, folder], check=True)
        state = load_safetensors(os.path.join(folder, "model.safetensors"))
        io = load_safetensors(os.path.join(folder, "io.safetensors"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    model = ResNet18(10, small_image_stem=True)
    ours, theirs = set(state), set(model.state_dict())
    if ours != theirs:
        print("state-dict names differ; only ours:", sorted(ours - theirs)[:8],
              "only torch's:", sorted(theirs - ours)[:8])
        return 1
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(io["images"])
    expected = io["logits"]
    scale = expected.abs().max().item()
    diff = (logits - expected).abs().max().item()
    print(f"torch {torch.__version__}: {len(state)} tensors loaded strictly; "
          f"max |torch - shardkit| = {diff:.3g} (logits up to {scale:.3g})")
    if not diff <= 1e-4 * scale + 1e-7:
        print("FAIL: PyTorch's logits differ from ours")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
