#!/usr/bin/env python3
"""The library's layering, checked on its #include lines (run by the unit tier; exit 1 lists every violation).

Products, bottom to top; a product may include itself and the products listed for it, never one above it:
  core       -                presets, HF loader, RoPE, layouts, plan, inputs, safetensors, limits
  ranks      core             bootstrap, launcher, host fence, symmetric memory, NCCL
  publish    core ranks       transports, backends, rank publishers, checks
  consumers  core publish     indexer, sparse MLA, LSE merge, attention check (reads published caches)
  serving    core ranks       router GEMM, all-reduce, FP8 quant, PDL
Inside a product, the CPU oracle (cpu/) never includes its kernels (cuda/). include/pcpkv/device/ is shared
math every product may use. bench/, tools/, tests/, fuzz/ and python/ sit above everything.
"""
import os
import re
import sys

ALLOWED = {
    "core": {"core"},
    "ranks": {"core", "ranks"},
    "publish": {"core", "ranks", "publish"},
    "consumers": {"core", "publish", "consumers"},
    "serving": {"core", "ranks", "serving"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^>"]+)[>"]', re.M)


def product_of_include(inc):
    """(product, subfolder) an include line names, or None for system / third-party headers."""
    parts = inc.split("/")
    if parts[0] == "pcpkv" and len(parts) > 2:
        return (None if parts[1] == "device" else parts[1]), None
    if parts[0] in ALLOWED and len(parts) > 1:
        return parts[0], (parts[1] if len(parts) > 2 else None)
    return None


def product_of_file(rel):
    parts = rel.split("/")
    if parts[0] == "src" and parts[1] in ALLOWED:
        return parts[1], (parts[2] if len(parts) > 3 else None)
    if parts[:2] == ["include", "pcpkv"] and parts[2] in ALLOWED:
        return parts[2], None
    return None


def violations(root):
    out = []
    for top in ("src", "include/pcpkv"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                owner = product_of_file(rel)
                if owner is None:
                    if top == "src" and os.path.dirname(rel) == "src":
                        out.append(f"{rel}: a source outside every product folder")
                    continue
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    text = f.read()
                for inc in INCLUDE.findall(text):
                    target = product_of_include(inc)
                    if target is None or target[0] is None:
                        continue
                    if target[0] not in ALLOWED[owner[0]]:
                        out.append(f"{rel}: {owner[0]} includes {inc} ({target[0]} is not below {owner[0]})")
                    elif owner[1] == "cpu" and target[1] == "cuda":
                        out.append(f"{rel}: a CPU oracle includes a kernel header {inc}")
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    bad = violations(root)
    for line in bad:
        print(f"check_layers: {line}")
    print(f"check_layers: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
