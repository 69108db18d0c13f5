#!/usr/bin/env bash
# scripts/gpu_check.sh: the one script to run on the GPU machine (one H200, CUDA 13): configure and build
# for sm_90, run the cuda test tier, run `pcpkv bench` with the issue's matrix, and print a short summary
# table last. Logs and JSON go under $OUT when it is set (else build-gpu/out). Each step has a time bound
# (build 270 s, tests 150 s, bench 150 s) so the whole run ends inside 10 minutes; typical is about 5.
#
#   scripts/gpu_check.sh              configure + build + cuda tests + bench (the default)
#   scripts/gpu_check.sh --quick      same, with `pcpkv bench --quick` (a smoke run)
#   scripts/gpu_check.sh --pack-deps  run HERE (not on the GPU machine): downloads the Debian packages the
#                                     build needs (fmt, nlohmann-json, CLI11, GoogleTest) into .deps/, which
#                                     the GPU machine lacks and cannot fetch; then pass carry=[".deps"].
#
# Environment: GPU_CHECK_JOBS (build jobs, default nproc), GPU_CHECK_ARCH (CMAKE_CUDA_ARCHITECTURES,
# default 90), GPU_CHECK_BENCH_ARGS (extra `pcpkv bench` arguments), GPU_CHECK_BUILD_DIR (default build-gpu).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

mode="${1:-all}"
deps="$root/.deps"

