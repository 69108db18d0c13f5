#!/usr/bin/env python3
"""The library's layering, checked on its #include lines (run by the unit tier; exit 1 lists every violation).

Products, bottom to top; a product may include itself and the products listed for it, never one above it:
  core       -                presets, HF loader, RoPE, layouts, plan, inputs, safetensors, limits
  ranks      core             bootstrap, launcher, host fence, symmetric memory, NCCL
  publish    core ranks       transports, backends, rank publishers, checks
  consumers  core publish     indexer, sparse MLA, LSE merge, attention check (reads published caches)
  serving    core ranks       router GEMM, all-reduce, FP8 quant, PDL
Inside publish, consumers and serving, every source sits in a folder named by its role:
  kernels/{cpu,cuda}  the math and its CPU oracle: never includes ranks, drivers or checks
  drivers/            backends and rank publishers walking the transport table: may include kernels
  checks/             verification, replica hashes, saved runs: never includes ranks or drivers
  contract/           the public types' own functions (names, parsing, parameter validation): includes no role
A cuda/ folder at any depth holds what needs CUDA. The CPU oracle (a cpu/ folder) never includes a kernel header
(a cuda/ folder, or the public launcher headers cuda*.h / kernels.h). include/pcpkv/device/ is shared math every
product may use. bench/, tools/, tests/, fuzz/ and python/ sit above everything.
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
ROLES = ("kernels", "drivers", "checks", "contract")
ROLE_PRODUCTS = {"publish", "consumers", "serving"}  # products whose sources all sit in a role folder
# role -> roles of the same product it must not include (drivers may include every role)
ROLE_FORBIDS = {"kernels": {"drivers", "checks"}, "checks": {"drivers"}, "contract": {"kernels", "drivers", "checks"}}
NO_RANKS = {"kernels", "checks"}
INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^>"]+)[>"]', re.M)


class Place:
    """Where a file or an include target sits: its product, role folder and device folder (cpu / cuda)."""

    def __init__(self, product, dirs, name):
        self.product = product
        self.role = dirs[0] if dirs and dirs[0] in ROLES else None
        self.device = "cuda" if "cuda" in dirs else ("cpu" if "cpu" in dirs else None)
        self.public_kernel_header = not dirs and (name.startswith("cuda") or name == "kernels.h")


def place_of_include(inc):
    """The Place an include line names, or None for system / third-party headers and include/pcpkv/device/."""
    parts = inc.split("/")
    if parts[0] == "pcpkv" and len(parts) > 2:
        return None if parts[1] == "device" else Place(parts[1], [], parts[-1])
    if parts[0] in ALLOWED and len(parts) > 1:
        return Place(parts[0], parts[1:-1], parts[-1])
    return None


def place_of_file(rel):
    parts = rel.split("/")
    if parts[0] == "src" and parts[1] in ALLOWED:
        return Place(parts[1], parts[2:-1], parts[-1])
    if parts[:2] == ["include", "pcpkv"] and parts[2] in ALLOWED:
        return Place(parts[2], [], parts[-1])
    return None


def file_violations(rel, owner, text):
    out = []
    if rel.startswith("src/") and owner.product in ROLE_PRODUCTS and owner.role is None:
        out.append(f"{rel}: a source outside every role folder of {owner.product} ({', '.join(ROLES)})")
    for inc in INCLUDE.findall(text):
        target = place_of_include(inc)
        if target is None:
            continue
        if target.product not in ALLOWED[owner.product]:
            out.append(f"{rel}: {owner.product} includes {inc} ({target.product} is not below {owner.product})")
            continue
        if owner.role in NO_RANKS and target.product == "ranks":
            out.append(f"{rel}: {owner.role} include a ranks header {inc} (only drivers know ranks)")
        if target.product == owner.product and target.role in ROLE_FORBIDS.get(owner.role, ()):
            out.append(f"{rel}: {owner.role} include {target.role} ({inc}); the arrows go drivers -> kernels, checks")
        if owner.device == "cpu" and (target.device == "cuda" or target.public_kernel_header):
            out.append(f"{rel}: a CPU oracle includes a kernel header {inc}")
    return out


def violations(root):
    out = []
    for top in ("src", "include/pcpkv"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                owner = place_of_file(rel)
                if owner is None:
                    if top == "src" and os.path.dirname(rel) == "src":
                        out.append(f"{rel}: a source outside every product folder")
                    continue
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    out += file_violations(rel, owner, f.read())
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
