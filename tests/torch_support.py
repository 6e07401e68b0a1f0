"""Shared by the tests that compare with PyTorch (tests/autograd/torch_interop.py,
tests/swav/swav_torch.py): finding a python3 with PyTorch, and reading safetensors files from
the format's specification (8-byte little-endian header length, JSON header, raw data) with no
safetensors package -- a second, independent reader of what shardkit writes."""
import json
import os
import struct
import subprocess
import sys


# oneDNN's instruction-set cap (ONEDNN_MAX_CPU_ISA=AVX2 runs our CPU kernels as on an AVX2-only
# machine) is meant for our programs, not for PyTorch: PyTorch 1.13 decides from the CPU's own
# flags that bf16 convolutions exist, and its oneDNN then refuses them under the cap. So the
# cap is taken out of this process's environment once PyTorch is imported, and ours_env()
# hands it to the programs of ours that a test runs.
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_our_caps = {}


def ours_env():
    """The environment for running one of our programs: this one, with oneDNN's cap if the test
    was started under one."""
    return dict(os.environ, **_our_caps)


def require_torch(name, script):
    """The torch module; else re-runs `script` under Debian's /usr/bin/python3 when that one has
    PyTorch (python3-torch), else exits 77 (the test is skipped)."""
    try:
        import torch
        for cap in _ISA_CAPS:
            if cap in os.environ:
                _our_caps[cap] = os.environ.pop(cap)
        return torch
    except ImportError:
        if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
            probe = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
            if probe.returncode == 0:
                os.execv("/usr/bin/python3", ["/usr/bin/python3", script] + sys.argv[1:])
        print(f"{name}: no PyTorch for any python3 here (apt-get install python3-torch): skipped")
        sys.exit(77)


def load_safetensors(path):
    """Every tensor of a safetensors file, by name, as torch tensors."""
    import torch
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
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
        dtype = dtypes[entry["dtype"]]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin \
            else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(entry["shape"])
    return out
