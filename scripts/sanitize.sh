#!/usr/bin/env bash
# Builds the CPU tiers with AddressSanitizer + UndefinedBehaviorSanitizer (CMake -DPCPKV_SANITIZE, CUDA off)
# and runs the unit and multiproc tests under them. Any report (out-of-bounds access, use after free, leak,
# undefined behaviour) aborts that test, so the script exits nonzero. .ci/run calls it after scripts/test.sh.
# Environment: PCPKV_ASAN_BUILD_DIR (default build-asan), PCPKV_JOBS (build jobs), PCPKV_SANITIZE (default
# address,undefined), PCPKV_CTEST_ARGS (extra ctest arguments, e.g. "-j2").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${PCPKV_ASAN_BUILD_DIR:-$root/build-asan}"

"$root/scripts/setup.sh"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPCPKV_CUDA=OFF -DPCPKV_BENCH=OFF \
        -DPCPKV_SANITIZE="${PCPKV_SANITIZE:-address,undefined}"
fi
ninja -C "$build" ${PCPKV_JOBS:+-j "$PCPKV_JOBS"}
# Leaks are reported too (LeakSanitizer, at exit); every report names its stack.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
# shellcheck disable=SC2086
ctest --test-dir "$build" --output-on-failure --timeout 1800 --no-tests=error -L 'unit|multiproc' \
      ${PCPKV_CTEST_ARGS:-}