if [ "$mode" = "--pack-deps" ]; then
  set -e
  rm -rf "$deps" && mkdir -p "$deps/debs" "$deps/root"
  (cd "$deps/debs" && apt-get download libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev)
  for f in "$deps"/debs/*.deb; do dpkg -x "$f" "$deps/root"; done
  grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
  echo "gpu_check: packed $(ls "$deps"/debs | wc -l) packages into .deps ($(du -sh "$deps" | cut -f1)); carry \".deps\""
  exit 0
fi

out="${OUT:-$root/${GPU_CHECK_BUILD_DIR:-build-gpu}/out}"
build="$root/${GPU_CHECK_BUILD_DIR:-build-gpu}"
mkdir -p "$out"
jobs="${GPU_CHECK_JOBS:-$(nproc)}"
arch="${GPU_CHECK_ARCH:-90}"
bench_args="${GPU_CHECK_BENCH_ARGS:-}"
[ "$mode" = "--quick" ] && bench_args="--quick $bench_args"
export bench_args
# Never let anything here use NVLink multicast (SPEC section 5); nothing does, this keeps it so.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

declare -A status seconds
step() {  # step NAME BOUND_S FUNCTION: runs FUNCTION in a bash with a time bound, logs to $out/NAME.log
  local name=$1 bound=$2 fn=$3
  local t0=$SECONDS
  echo "== gpu_check: $name (bound ${bound}s) =="
  timeout --kill-after=10 "$bound" bash -c "set -uo pipefail; $(declare -f "$fn"); $fn" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  seconds[$name]=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then status[$name]=ok; elif [ "$rc" -eq 124 ]; then status[$name]="TIMEOUT"; else status[$name]="FAILED rc=$rc"; fi
  return "$rc"
}
export root build out jobs arch deps

# ---- environment ---------------------------------------------------------------------------------------
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  g++ --version 2>&1 | head -1
  git rev-parse HEAD 2>/dev/null || true
} | tee "$out/env.log"

if [ -d "$deps/root/usr" ]; then
  # Packages carried from Debian (--pack-deps): headers, static gtest, libfmt.so and their CMake configs.
  export CMAKE_PREFIX_PATH="$deps/root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$deps/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "gpu_check: using the packages carried in .deps"
fi

# ---- configure + build ------------------------------------------------------------------------------------
build_all() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DPCPKV_BENCH=OFF || return 1
  # The CLI and every test of the cuda tier (pcpkv_tests_cuda: each tests/<product>/ file labelled cuda).
  # -k 0: a broken test of another tier or engineer must not stop the rest from building.
  ninja -C "$build" -j "$jobs" -k 0 pcpkv_cli pcpkv_tests_cuda
}
step build 270 build_all

# ---- cuda test tier ----------------------------------------------------------------------------------------
run_tests() {
  # Our own binaries first, directly (one process each: fast), then the rest of the tier through ctest.
  local rc=0 bin
  mkdir -p "$build/gtest"
  for bin in cuda_test_codec_exhaustive cuda_test_publish_fence cuda_test_publish_kernels \
             cuda_test_publish_backend cuda_test_graph_replay cuda_test_publish_bench_cli; do
    if [ -x "$build/tests/$bin" ]; then
      echo "-- $bin"
      timeout --kill-after=5 100 "$build/tests/$bin" --gtest_brief=1 --gtest_output="json:$build/gtest/$bin.json" || rc=1
    else
      echo "-- $bin: NOT BUILT"
      rc=1
    fi
  done
  echo "-- the rest of the cuda tier (ctest -L cuda)"
  ctest --test-dir "$build" -L cuda --output-on-failure --timeout 120 --no-tests=ignore \
    -E "CodecExhaustive|GpuFence|DispatchKernel|CombineInsertKernels|AllGatherKernel|CudaVsCpuBackend|CudaBackend\.|GraphReplay|BenchCli" \
    || rc=1
  return $rc
}
if [ "${status[build]}" != "TIMEOUT" ]; then
  step tests 150 run_tests
else
  status[tests]="skipped"; seconds[tests]=0
fi

# ---- bench -------------------------------------------------------------------------------------------------
run_bench() {
  # shellcheck disable=SC2086
  "$build/pcpkv" bench --json "$out/bench.json" --markdown "$out/bench.md" $bench_args
}
if [ -x "$build/pcpkv" ]; then
  step bench 150 run_bench
else
  status[bench]="not built"; seconds[bench]=0
fi

# ---- summary (last) ----------------------------------------------------------------------------------------
summarize_tests() {
  python3 - "$build/gtest" <<'PY' 2>/dev/null || echo "(python3 missing: see $out/tests.log)"
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "cuda_test_*.json"))):
    j = json.load(open(f))
    fails = [f"{s['name']}.{t['name']}" for s in j.get("testsuites", []) for t in s.get("testsuite", [])
             if t.get("failures")]
    skipped = sum(1 for s in j.get("testsuites", []) for t in s.get("testsuite", []) if t.get("result") == "SKIPPED")
    print(f"| {os.path.basename(f)[:-5]} | {j['tests'] - j['failures'] - j.get('disabled', 0) - skipped}/{j['tests']} passed,"
          f" {skipped} skipped | {', '.join(fails[:3]) or '-'} |")
PY
}
summarize_bench() {
  python3 - "$out/bench.json" <<'PY' 2>/dev/null || tail -n 40 "$out/bench.md" 2>/dev/null
import json, sys
j = json.load(open(sys.argv[1]))
print(f"copy bandwidth {j['copy_bandwidth_gbps']:.0f} GB/s on {j['device']['name']}")
for s in j.get("single_rank", []):
    v = s.get("vllm_time_over_floor")
    print(f"| single rank {s['tokens']} | {s['variant']} {'fused' if s['fused_topk'] else 'sep.'} top-k | "
          f"{s['ms']*1e3:.1f} us | {s['time_over_floor']:.2f}x floor | vLLM {v if v else '-'} |")
print("| model | P | kv | transport | ms | graph ms | x floor | speedup vs collect |")
for r in j.get("runs", []):
    g = r.get("graph_ms")
    print(f"| {r['model']} | {r['pcp']} | {r['kv_format']} | {r['transport']} | {r['total_ms']:.3f} | "
          f"{g if g is None else round(g, 3)} | {r['time_over_floor']:.2f} | {r.get('speedup_vs_collect', 0):.2f}x |")
PY
}
{
  echo
  echo "================ gpu_check summary ================"
  echo "| step | result | seconds |"
  echo "|---|---|---|"
  for s in build tests bench; do echo "| $s | ${status[$s]:-?} | ${seconds[$s]:-0} |"; done
  echo
  echo "| test binary | passed | first failures |"
  echo "|---|---|---|"
  summarize_tests
  echo
  [ -f "$out/bench.json" ] && summarize_bench
  echo "logs: $out (gtest JSON in gtest.tgz)"
} | tee "$out/summary.md"
tar -C "$build" -czf "$out/gtest.tgz" gtest 2>/dev/null || true
[ "${status[build]}" = ok ] && [ "${status[tests]}" = ok ] && [ "${status[bench]}" = ok ]
