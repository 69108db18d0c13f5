#!/usr/bin/env bash
# Builds pcpkv_torch against the installed torch (from source, nothing downloaded) and runs its pytest suite
# one test file per pytest process, so that a crash (segfault, abort, hang) in one test can not hide the
# results of the others:
#   * with pytest-xdist installed, each file runs as `-n 1`: a crashed test is reported as failed ("worker
#     crashed") and a fresh worker continues with the rest of the file;
#   * without it, a file whose process dies is run again without the test that was running when it died
#     (up to 5 times); those tests are listed as crashed.
# Every pytest process runs with faulthandler (-p faulthandler, python -X faulthandler): a crash prints the
# Python stack of every thread. test_errors.py runs first (its first test checks that C++ errors reach
# Python). Logs, faulthandler dumps and a JUnit report per file go to $OUT (or /tmp/pcpkv_torch_tests).
# The last lines are one overall SUMMARY line and then one line per test file.
#   bash python/run_device_tests.sh            (from anywhere; ~2-4 min build on 16 cores, ~2-3 min tests)
# Python: $PYTHON when set; else the first that imports torch of python3, $PCPKV_PYTHON and the venv of
# scripts/test.sh ($PCPKV_BUILD_DIR or build/, python-venv/bin/pcpkv-python); it prints which.
# Environment: PYTHON, MAX_JOBS (default nproc), PCPKV_TORCH_CUDA (default: auto),
#              PYTEST_ARGS (extra pytest arguments, e.g. "-k graph"), FILE_TIMEOUT (seconds per file, 240),
#              SKIP_BUILD=1 (reuse the in-place build), CLEAN_BUILD=0 (keep earlier objects), NO_XDIST=1
#              (the fallback isolation even where pytest-xdist is installed).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
# The interpreter: one that has torch (the extension is built against it and the tests import it).
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON" why="\$PYTHON"
else
  PY="" why=""
  build_dir="${PCPKV_BUILD_DIR:-$here/../build}"
  for cand in python3 ${PCPKV_PYTHON:+"$PCPKV_PYTHON"} "$build_dir/python-venv/bin/pcpkv-python"; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch' >/dev/null 2>&1; then
      PY="$cand" why="the first of python3, \$PCPKV_PYTHON, $build_dir/python-venv that imports torch"
      break
    fi
  done
  if [ -z "$PY" ]; then
    echo "SUMMARY: no Python with torch: python3${PCPKV_PYTHON:+, $PCPKV_PYTHON} and $build_dir/python-venv" \
         "cannot import torch. Set PYTHON=/path/to/python (with torch installed), or run ./scripts/test.sh once" \
         "(it creates that venv)"
    exit 1
  fi
fi
echo "python: $(command -v "$PY") ($why)"
out="${OUT:-/tmp/pcpkv_torch_tests}"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1  # a crashed process keeps every line it printed
file_timeout="${FILE_TIMEOUT:-240}"

"$PY" - <<'PYEOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices: "
      f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
print("torch built with:", *[l.strip() for l in torch.__config__.show().splitlines()
                              if l.strip().startswith(("- GCC", "- Clang", "- C++ Version"))])
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except ImportError:
    print("transformers: not installed (HF tests will skip)")
PYEOF
# Build with the system compiler. Seen on the H200 image (2026-11-29): the extension built by the
# /opt/gcc/bin/g++ wrapper that torch picked crashed the process on every C++ exception raised inside an op
# (test_errors.py: 5 crashes); the same sources built with /usr/bin/g++ passed (6 of 6).
# The image presets CXX to that wrapper, so override it unless PCPKV_TORCH_CXX names a compiler.
if [ -n "${PCPKV_TORCH_CXX:-}" ]; then
  export CXX="$PCPKV_TORCH_CXX"
elif [ -x /usr/bin/g++ ]; then
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
echo "host compiler: $(${CXX:-c++} --version 2>/dev/null | head -1) ($(command -v "${CXX:-c++}"))"

start=$(date +%s)
if [ "${SKIP_BUILD:-0}" != "1" ]; then
  # Objects of an earlier build are not trusted: ninja misses a header that changed while it compiled.
  [ "${CLEAN_BUILD:-1}" = 1 ] && rm -rf build pcpkv_torch/_C*.so
  if ! "$PY" setup.py build_ext --inplace >"$out/pcpkv_torch_build.log" 2>&1; then
    grep -n -B2 -A6 "error" "$out/pcpkv_torch_build.log" | head -80
    tail -20 "$out/pcpkv_torch_build.log"
    echo "SUMMARY: pcpkv_torch build FAILED after $(( $(date +%s) - start ))s (log: $out/pcpkv_torch_build.log)"
    exit 1
  fi
fi
build_s=$(( $(date +%s) - start ))
so="$(ls pcpkv_torch/_C*.so 2>/dev/null | head -1)"
echo "built $so; links: $(ldd "$so" 2>/dev/null | awk '/stdc\+\+|gcc_s|libc10|cudart/ {printf "%s => %s  ", $1, ($3 == "not" ? "(loaded by torch)" : $3)}')"
# A pcpkv source missing from setup.py shows up as an undefined symbol only at import; the tests would then
# all skip ("not importable"), so stop here instead.
undefined="$(nm -uC "$so" 2>/dev/null | grep -E ' pcpkv(_torch)?::' | head -10)"
if [ -n "$undefined" ] || ! "$PY" -c "import pcpkv_torch as pk; print('cuda kernels:', pk.cuda_dispatch_impl())"; then
  echo "$undefined"
  echo "SUMMARY: pcpkv_torch build UNUSABLE after ${build_s}s: undefined pcpkv symbols or import failure (see above)"
  exit 1
