#!/usr/bin/env bash
# Builds pcpkv_torch against the installed torch (from source, nothing downloaded) and runs its pytest
# suite; the last line is a one-line summary. Logs and a JUnit report go to $OUT (or /tmp).
#   bash python/run_device_tests.sh            (from anywhere; ~2-4 min build on 16 cores, ~1-2 min tests)
# Environment: PYTHON (default python3), MAX_JOBS (default nproc), PCPKV_TORCH_CUDA (default: auto),
#              PYTEST_ARGS (extra pytest arguments, e.g. "-k graph").
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
PY="${PYTHON:-python3}"
out="${OUT:-/tmp}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices: "
      f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
try:
    import transformers
    print(f"transformers {transformers.__version__}")
except ImportError:
    print("transformers: not installed (HF tests will skip)")
PYEOF
start=$(date +%s)
if ! "$PY" setup.py build_ext --inplace >"$out/pcpkv_torch_build.log" 2>&1; then
  grep -n -B2 -A6 "error" "$out/pcpkv_torch_build.log" | head -80
  tail -20 "$out/pcpkv_torch_build.log"
  echo "SUMMARY: pcpkv_torch build FAILED after $(( $(date +%s) - start ))s (log: $out/pcpkv_torch_build.log)"
  exit 1
fi
build_s=$(( $(date +%s) - start ))
"$PY" -c "import pcpkv_torch as pk; print('cuda dispatch kernel:', pk.cuda_dispatch_impl())"
start=$(date +%s)
# shellcheck disable=SC2086
"$PY" -m pytest tests -q -rs -p no:cacheprovider -p no:logging --junitxml="$out/pcpkv_torch_junit.xml" \
  ${PYTEST_ARGS:-} 2>&1 | tee "$out/pcpkv_torch_pytest.log" | tail -80
rc=${PIPESTATUS[0]}
result="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$out/pcpkv_torch_pytest.log" | tail -1 | tr -d '=')"
echo "SUMMARY: pcpkv_torch build ${build_s}s, pytest $(( $(date +%s) - start ))s:${result:- (no pytest summary)} (exit $rc)"
exit "$rc"
