#!/usr/bin/env bash
# Creates (or reuses) the Python virtual environment the pcpkv_torch tests run in, from the pins of
# python/requirements-ci.txt (every package by name and version from the package registry, --no-deps:
# torch's own requirements would pull ~2.5 GB of CUDA libraries this image already has), and writes
# VENV/bin/pcpkv-python, the interpreter to use: it puts the CUDA toolkit's lib directory on the loader path,
# without which `import torch` fails (the cu130 wheel loads libtorch_cuda.so, which needs libcudart,
# libcublasLt, cudnn, nccl from the toolkit, even when no GPU is used).
# It also puts this tree's python/ on the venv's path (pcpkv-source.pth), so its python imports pcpkv_torch
# (every subpackage) from any directory once the extension is built in place.
# Usage: scripts/setup_python.sh VENV   (scripts/test.sh passes BUILD/python-venv)
# Environment: PCPKV_PYTHON (base interpreter, default python3, >= 3.10), CUDA_HOME (toolkit, default: the one
# holding libcublasLt.so.13 among /usr/local/cuda-13.0, /usr/local/cuda and nvcc's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:?usage: setup_python.sh VENV}"
# Absolute: pcpkv-python execs it from any directory (a relative VENV worked only from the caller's).
mkdir -p "$venv"
venv="$(cd "$venv" && pwd)"
reqs="$root/python/requirements-ci.txt"
base="${PCPKV_PYTHON:-python3}"

# The toolkit's lib directory: the one holding libcublasLt.so.13 (torch cu130 needs CUDA 13).
cuda_lib=""
nvcc_dir="$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/bin/nvcc)")"
for d in ${CUDA_HOME:+"$CUDA_HOME/lib64" "$CUDA_HOME/lib"} /usr/local/cuda-13.0/lib64 /usr/local/cuda/lib64 \
         "$nvcc_dir/../lib64"; do
  if [ -e "$d/libcublasLt.so.13" ]; then
    cuda_lib="$(cd "$d" && pwd -P)"
    break
  fi
done
if [ -z "$cuda_lib" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcublasLt\.so\.13 '; then
  echo "setup_python: no CUDA 13 toolkit found (libcublasLt.so.13 in \$CUDA_HOME/lib64, /usr/local/cuda-13.0," \
       "/usr/local/cuda or on the loader path); the pinned torch (cu130 build) cannot load without it." \
       "Set CUDA_HOME, or skip the Python tests with PCPKV_PYTHON_TESTS=0" >&2
  exit 1
fi

# The venv is reused while its marker (the pins' hash and the base interpreter's version) matches; the
# marker is written last, so an interrupted install is redone.
marker="$(sha256sum "$reqs" | cut -d' ' -f1) $("$base" -c 'import sys; print(sys.version.split()[0])')"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.pcpkv-requirements" 2>/dev/null)" != "$marker" ]; then
  echo "setup_python: creating $venv from ${reqs#"$root"/} (first time: ~820 MB download)" >&2
  rm -rf "$venv"
  "$base" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --no-deps --progress-bar off -r "$reqs"
  echo "$marker" > "$venv/.pcpkv-requirements"
fi

ld_line=""
if [ -n "$cuda_lib" ]; then
  ld_line="export LD_LIBRARY_PATH=\"$cuda_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
fi
cat > "$venv/bin/pcpkv-python" <<EOF
#!/bin/sh
# Written by scripts/setup_python.sh: the venv's python with the CUDA toolkit's libraries on the loader path.
$ld_line
exec "$venv/bin/python" "\$@"
EOF
chmod +x "$venv/bin/pcpkv-python"
# This source tree's package on the venv's path (a .pth file naming python/), so that `pcpkv-python -c 'import
# pcpkv_torch.models'` works from any directory once the extension is built in place (scripts/test.sh does;
# by hand: cd python && PCPKV_TORCH_CUDA=0 ../build/python-venv/bin/pcpkv-python setup.py build_ext --inplace).
# Not `pip install -e`: that compiles the extension again, in a temporary build folder, on every install.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
if [ -d "$site" ]; then
  echo "$root/python" > "$site/pcpkv-source.pth"
else  # a venv python that names no site folder (a stand-in): the import check below decides
  echo "setup_python: $venv's site-packages '$site' is not a folder; python/ is not put on its path" >&2
fi
if ! "$venv/bin/pcpkv-python" -c 'import torch' ; then
  echo "setup_python: 'import torch' fails in $venv (above); loader path added: ${cuda_lib:-none}" >&2
  exit 1
fi
