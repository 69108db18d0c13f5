#!/usr/bin/env bash
# scripts/device_run.sh PHASE: what the lead runs on the GPU machine (one H200) in few calls.
#   test   build everything (sm_90), run the cuda tier, the multiproc tier (GPU tests included) and the unit tier
#   bench  pcpkv bench (publication), attention bench, bench-serving, bench-fence (2/4/8 processes)
#   python build pcpkv_torch and run its pytest suite
#   models ARGS...  the whole-model prefill example once per quoted argument string (after python)
#   check  ncu (hardware counters) on one layer's publication kernels, then compute-sanitizer memcheck over the
#          cuda test executables and racecheck/synccheck over the kernel tests (each bounded in time)
#   probe FILE.cu  build a standalone probe (docs/results/*/NAME.cu, no pcpkv library) and run it twice; its
#          tables land in $OUT/NAME_1.md and NAME_2.md
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
  models)
    # the whole-model PCP prefill example at the models' real per-layer dims; needs the in-place
    # pcpkv_torch build of the python phase (run in the same warm session) or builds it first
    if ! ls python/pcpkv_torch/_C*.so > /dev/null 2>&1; then
      (cd python && CXX="${PCPKV_TORCH_CXX:-/usr/bin/g++}" MAX_JOBS="$(nproc)" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
        timeout 400 python3 setup.py build_ext --inplace) > "$out/ext_build.log" 2>&1 || { tail -20 "$out/ext_build.log"; exit 1; }
    fi
    for args in "${@:2}"; do
      say "prefill example $args"
      # shellcheck disable=SC2086
      (cd python && timeout 280 python3 -m pcpkv_torch.examples.prefill $args) > "$out/prefill_$(echo $args | tr -c 'a-z0-9.-' _).log" 2>&1
      say "rc=$?"
    done
    tail -n 40 "$out"/prefill_*.log
    ;;
  check)
    build_all
    bench_args=(bench --models glm-5 --pcp 8 --kv-formats fp8_ds_mla --single-rank-tokens 32768 --variants warp
                --layer-variants warp:separate:1 --iters 1 --warmup 0 --no-graph --pdl-tokens none --copy-gib 0.25)
    say "ncu"
    timeout 150 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      -k 'regex:dispatch|combine|insert|gather|fill' -c 24 "$build/pcpkv" "${bench_args[@]}" > "$out/ncu.log" 2>&1
    say "ncu rc=$?"
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|L2 Hit|L1/TEX Hit" \
      "$out/ncu.log" | head -150
    say "memcheck"
    : > "$out/sanitize.log"
    for t in "$build"/tests/cuda_test_*; do
      case "$t" in *.cmake) continue ;; esac
      [ $((SECONDS - t0)) -gt 420 ] && { echo "SKIPPED (time) $t" >> "$out/sanitize.log"; continue; }
      echo "== memcheck $(basename "$t")" >> "$out/sanitize.log"
      timeout 45 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$t" --gtest_brief=1 \
        >> "$out/sanitize.log" 2>&1
      echo "== rc=$? $(basename "$t")" >> "$out/sanitize.log"
    done
    for tool in racecheck synccheck; do
      for t in cuda_test_publish_kernels cuda_test_consumers_kernels cuda_test_router cuda_test_allreduce; do
        [ $((SECONDS - t0)) -gt 500 ] && { echo "SKIPPED (time) $tool $t" >> "$out/sanitize.log"; continue; }
        echo "== $tool $t" >> "$out/sanitize.log"
        timeout 40 compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$build/tests/$t" \
          --gtest_brief=1 >> "$out/sanitize.log" 2>&1
        echo "== rc=$? $tool $t" >> "$out/sanitize.log"
      done
    done
    grep -E "^== rc=|ERROR SUMMARY|SKIPPED|Invalid|Race|Barrier" "$out/sanitize.log" | head -80
    ;;
  probe)
    src="${2:?probe needs a .cu file}"
    name="$(basename "$src" .cu)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    nvcc -O3 -arch=sm_90 -std=c++17 "$src" -o "$out/$name" > "$out/${name}_build.log" 2>&1 ||
      { cat "$out/${name}_build.log"; exit 1; }
    for i in 1 2; do
      timeout 240 "$out/$name" > "$out/${name}_$i.md" 2>&1
      say "$name run $i rc=$?"
    done
    rm -f "$out/$name"
    cat "$out/${name}_1.md"
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
