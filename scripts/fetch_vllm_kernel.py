#!/usr/bin/env python3
"""Extracts vLLM's DeepSeek-V3.2 fused_norm_rope kernel file (and the three files of its helpers) from a vLLM wheel
into an ignored folder, so bench/vllm_peer.py can run vLLM's own kernel where vLLM cannot be installed (a GPU
machine without internet that receives only this working tree; vLLM's wheel, 240 MB, and its import closure do not
travel). No vLLM code is committed to this repository: the files land under build/ (ignored) with a MANIFEST.json
that records the wheel's name, version and sha256 and each file's sha256.

  python3 scripts/fetch_vllm_kernel.py [--wheel vllm-X-....whl] [--version 0.34.0] [--out build/vllm-kernel]

Without --wheel it runs `pip download vllm==VERSION --no-deps` (one wheel, no dependencies) into a temporary
folder. Then carry the output folder to the GPU machine and run bench/vllm_peer.py (--vllm-kernel-dir).
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The kernel and the files bench/vllm_peer.py takes vLLM's helpers from (pack_ue8m0_x4, mqa_logits_use_mx_scales,
# is_quantized_kv_cache with its KVQuantMode / get_kv_quant_mode); the platform is answered by a stand-in there.
FILES = ("vllm/models/deepseek_v32/common/kernels.py",
         "vllm/v1/attention/ops/common.py",
         "vllm/utils/deep_gemm.py",
         "vllm/v1/kv_cache_interface.py")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(version: str, into: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "-d", into]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    wheels = [f for f in os.listdir(into) if f.startswith("vllm-") and f.endswith(".whl")]
    if len(wheels) != 1:
        sys.exit(f"fetch_vllm_kernel: expected one vllm wheel in {into}, found {wheels}")
    return os.path.join(into, wheels[0])


def wheel_version(z: zipfile.ZipFile) -> str:
    meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.startswith("vllm-")]
    if not meta:
        sys.exit("fetch_vllm_kernel: --wheel: no vllm-*.dist-info/METADATA in the wheel (not a vLLM wheel?)")
    for line in z.read(meta[0]).decode("utf-8", "replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    sys.exit(f"fetch_vllm_kernel: --wheel: {meta[0]} has no Version line")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", default="", help="a vLLM wheel already downloaded (default: pip download one)")
    ap.add_argument("--version", default="0.34.0", help="the vLLM version to download without --wheel")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "vllm-kernel"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(args.version, tmp)
        if not os.path.isfile(wheel):
            sys.exit(f"fetch_vllm_kernel: --wheel {wheel!r}: no such file")
        digest = sha256(wheel)
        with zipfile.ZipFile(wheel) as z:
            version = wheel_version(z)
            missing = [f for f in FILES if f not in z.namelist()]
            if missing:
                sys.exit(f"fetch_vllm_kernel: vLLM {version} ({os.path.basename(wheel)}) lacks {missing}: "
                         "bench/vllm_peer.py needs a vLLM with vllm/models/deepseek_v32/common/kernels.py")
            files = {}
            for name in FILES:
                dest = os.path.join(args.out, name)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest, "wb") as f:
                    f.write(z.read(name))
                files[name] = sha256(dest)
    manifest = {"wheel": os.path.basename(wheel), "version": version, "wheel_sha256": digest, "files": files}
    with open(os.path.join(args.out, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"vLLM {version} ({manifest['wheel']}, sha256 {digest}): {len(files)} files -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
