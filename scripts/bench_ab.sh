#!/usr/bin/env bash
# Side-by-side `pcpkv bench` of several builds in one session, runs alternated (docs/perf.md: a change is
# measured against its predecessor on the same device, in the same session).
#   scripts/bench_ab.sh OUT_DIR NAME=SRC [NAME=SRC ...] -- [pcpkv bench flags]
# SRC: a source directory, or a git revision of this repository (exported with git archive into
# OUT_DIR/src-NAME). Each is built (Release, CUDA, no tests / benchmarks) into OUT_DIR/build-NAME; then for
# round i = 1..AB_ROUNDS (default 2) every build runs `pcpkv bench FLAGS --markdown OUT_DIR/NAME_i.md
# --json OUT_DIR/NAME_i.json` in the order given. AB_JOBS: build parallelism (default: all cores). AB_ROUNDS=0
# only builds (a later call with the same OUT_DIR reuses the trees and builds).
# Example (docs/perf.md section 12):
#   scripts/bench_ab.sh /tmp/ab old=ae35b7f new=HEAD -- --models glm-5 --pcp 8 --kv-formats fp8_ds_mla \
#     --single-rank-tokens 4096,32768 --variants warp,prefetch --layer-variants warp:fused:4 --pdl-tokens none
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,12p "$0" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -d "$repo/.deps/root/usr" ]; then  # packages carried to the GPU machine (scripts/gpu_check.sh --pack-deps)
  export CMAKE_PREFIX_PATH="$repo/.deps/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$repo/.deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  name=${1%%=*}
  src=${1#*=}
  [ -n "$name" ] && [ "$name" != "$1" ] || { echo "bench_ab.sh: '$1' is not NAME=SRC" >&2; exit 2; }
  if [ ! -d "$src" ]; then  # a revision: export it (once: a second call reuses the tree and its build)
    if [ ! -d "$out/src-$name" ]; then
      mkdir -p "$out/src-$name.tmp"
      git -C "$repo" archive "$src" | tar -x -C "$out/src-$name.tmp"
      mv "$out/src-$name.tmp" "$out/src-$name"
    fi
    src=$out/src-$name
  fi
  cmake -S "$src" -B "$out/build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DPCPKV_TESTS=OFF -DPCPKV_BENCH=OFF \
    >"$out/cmake-$name.log"
  ninja -C "$out/build-$name" -j"${AB_JOBS:-$(nproc)}" pcpkv_cli >"$out/build-$name.log"
  names+=("$name")
  shift
done
[ $# -gt 0 ] && shift  # the --
for i in $(seq 1 "${AB_ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    echo "bench_ab.sh: round $i, $name" >&2
    "$out/build-$name/pcpkv" bench "$@" --markdown "$out/${name}_$i.md" --json "$out/${name}_$i.json" \
      >"$out/${name}_$i.log" 2>&1
  done
done
echo "bench_ab.sh: results in $out (NAME_ROUND.md / .json)" >&2
