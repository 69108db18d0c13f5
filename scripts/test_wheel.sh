#!/usr/bin/env bash
# Tests pcpkv_torch as a user gets it: builds the wheel (`pip wheel --no-build-isolation ./python`, CPU ops),
# installs it into a new virtual environment and, from a folder outside the source tree, imports every module
# of the installed package (pkgutil), runs both examples at tiny sizes on the CPU and a few pytest modules
# against it (a copy of python/tests; their header must name the installed package), and checks that the wheel
# ships every file of python/pcpkv_torch (tests/test_packaging.py). Fails on the first failure.
# scripts/test.sh runs it after the Python tests (PCPKV_WHEEL_TEST=0 skips it there); alone:
#   scripts/test_wheel.sh          (PCPKV_BUILD_DIR, PCPKV_JOBS as for scripts/test.sh)
# Cost on the 2-core machine: the compiled objects are scripts/test.sh's (BUILD/pcpkv_torch-objects; ninja
# reuses them, the wheel build only links), so about a minute and a half; without them a full compile first.
#
# The new environment: `python -m venv --without-pip` plus a .pth naming the CI venv's site-packages, so torch,
# transformers, pytest and pip are the CI venv's, found without a copy or download (installing the cached torch
# wheel again would unpack 1.9 GB; --system-site-packages would expose the base interpreter's packages, not the
# CI venv's). A .pth line only adds a folder to sys.path, it does not process that folder's own .pth files, so
# the CI venv's pcpkv-source.pth (python/ on its path) does not apply: pcpkv_torch can come only from the wheel,
# which every check below asserts.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PCPKV_BUILD_DIR:-$root/build}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"
start=$(date +%s)
ci_venv="$build/python-venv"
"$root/scripts/setup_python.sh" "$ci_venv"
ci_py="$ci_venv/bin/pcpkv-python"
work="$build/pcpkv_torch-wheel"
rm -rf "$work"  # setuptools ships whatever an earlier build left in its build folder
mkdir -p "$work/run"
say() { echo "test_wheel: [$(( $(date +%s) - start )) s] $*"; }

# 1. The wheel. Its build folders go under $work (the source tree stays clean), the objects are test.sh's.
cat > "$work/build.cfg" <<EOF
[build]
build_base = $work/build
[build_ext]
build_temp = $build/pcpkv_torch-objects
[egg_info]
egg_base = $work
EOF
say "building the wheel (pip wheel --no-build-isolation ./python, PCPKV_TORCH_CUDA=0)"
if ! (cd "$work" && DIST_EXTRA_CONFIG="$work/build.cfg" PCPKV_TORCH_CUDA=0 MAX_JOBS="${PCPKV_JOBS:-$(nproc)}" \
        "$ci_py" -m pip wheel --no-build-isolation --no-deps --no-index -w "$work/dist" "$root/python" \
        >"$work/wheel.log" 2>&1); then
  tail -40 "$work/wheel.log"
  echo "test_wheel: the wheel build failed (log: $work/wheel.log)" >&2
  exit 1
fi
wheel="$(ls "$work"/dist/pcpkv_torch-*.whl)"
say "built $(basename "$wheel")"
(cd "$root/python" && PCPKV_WHEEL="$wheel" "$ci_py" -m pytest tests/test_packaging.py -q -p no:cacheprovider)

# 2. A new environment holding the wheel; its python is run through a copy of the CI venv's wrapper (the CUDA
# toolkit's libraries on the loader path, which `import torch` needs).
"$ci_venv/bin/python" -m venv --without-pip "$work/venv"
site_of() { "$1" -c "import sysconfig; print(sysconfig.get_path('$2'))"; }
site="$(site_of "$work/venv/bin/python" platlib)"
{ site_of "$ci_venv/bin/python" purelib; site_of "$ci_venv/bin/python" platlib; } | sort -u > "$site/pcpkv-ci-venv.pth"
sed "s|exec \"$ci_venv/bin/python\"|exec \"$work/venv/bin/python\"|" "$ci_venv/bin/pcpkv-python" \
  > "$work/venv/bin/pcpkv-python"
