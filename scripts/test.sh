#!/usr/bin/env bash
# Builds pcpkv and all its tests if needed (installing the Debian packages it needs), then runs every
# test with ctest; then builds pcpkv_torch (CPU ops) in a virtual environment under the build directory
# (scripts/setup_python.sh: pinned torch and transformers from the package registry, reused when present;
# its bin/pcpkv-python imports this tree's pcpkv_torch from any directory) and runs its pytest suite, then
# scripts/test_wheel.sh (the wheel, installed into a new environment and run outside the source tree).
# Exits nonzero when the build or any test fails (ctest, pytest or the wheel). GPU tests skip, with the
# reason, on a machine without a GPU.
# Environment: PCPKV_BUILD_DIR (default build), PCPKV_JOBS (build jobs), PCPKV_CTEST_ARGS (extra ctest
# arguments, e.g. "-L unit" or "-j2"), PCPKV_PYTHON_TESTS=0 (skip the Python part), PCPKV_PYTEST_ARGS (extra
# pytest arguments, e.g. "-k plan"), PCPKV_WHEEL_TEST=0 (skip scripts/test_wheel.sh), PCPKV_INSTALL_TEST=0
# (skip scripts/test_install.sh), PCPKV_CMAKE_ARGS (extra cmake arguments when the build directory is
# configured, e.g. "-DPCPKV_WERROR=ON", as .ci/run sets).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PCPKV_BUILD_DIR:-$root/build}"
# Absolute: the Python part runs from python/ (a relative PCPKV_BUILD_DIR named no venv there).
mkdir -p "$build"
build="$(cd "$build" && pwd)"

"$root/scripts/setup.sh"
if [ ! -f "$build/build.ninja" ]; then
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${PCPKV_CMAKE_ARGS:-}
fi
ninja -C "$build" ${PCPKV_JOBS:+-j "$PCPKV_JOBS"}
status=0
# shellcheck disable=SC2086
ctest --test-dir "$build" --output-on-failure --timeout 900 --no-tests=error ${PCPKV_CTEST_ARGS:-} || status=1
# The installed package from a separate project (find_package(pcpkv)); PCPKV_INSTALL_TEST=0 skips it.
if [ "${PCPKV_INSTALL_TEST:-1}" != 0 ]; then
  "$root/scripts/test_install.sh" || status=1
fi

if [ "${PCPKV_PYTHON_TESTS:-1}" != 0 ]; then
  venv="$build/python-venv"
  "$root/scripts/setup_python.sh" "$venv"
  py="$venv/bin/pcpkv-python"
  # In place (python/pcpkv_torch/_C*.so), CPU ops only; objects under the build directory.
  (cd "$root/python" && PCPKV_TORCH_CUDA=0 MAX_JOBS="${PCPKV_JOBS:-$(nproc)}" \
     "$py" setup.py --quiet build_ext --inplace --build-temp "$build/pcpkv_torch-objects")
  # A test module skips when the extension does not import; here that is a failure, not a skip.
  (cd "$root/python" && "$py" -c 'import pcpkv_torch._C')
  # pytest's exit 5 (no tests collected) fails too.
  # shellcheck disable=SC2086
  (cd "$root/python" && "$py" -m pytest tests -q -rs -p no:cacheprovider ${PCPKV_PYTEST_ARGS:-}) || status=1
  # The package as a user installs it (reuses the objects above: about a minute and a half on 2 cores).
  if [ "${PCPKV_WHEEL_TEST:-1}" != 0 ]; then
    PCPKV_BUILD_DIR="$build" "$root/scripts/test_wheel.sh" || status=1
  fi
fi
exit "$status"