fi

if [ "${NO_XDIST:-0}" != 1 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
  isolate=(-n 1 --max-worker-restart=100)
  mode="pytest-xdist -n 1 per file"
else
  isolate=()
  mode="one process per file, re-run without a crashed test"
fi
echo "isolation: $mode; per-file timeout ${file_timeout}s; logs in $out"

files=(test_errors.py)
for f in tests/test_*.py; do
  f="$(basename "$f")"
  [ "$f" != test_errors.py ] && files+=("$f")
done
if [ -n "${PYTEST_FILES:-}" ]; then  # e.g. PYTEST_FILES="test_errors.py test_ops.py"
  read -r -a files <<<"$PYTEST_FILES"
fi

start=$(date +%s)
summaries=()
total_passed=0 total_failed=0 total_skipped=0 total_errors=0 total_crashed=0 overall_rc=0
count() {  # count WORD in a pytest result line ("3 passed, 1 failed in 2.0s")
  local n
  n="$(grep -oE "[0-9]+ $1" <<<"$2" | head -1 | grep -oE '^[0-9]+')"
  echo "${n:-0}"
}
for f in "${files[@]}"; do
  name="${f%.py}"
  log="$out/pytest_$name.log"
  crashed=()
  deselect=()
  result=""
  rc=0
  note=""
  for attempt in 1 2 3 4 5 6; do
    # shellcheck disable=SC2086
    timeout -k 10 "$file_timeout" "$PY" -X faulthandler -m pytest "tests/$f" -v -rfEs -p faulthandler \
      -o faulthandler_timeout=$(( file_timeout - 20 )) -p no:cacheprovider -p no:logging \
      --junitxml="$out/junit_$name.xml" "${isolate[@]}" "${deselect[@]}" ${PYTEST_ARGS:-} >"$log.$attempt" 2>&1
    rc=$?
    cp "$log.$attempt" "$log"
    result="$(grep -E '^=+ .*(passed|failed|skipped|error|no tests ran|deselected).* in [0-9.]+s' "$log" | tail -1 |
              sed -E 's/^=+ //; s/ =+$//')"
    [ -n "$result" ] && break
    # The process died without a result line: the last test it started (-v prints the node id first) crashed.
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" TIMEOUT after ${file_timeout}s;"
    last="$(grep -oE "^tests/$f::[^ ]+" "$log" | tail -1)"
    if [ -z "$last" ] || [[ " ${crashed[*]} " == *" $last "* ]] || [ ${#isolate[@]} -gt 0 ]; then
      break  # died outside a test (import, collection) or twice on the same test: give up on this file
    fi
    crashed+=("$last")
    deselect+=(--deselect "$last")
    echo "  $f: process died (exit $rc) in $last; running the file again without it"
  done
  # pytest-xdist reports a crashed test as failed ("worker 'gw0' crashed while running 'tests/...'")
  while IFS= read -r t; do [ -n "$t" ] && crashed+=("$t"); done < <(
    grep -oE "crashed while running '[^']+'" "$log" | sed -E "s/.*running '([^']+)'/\1/" | sort -u)
  [ "$rc" = 5 ] && rc=0  # "no tests ran" (everything deselected by PYTEST_ARGS)
  # what the file printed last: its failures and skips, and a faulthandler dump if one was written
  echo "---- $f (exit $rc) ----"
  for a in "$log".*; do
    grep -q "Fatal Python error" "$a" && grep -A14 "Fatal Python error" "$a" | head -15
  done
  sed -n '/short test summary info/,$p' "$log" | grep -vE '^=+ .* in [0-9.]+s' | head -40
  rm -f "$log".[0-9]
  if [ -z "$result" ]; then
    result="no pytest result (process died, exit $rc)"
    total_errors=$(( total_errors + 1 ))
    overall_rc=1
  fi
  p=$(count passed "$result"); fl=$(count failed "$result"); s=$(count skipped "$result"); e=$(count error "$result")
  total_passed=$(( total_passed + p )); total_failed=$(( total_failed + fl ))
  total_skipped=$(( total_skipped + s )); total_errors=$(( total_errors + e ))
  total_crashed=$(( total_crashed + ${#crashed[@]} ))  # with xdist these are also counted as failed
  if [ "$rc" != 0 ] || [ ${#crashed[@]} -gt 0 ]; then overall_rc=1; fi
  line="FILE $f: $result (exit $rc)"
  [ -n "$note" ] && line+="$note"
  [ ${#crashed[@]} -gt 0 ] && line+=" CRASHED: ${crashed[*]}"
  summaries+=("$line")
done
tests_s=$(( $(date +%s) - start ))
echo "SUMMARY: pcpkv_torch build ${build_s}s, pytest ${tests_s}s: $total_passed passed, $total_failed failed," \
  "$total_skipped skipped, $total_errors errors, $total_crashed crashed in ${#files[@]} files ($mode; exit $overall_rc)"
for line in "${summaries[@]}"; do echo "$line"; done
exit "$overall_rc"