chmod +x "$work/venv/bin/pcpkv-python"
py="$work/venv/bin/pcpkv-python"
grep -q "$work/venv/bin/python" "$py" || { echo "test_wheel: could not write $py from $ci_py" >&2; exit 1; }
"$py" -m pip install --quiet --no-deps --no-index "$wheel"

# 3. From outside the source tree (no PYTHONPATH): every module imports, from the installed wheel.
cd "$work/run"
unset PYTHONPATH
say "importing every module of the installed package"
"$py" - <<'PYEOF'
import importlib
import importlib.metadata as md
import os
import pkgutil
import sysconfig

from packaging.requirements import Requirement

site = os.path.realpath(sysconfig.get_path("platlib"))


def installed(module):
    f = os.path.realpath(module.__file__)
    assert f.startswith(site + os.sep), f"{module.__name__} was imported from {f}, not from the wheel in {site}"


import pcpkv_torch

installed(pcpkv_torch)
installed(pcpkv_torch._C)


def refuse(name):
    raise ImportError(f"pkgutil could not import {name}")


names = ["pcpkv_torch"] + [m.name for m in pkgutil.walk_packages(pcpkv_torch.__path__, "pcpkv_torch.", onerror=refuse)]
for name in names:
    installed(importlib.import_module(name))
dist = md.distribution("pcpkv_torch")
assert dist.version == pcpkv_torch.__version__, f"metadata {dist.version} != __version__ {pcpkv_torch.__version__}"
# The declared requirements (and the `models` extra, which the examples need) hold in this environment.
for text in dist.requires or []:
    r = Requirement(text)
    if r.marker is not None and not r.marker.evaluate({"extra": "models"}):
        continue
    have = md.version(r.name)
    assert r.specifier.contains(have, prereleases=True), f"requirement {text}: {r.name} {have} installed"
print(f"test_wheel: {len(names)} modules import from {site}: {' '.join(sorted(names))}")
PYEOF

# 4. The examples at tiny sizes on the CPU (each checks itself and exits nonzero on a failed check).
say "python -m pcpkv_torch.examples.prefill (tiny, CPU)"
"$py" -m pcpkv_torch.examples.prefill --dims small --layers 2 --tokens 64 --pcp 2 --hf-tokens 32 --device cpu \
  --transport all >"$work/prefill.log" 2>&1 || { cat "$work/prefill.log"; exit 1; }
tail -1 "$work/prefill.log"
say "torchrun -m pcpkv_torch.examples.prefill_dist (2 ranks, tiny, CPU)"
"$py" -m torch.distributed.run --standalone --nproc-per-node 2 -m pcpkv_torch.examples.prefill_dist --dims small \
  --layers 2 --tokens 64 --transport direct >"$work/prefill_dist.log" 2>&1 || { cat "$work/prefill_dist.log"; exit 1; }
tail -1 "$work/prefill_dist.log"

# 5. A few fast pytest modules against the installed package (a copy of the tests: conftest keeps the source
# tree off sys.path when no in-place build sits next to them).
cp -r "$root/python/tests" "$work/run/tests"
say "pytest (installed package): test_errors.py test_tables.py test_plan_modes.py"
if ! "$py" -m pytest tests/test_errors.py tests/test_tables.py tests/test_plan_modes.py -p no:cacheprovider \
       >"$work/pytest.log" 2>&1; then
  cat "$work/pytest.log"
  exit 1
fi
if ! grep -qF "pcpkv_torch: installed package at $site/pcpkv_torch" "$work/pytest.log"; then
  head -20 "$work/pytest.log"
  echo "test_wheel: pytest did not import the installed package (header above)" >&2
  exit 1
fi
grep -F "pcpkv_torch: installed package" "$work/pytest.log"
tail -1 "$work/pytest.log"
say "PASS: the wheel installs and runs outside the source tree"
