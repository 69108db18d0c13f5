#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/<target>/ (valid inputs and hostile ones). Standard library only."""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(ROOT)


def put(target, name, data):
    d = os.path.join(ROOT, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def st(tensors, metadata=None, header_extra=b""):
    """A safetensors file: tensors = [(name, dtype, shape, bytes)]."""
    hdr, data = {}, b""
    if metadata:
        hdr["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(hdr).encode() + header_extra
    return struct.pack("<Q", len(h)) + h + data


def main():
    # hf_config: first byte = mode (bit 0: glm-5 base preset, bit 1: strict), then the JSON text.
    for fn in sorted(os.listdir(os.path.join(REPO, "configs"))):
        text = open(os.path.join(REPO, "configs", fn), "rb").read()
        put("hf_config", fn, b"\x00" + text)
        put("hf_config", "strict-" + fn, b"\x02" + text)
    put("hf_config", "deep-5k", b"\x00" + b"[" * 5000 + b"]" * 5000)
    put("hf_config", "deep-obj", b"\x00" + b'{"a":' * 2000 + b"1" + b"}" * 2000)
    put("hf_config", "dup-keys", b'\x00{"num_hidden_layers": 61, "num_hidden_layers": -1}')
    put("hf_config", "huge-counts", b'\x00{"num_hidden_layers": 99999999999999999999, "index_topk": -9223372036854775808,'
        b' "max_position_embeddings": 1e308, "rope_theta": "x", "rope_scaling": {"factor": 1e400}}')
    put("hf_config", "truncated", b'\x00{"model_type": "deepseek_v32", "rope_scaling": {"type": "ya')

    # safetensors / inputs
    bf16 = lambda n: struct.pack("<%dH" % n, *[(0x3f80 + (i % 97)) for i in range(n)])
    valid = st([("kv", "BF16", [2, 512], bf16(1024)), ("k_pe", "BF16", [2, 64], bf16(128)),
                ("requests", "I64", [1, 3], struct.pack("<3q", 0, 2, 5)),
                ("slot_mapping", "I64", [2], struct.pack("<2q", 5, 6)),
                ("block_tables", "I32", [1, 2], struct.pack("<2i", 0, 1))],
               metadata={"kv_format": "fp8_ds_mla", "block_size": "64"})
    small = st([("a", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)), ("b", "I8", [], b"\x07")],
               metadata={"note": "x"})
    for t in ("safetensors", "inputs"):
        put(t, "valid", valid)
        put(t, "small", small)
        put(t, "empty-header", st([]))
        put(t, "truncated-header", small[:20])
        put(t, "truncated-size", small[:5])
        put(t, "huge-header-size", struct.pack("<Q", 1 << 62) + b"{}")
        put(t, "huge-shape", st([("kv", "BF16", [1 << 40, 1 << 40], b"")]))
        put(t, "overflow-shape", st([("kv", "BF16", [9223372036854775807, 3], b"")]))
        put(t, "dup-keys", struct.pack("<Q", 120) + (b'{"kv":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                                  b'"kv":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}').ljust(120)
            + b"\0" * 8)
        deep = b"[" * 5000 + b"]" * 5000
        put(t, "deep-5k", struct.pack("<Q", len(deep)) + deep)
        put(t, "bad-offsets", st([("kv", "BF16", [2, 512], b"")]))
    put("inputs", "huge-requests", st([("kv", "BF16", [2, 512], bf16(1024)),
                                       ("requests", "I64", [2, 3], struct.pack("<6q", 0, 1 << 62, 0, 0, 1 << 62, 0))]))

    # bootstrap_wire: frames {u32 magic 'PCKV', u32 type, u64 bytes} + payload.
    magic = 0x564b4350
    frame = lambda ty, p: struct.pack("<IIQ", magic, ty, len(p)) + p
    hello = struct.pack("<IiiiiIqQ", 1, 1, 2, 1, 2, 3, 1234, 5) + b"token" + b"job"  # HelloFixed, token, job
    put("bootstrap_wire", "hello", frame(1, hello))
    put("bootstrap_wire", "welcome", frame(2, struct.pack("<2q", 100, 101)))
    put("bootstrap_wire", "two-frames", frame(4, b"abc") + frame(6, b"aborted"))
    put("bootstrap_wire", "huge-bytes", struct.pack("<IIQ", magic, 4, 1 << 32))
    put("bootstrap_wire", "over-limit", struct.pack("<IIQ", magic, 4, (1 << 32) + 1))
    put("bootstrap_wire", "bad-magic", struct.pack("<IIQ", 0xdeadbeef, 1, 4) + b"abcd")
    put("bootstrap_wire", "truncated", frame(4, b"abcdefgh")[:15])

    # cache_targets: Fixed struct (see fuzz_cache_targets.cpp, natural alignment) + "kv_format\0scale".
    def fixed(nb, bs, rs, bst, inb, ibs, ibst, k, hi):
        return struct.pack("<qi4xqqqi4xqfB3x", nb, bs, rs, bst, inb, ibs, ibst, k, hi)
    put("cache_targets", "dense-ds-mla", fixed(16, 64, 656, 64 * 656, 16, 64, 64 * 132, 1.0, 1) + b"fp8_ds_mla\0pow2")
    put("cache_targets", "dense-bf16", fixed(4, 16, 1152, 16 * 1152, 0, 0, 0, 1.0, 0) + b"bf16\0raw")
    put("cache_targets", "padded-fp8", fixed(8, 32, 640, 32 * 640 + 256, 8, 32, 32 * 132 + 64, 0.5, 1) + b"fp8\0pow2")
    put("cache_targets", "huge-counts", fixed(1 << 62, 1 << 30, 1 << 40, 1 << 62, 1 << 62, 1 << 30, 1 << 62, 1.0, 1)
        + b"fp8_ds_mla\0pow2")


if __name__ == "__main__":
    sys.exit(main())
