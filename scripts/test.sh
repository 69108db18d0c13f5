#!/usr/bin/env bash
# Builds pcpkv and all its tests if needed (installing the Debian packages it needs), then runs every
# test with ctest. Exits nonzero when the build or any test fails. GPU tests skip, with the reason, on a
# machine without a GPU.
# Environment: PCPKV_BUILD_DIR (default build), PCPKV_JOBS (build jobs), PCPKV_CTEST_ARGS (extra ctest
# arguments, e.g. "-L unit" or "-j2").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PCPKV_BUILD_DIR:-$root/build}"

"$root/scripts/setup.sh"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
ninja -C "$build" ${PCPKV_JOBS:+-j "$PCPKV_JOBS"}
# shellcheck disable=SC2086
ctest --test-dir "$build" --output-on-failure --timeout 900 --no-tests=error ${PCPKV_CTEST_ARGS:-}
