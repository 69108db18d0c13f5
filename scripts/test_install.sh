#!/usr/bin/env bash
# pcpkv as a dependency: configures, builds and installs the CPU library into a temporary prefix, from a
# copy of the sources that is deleted before use (so the installed configs, not the source tree's, must
# be found), then builds tests/install_consumer/ (find_package(pcpkv), pcpkv::pcpkv) and the repository's
# example against the prefix and runs both. Exits nonzero when any step fails. scripts/test.sh calls it.
# Environment: PCPKV_JOBS (build jobs), PCPKV_INSTALL_TMP (where the temporary directory goes; default $TMPDIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d "${PCPKV_INSTALL_TMP:-${TMPDIR:-/tmp}}/pcpkv-install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
jobs=(${PCPKV_JOBS:+-j "$PCPKV_JOBS"})

# The library's sources only (no build trees): what a release tarball holds.
mkdir -p "$work/src"
for p in CMakeLists.txt cmake include src configs tools bench examples; do cp -r "$root/$p" "$work/src/"; done
prefix="$work/prefix"
cmake -S "$work/src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPCPKV_CUDA=OFF -DPCPKV_TESTS=OFF \
      -DPCPKV_BENCH=OFF -DPCPKV_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$prefix" >"$work/configure.log" \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" "${jobs[@]}"
cmake --install "$work/build" >"$work/install.log" || { cat "$work/install.log"; exit 1; }
rm -rf "$work/src" "$work/build"  # the installed package must stand alone

for f in include/pcpkv/publish/backend.h include/pcpkv/publish/kernels.h lib/libpcpkv.a lib/libpcpkv_core.a \
         lib/cmake/pcpkv/pcpkvConfig.cmake lib/cmake/pcpkv/pcpkvTargets.cmake share/pcpkv/configs/glm-5.json \
         bin/pcpkv; do
  [ -e "$prefix/$f" ] || { echo "test_install: $prefix/$f was not installed" >&2; exit 1; }
done

cmake -S "$root/tests/install_consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$prefix" -DPCPKV_EXAMPLE_SOURCE="$root/examples/publish_one_layer.cpp" \
      >"$work/consumer.log" || { cat "$work/consumer.log"; exit 1; }
cmake --build "$work/consumer" "${jobs[@]}"
env -u PCPKV_CONFIG_DIR "$work/consumer/pcpkv_install_consumer" "$prefix/share/pcpkv/configs"
env -u PCPKV_CONFIG_DIR "$work/consumer/publish_one_layer" --pcp 2 --tokens 64
# Captured first: `pcpkv info | grep -q` would fail under pipefail when grep stops reading early (SIGPIPE).
info="$(env -u PCPKV_CONFIG_DIR "$prefix/bin/pcpkv" info)"
grep -q "configs in $prefix/share/pcpkv/configs" <<<"$info" \
  || { echo "test_install: the installed CLI does not read the installed configs:" >&2; echo "$info" | head -5 >&2; exit 1; }
echo "test_install: passed (prefix $prefix)"
