#!/usr/bin/env bash
# Issue 33's final check at one commit: the library (sm_90), then the cuda / multiproc / unit tiers while
# pcpkv_torch builds on the idle cores, then the Python GPU suite for what is left of the call. Logs: $OUT/*.log
# and $OUT/pytest_logs.tgz.  Usage: OUT=... bash docs/results/2026-12-05e/call_a.sh [python-seconds]
set -uo pipefail
out="${OUT:?}"
py_budget="${1:-300}"
build=build-gpu
t0=$SECONDS
say() { echo "[+$((SECONDS - t0))s] $*"; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
git rev-parse HEAD 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f $build/build.ninja ] || cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DPCPKV_BENCH=OFF > "$out/configure.log" 2>&1
ninja -C $build -j 16 -k 0 > "$out/build.log" 2>&1
say "build rc=$?"; grep -E "error|FAILED" "$out/build.log" | head -20
(cd python && rm -rf build pcpkv_torch/_C*.so && CXX=/usr/bin/g++ CC=/usr/bin/gcc MAX_JOBS=12 \
  CUDA_HOME=/usr/local/cuda python3 setup.py build_ext --inplace > "$out/ext_build.log" 2>&1; echo "ext rc=$?") &
ext=$!
timeout 300 ctest --test-dir $build -L cuda -j 2 --timeout 200 --output-on-failure > "$out/ctest_cuda.log" 2>&1
say "cuda tier rc=$?"
timeout 200 ctest --test-dir $build -L multiproc -j 2 --timeout 150 --output-on-failure > "$out/ctest_multiproc.log" 2>&1
say "multiproc tier rc=$?"
timeout 60 ctest --test-dir $build -L unit -j 8 --timeout 50 > "$out/ctest_unit.log" 2>&1
say "unit tier rc=$?"
for f in ctest_cuda ctest_multiproc ctest_unit; do
  echo "== $f"; grep -E "tests passed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Exception|\(Subprocess" "$out/$f.log" | head -20
done
wait $ext
say "ext built"; tail -3 "$out/ext_build.log"
left=$(( py_budget ))
say "python suite for at most ${left}s"
SKIP_BUILD=1 OUT=/tmp/pyt PYTEST_FILES="${PYTEST_FILES:-}" timeout "$left" bash python/run_device_tests.sh \
  > "$out/python_suite.log" 2>&1
say "python suite rc=$?"
tar czf "$out/pytest_logs.tgz" -C /tmp pyt 2>/dev/null
grep -E "SUMMARY|passed|failed|error" "$out/python_suite.log" | tail -40
