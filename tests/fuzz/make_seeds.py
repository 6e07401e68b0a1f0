#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): small valid files
of each kind and the malformed classes the readers must refuse, so the fuzzer starts at the
interesting boundaries. Rerun after changing it: python3 tests/fuzz/make_seeds.py"""
import gzip
import json
import os
import struct
import zlib

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}


def put(target, name, data):
    os.makedirs(os.path.join(HERE, target), exist_ok=True)
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, checksums=True):
    """tensors: [(name, dtype, shape, bytes)] -> a file as the format lays it out."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    meta = dict(metadata or {})
    if checksums:
        for name, _, _, raw in tensors:
            meta["shardkit.crc32." + name] = "%08x" % zlib.crc32(raw)
    if meta or checksums:
        header["__metadata__"] = meta
    if checksums:  # the header's own CRC32, over its canonical JSON without this key or offsets
        covered = {k: (v if k == "__metadata__" else {f: x for f, x in v.items() if f != "data_offsets"})
                   for k, v in header.items()}
        canonical = json.dumps(covered, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        header["__metadata__"]["shardkit.header_crc32"] = "%08x" % zlib.crc32(canonical.encode())
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data, text, len(data)


def framed_header(text, data_bytes):
    return struct.pack("<H", data_bytes) + text


def main():
    f32 = struct.pack("<4f", 0.5, -1.25, 3e-8, 7.0)
    cases = {
        "two_tensors": safetensors([("w", "F32", [2, 2], f32), ("steps", "I64", [1], struct.pack("<q", 9))],
                                   {"format": "pt", "shardkit.steps": "9"}),
        "every_dtype": safetensors([(d, d, [3], bytes(range(3 * s))) for d, s in SIZES.items()]),
        "zero_size_shared_offset": safetensors([("a", "F32", [1], f32[:4]), ("z", "F32", [2, 0, 3], b""),
                                                ("b", "F32", [1], f32[4:8])]),
        "no_checksums": safetensors([("x", "U8", [2, 2], b"\x01\x02\x03\x04")], checksums=False),
        "scalar": safetensors([("s", "F64", [], struct.pack("<d", 3.5))]),
        "empty": safetensors([]),
    }
    for name, (whole, text, data_bytes) in cases.items():
        put("fuzz_safetensors_file", name + ".safetensors", whole)
        put("fuzz_safetensors_header", name + ".json", framed_header(text, data_bytes))
    bad_headers = {
        "shape_overflow": b'{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}',
        "float_offsets": b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}',
        "bom": b'\xef\xbb\xbf{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        "nul_padding": b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\x00\x00\x00',
        "metadata_not_strings": b'{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        "overlap": b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}',
        "bad_checksum": b'{"__metadata__":{"shardkit.crc32.a":"zzzzzzzz"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        "bad_header_checksum": b'{"__metadata__":{"shardkit.header_crc32":"00000000"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    }
    for name, text in bad_headers.items():
        put("fuzz_safetensors_header", name + ".json", framed_header(text, 3))
        put("fuzz_safetensors_file", name + ".safetensors", struct.pack("<Q", len(text)) + text + b"\x01\x02\x03")

    def idx(dims, data):
        return bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data

    images = idx([2, 3, 4], bytes(range(24)))
    put("fuzz_idx", "images.idx", images)
    put("fuzz_idx", "labels.idx", idx([5], bytes([0, 9, 3, 1, 7])))
    put("fuzz_idx", "images.idx.gz", gzip.compress(images, mtime=0))
    put("fuzz_idx", "huge_claim.idx", idx([60000, 28, 28], b"\x00" * 16))
    put("fuzz_idx", "int_type.idx", bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 1) + b"\x00" * 4)

    configs = {
        "zero1": "config:\n  OPTIMIZER:\n    name: zero\n    base_optimizer:\n      name: sgd\n",
        "fsdp_amp": "config:\n  MODEL:\n    FSDP_CONFIG:\n      AUTO_SETUP_FSDP: True\n"
                    "    AMP_PARAMS:\n      USE_AMP: True\n      AMP_TYPE: pytorch\n",
        "typo": "config:\n  OPTIMZER:\n    num_epochs: 2\n",
        "wrong_type": "config:\n  OPTIMIZER:\n    num_epochs: [1, 2]\n",
        "ranks": "config:\n  DISTRIBUTED:\n    NUM_NODES: 2\n    NUM_PROC_PER_NODE: 3\n",
        "complex_key": "config:\n ? DISTRIBUTED:\n    NUM_NODES: 2\n    NUM_PROC_PER_NODE: 3\n",
        "head_dims_not_integers": "config:\n  MODEL:\n    HEAD:\n      PARAMS: [[\"swav_head\", "
                                  "{\"dims\": [128, \"x\", 32], \"use_bn\": True, \"num_clusters\": [30]}]]\n",
        "feature_pools": "config:\n  MODEL:\n    FEATURE_EVAL_SETTINGS:\n      LINEAR_EVAL_FEAT_POOL_OPS_MAP: "
                         "[[\"res5\", [\"AvgPool2d\", [[2, 2], 1, 0]]], [\"res4\", [\"AdaptiveAvgPool2d\", "
                         "[[2, 2]]]], [\"res5avg\", [\"Identity\", []]]]\n",
        # A composite schedule whose part is not a map (a finding: yaml-cpp's BadSubscript).
        "scheduler_not_a_map": "config:\n  OPTIMIZER:\n    param_schedulers:\n      lr:\n"
                               "        schedulers: [0, {name: cosine}]\n",
    }
    for name, text in configs.items():
        put("fuzz_swav_config", name + ".yaml", text.encode())


if __name__ == "__main__":
    main()
