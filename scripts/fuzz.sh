#!/usr/bin/env bash
# Builds the libFuzzer targets (build-fuzz: clang, CPU only, ASan + UBSan) and runs each for a bounded time
# from its seed corpus (fuzz/corpus/<target>, read only; new inputs go to build-fuzz/corpus/<target>).
# Prints one line per target: executions, coverage, findings. Exits nonzero on a crash, leak, OOM or timeout.
#   FUZZ_SECONDS  seconds per target (default 30)      FUZZ_TARGETS  names (default: all five)
#   FUZZ_JOBS     targets run at once (default 1)      FUZZ_BUILD    build dir (default build-fuzz)
#   FUZZ_SEED     libFuzzer -seed (default 1: a CI run is repeatable; 0 picks one at random)
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER=${FUZZ_SECONDS:-30}
BUILD=${FUZZ_BUILD:-build-fuzz}
TARGETS=${FUZZ_TARGETS:-"hf_config safetensors inputs bootstrap_wire cache_targets"}
JOBS=${FUZZ_JOBS:-1}
if ! command -v clang++ >/dev/null; then  # Debian's clang brings libFuzzer (compiler-rt); install it by name
  sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  echo "fuzz.sh: installing clang" >&2
  { "${sudo_cmd[@]}" apt-get update -q && "${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends clang; } >&2 ||
    { echo "fuzz.sh: clang++ not found and apt-get install clang failed" >&2; exit 2; }
fi
if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPCPKV_CUDA=OFF \
    -DPCPKV_TESTS=OFF -DPCPKV_BENCH=OFF -DPCPKV_FUZZ=ON >/dev/null || exit 2
fi
nice -n 10 ninja -C "$BUILD" -j2 $(for t in $TARGETS; do echo "fuzz_$t"; done) >/dev/null || exit 2

max_len() {  # JSON and safetensors inputs need room for deep-nesting seeds; the others are small records
  case $1 in hf_config|safetensors|inputs) echo 16384 ;; *) echo 4096 ;; esac
}
run_one() {
  local t=$1 log="$BUILD/fuzz-$1.log" work="$BUILD/corpus/$1" art="$BUILD/artifacts/$1/"
  rm -rf "$art"; mkdir -p "$work" "$art"
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    nice -n 10 "$BUILD/fuzz/fuzz_$t" "$work" "fuzz/corpus/$t" -max_total_time="$SECONDS_PER" -seed="${FUZZ_SEED:-1}" \
      -max_len="$(max_len "$t")" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 \
      -artifact_prefix="$art" -print_final_stats=1 >"$log" 2>&1
  local rc=$?
  local execs cov found
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
  found=$(ls "$art" | tr '\n' ' ')
  printf 'fuzz %-15s rc=%d execs=%s %s findings=%s\n' "$t" "$rc" "${execs:-?}" "${cov:-cov: ?}" "${found:-none}"
  [ "$rc" -eq 0 ] && [ -z "$found" ]
}
fail=0 pids=()
for t in $TARGETS; do
  run_one "$t" & pids+=($!)
  if [ "${#pids[@]}" -ge "$JOBS" ]; then wait "${pids[0]}" || fail=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
[ "$fail" -eq 0 ] || echo "fuzz.sh: findings (inputs under $BUILD/artifacts/, logs $BUILD/fuzz-*.log)" >&2
exit "$fail"
