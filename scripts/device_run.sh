#!/usr/bin/env bash
# scripts/device_run.sh PHASE: what the lead runs on the GPU machine (one H200) in few calls.
#   test   build everything (sm_90), run the cuda tier, the multiproc tier (GPU tests included) and the unit tier
#   bench  pcpkv bench (publication), attention bench, bench-serving, bench-fence (2/4/8 processes)
#   python build pcpkv_torch and run its pytest suite
# Logs land in $OUT (at most 8 files come back). The build dir (build-gpu) is reused while the machine is warm.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
phase="${1:-test}"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
build="$root/build-gpu"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$SECONDS
say() { echo "[device_run +$((SECONDS - t0))s] $*"; }

build_all() {
  if [ ! -f "$build/build.ninja" ]; then
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DPCPKV_BENCH=OFF > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; return 1; }
  fi
  ninja -C "$build" -j "$(nproc)" -k 0 > "$out/build.log" 2>&1
  local rc=$?
  grep -E "error|FAILED" "$out/build.log" | head -30
  say "build rc=$rc"
  return $rc
}

case "$phase" in
  test)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    build_all
    say "cuda tier"
    timeout 300 ctest --test-dir "$build" -L cuda -j 2 --timeout 200 --output-on-failure > "$out/ctest_cuda.log" 2>&1
    say "cuda tier rc=$?"
    say "multiproc tier"
    timeout 200 ctest --test-dir "$build" -L multiproc -j 2 --timeout 150 --output-on-failure > "$out/ctest_multiproc.log" 2>&1
    say "multiproc tier rc=$?"
    say "unit tier"
    timeout 60 ctest --test-dir "$build" -L unit -j 8 --timeout 50 > "$out/ctest_unit.log" 2>&1
    say "unit tier rc=$?"
    for f in ctest_cuda ctest_multiproc ctest_unit; do
      echo "== $f"; grep -E "tests passed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Exception|\(Subprocess" "$out/$f.log" | head -40
    done
    ;;
  bench)
    build_all
    say "publication bench"
    timeout 200 "$build/pcpkv" bench --json "$out/bench.json" --markdown "$out/bench.md" > "$out/bench.log" 2>&1
    say "bench rc=$?"
    say "attention bench"
    for m in glm-5 deepseek-v3.2; do
      timeout 120 "$build/pcpkv" attention --bench --model $m --tokens 32768 --kv-format fp8_ds_mla --topk 2048 --repeats 3
    done > "$out/attention.log" 2>&1
    say "attention rc=$?"
    say "serving bench"
    timeout 150 "$build/pcpkv" bench-serving --json "$out/serving.json" --md "$out/serving.md" > "$out/serving.log" 2>&1
    say "serving rc=$?"
    say "fence bench"
    for n in 2 4 8; do
      timeout 45 "$build/pcpkv" launch --nproc $n --gpus 0 --output rank0 -- bench-fence --backend cuda --layers 61 --iters 50 --time-budget 12
    done >> "$out/attention.log" 2>&1
    say "fence rc=$?"
    tail -n 60 "$out/bench.log"
    ;;
  python)
    timeout 540 bash python/run_device_tests.sh
    ;;
  retest)
    # Re-run named ctest regexes ($2) after fixes, plus the serving bench.
    build_all
    timeout 200 ctest --test-dir "$build" -R "${2:-.}" --timeout 150 --output-on-failure > "$out/ctest_retest.log" 2>&1
    say "retest rc=$?"; grep -E "tests passed|\(Failed\)|\(Timeout\)" "$out/ctest_retest.log"
    timeout 150 "$build/pcpkv" bench-serving --json "$out/serving.json" --md "$out/serving.md" > "$out/serving.log" 2>&1
    say "serving rc=$?"; tail -5 "$out/serving.log"
    ;;
esac
