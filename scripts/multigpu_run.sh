#!/usr/bin/env bash
# scripts/multigpu_run.sh: the whole multi-GPU measurement in ONE call on a fresh machine with
# 2, 4 or 8 GPUs: build (only what is needed), the multigpu tests, then the measurements, each step bounded
# in time so that the whole ends in under 8 minutes; a markdown summary for docs/perf.md is printed last
# (and kept as $OUT/summary.md).
#   1. pcpkv bench-link      peer-copy bandwidth (one pair, both ways, all pairs at once)
#   2. mp-publish            PCP 2/4/8 x fp8/fp8_ds_mla, GLM-5, 32K tokens: per-rank medians per stage,
#                            speedup over collect, P2P bandwidth vs the link, byte oracle, staging == direct
#   3. bench-allreduce       symmetric memory (one-shot, two-shot, fused + RMSNorm) vs NCCL, 8 KiB .. 64 MiB
#   4. bench-fence           across GPUs, then 2/4/8 processes on ONE GPU (time-sliced, time-bounded)
# MULTIGPU_SKIP_TESTS=1 and MULTIGPU_SKIP_SHARED_FENCE=1 leave those steps out when device time is short.
# Logs (7 files) under $OUT: build.log, tests.log, link.log, publish.log, allreduce.log, fence.log, summary.md.
# Dry run (MULTIGPU_DRY_RUN=1, or automatically on a machine with one GPU): the same steps and summary with
# 2 processes sharing GPU 0, collect through P2P copies instead of NCCL (NCCL refuses two ranks on one GPU),
# 5 repeats; the link and all-reduce steps need 2 GPUs and are listed as skipped. It checks the harness,
# not the numbers (processes sharing a GPU time-slice).
# NVLink multicast stays off (SPEC section 5; these machines forbid it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
build="${PCPKV_BUILD_DIR:-$root/build-gpu}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
budget_s="${MULTIGPU_BUDGET_S:-455}"   # everything but the summary must end by then (the call allows 600)
t0=$SECONDS
steps=()
say() { echo "[multigpu +$((SECONDS - t0))s] $*"; }
left() { echo $((budget_s - (SECONDS - t0))); }

# step NAME LIMIT_S LOG CMD...: runs CMD (appending to LOG) under min(LIMIT_S, time left); records rc and time.
step() {
  local name="$1" limit="$2" log="$3"
  shift 3
  local l
  l=$(left)
  if [ "$l" -lt 8 ]; then
    steps+=("| $name | skipped (out of time) | 0 |")
    echo "== $name: SKIPPED, out of time" >> "$log"
    return 124
  fi
  [ "$limit" -gt "$l" ] && limit=$l
  local s=$SECONDS
  echo "== $name (limit ${limit}s): $*" >> "$log"
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $((SECONDS - s))s" >> "$log"
  steps+=("| $name | $([ $rc -eq 0 ] && echo ok || { [ $rc -eq 124 ] && echo "TIMED OUT ($limit s)" || echo "rc=$rc"; }) | $((SECONDS - s)) |")
  say "$name rc=$rc ($((SECONDS - s))s)"
  return $rc
}

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{ nvidia-smi -L; nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; } \
  > "$out/build.log" 2>&1
say "$ngpu GPUs"
dry="${MULTIGPU_DRY_RUN:-0}"
[ "$ngpu" -eq 1 ] && dry=1
gpus_of() { if [ "$dry" = 1 ]; then echo 0; else seq -s, 0 $(($1 - 1)); fi; }
pcps=()
for p in 2 4 8; do [ "$p" -le "$ngpu" ] && pcps+=("$p"); done
collect_via=nccl
repeats=30
if [ "$dry" = 1 ]; then
  pcps=(2)
  collect_via=p2p
  repeats=5
  say "dry run: 2 processes on GPU 0, collect via p2p, $repeats repeats"
fi

# ---- build: the CLI and the multigpu tests only ----
if [ ! -f "$build/build.ninja" ]; then
  step configure 60 "$out/build.log" cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF
fi
step build 300 "$out/build.log" ninja -C "$build" -j "$(nproc)" pcpkv_cli multigpu_launch_gpus
build_rc=$?
pcpkv="$build/pcpkv"
if [ $build_rc -ne 0 ] || [ ! -x "$pcpkv" ]; then
  grep -E "error|FAILED" "$out/build.log" | head -30
  say "build failed; nothing else runs"
fi

if [ -x "$pcpkv" ] && { [ "$ngpu" -ge 2 ] || [ "$dry" = 1 ]; }; then
  # ---- tests ----
  if [ -x "$build/tests/multigpu_launch_gpus" ] && [ "${MULTIGPU_SKIP_TESTS:-0}" != 1 ]; then
    # The 32K-token shared-layer test is left to ctest: the measurements below check 32K-token replicas anyway.
    step tests 110 "$out/tests.log" "$build/tests/multigpu_launch_gpus" --gtest_color=no \
      --gtest_filter='-*ThirtyTwoK*'
  fi

  # ---- links ----
  if [ "$ngpu" -ge 2 ]; then
    step bench-link 40 "$out/link.log" "$pcpkv" bench-link --mib 256 --iters 10 --md-rows
  else
    steps+=("| bench-link | skipped (needs 2 GPUs) | 0 |")
  fi
  link_gbps=$(sed -n 's/^link-gbps-all-pairs-recv=//p' "$out/link.log" | tail -1)
  link_flag=()
  [ -n "$link_gbps" ] && link_flag=(--link-gbps "$link_gbps")

  # ---- publication: PCP x format, 32K tokens (+ 4 decodes), GLM-5, indexer layer ----
  for p in "${pcps[@]}"; do
    for kv in fp8 fp8_ds_mla; do
      step "mp-publish PCP $p $kv" 75 "$out/publish.log" "$pcpkv" launch --nproc "$p" --gpus "$(gpus_of "$p")" \
        --output rank0 -- mp-publish --backend cuda --model glm-5 --tokens 32768 --decodes 4 --kv-format "$kv" \
        --layer indexer --collect-via "$collect_via" --repeats "$repeats" --warmup 5 --flush-l2-mb 256 --threads 8 \
        "${link_flag[@]}" --md-rows
    done
  done

  # ---- all-reduce: symmetric memory vs NCCL on 2 and on every GPU (<= 8) ----
  ar_worlds=(2)
  [ "$ngpu" -gt 2 ] && ar_worlds+=($((ngpu > 8 ? 8 : ngpu)))
  if [ "$ngpu" -lt 2 ]; then
    ar_worlds=()
    steps+=("| bench-allreduce | skipped (needs 2 GPUs: NCCL refuses two ranks on one GPU) | 0 |")
  fi
  for w in "${ar_worlds[@]}"; do
    step "bench-allreduce $w GPUs" 60 "$out/allreduce.log" "$pcpkv" launch --nproc "$w" --gpus "$(gpus_of "$w")" \
      --output rank0 -- bench-allreduce --md-rows
  done

  # ---- fence: across GPUs, then processes sharing ONE GPU (time-sliced without MPS: bounded) ----
  for p in "${pcps[@]}"; do
    [ "$dry" = 1 ] && break  # the processes-on-GPU-0 rows below are the dry run's fence
    step "bench-fence $p GPUs" 30 "$out/fence.log" "$pcpkv" launch --nproc "$p" --gpus "$(gpus_of "$p")" \
      --output rank0 -- bench-fence --backend cuda --layers 61 --iters 50 --md-rows
  done
  for p in 2 4 8; do
    [ "${MULTIGPU_SKIP_SHARED_FENCE:-0}" = 1 ] && break
    step "bench-fence $p processes on GPU 0" 25 "$out/fence.log" "$pcpkv" launch --nproc "$p" --gpus 0 \
      --output rank0 -- bench-fence --backend cuda --layers 61 --iters 50 --time-budget 12 --md-rows
  done
fi

# ---- summary (markdown, for docs/perf.md) ----
md() { grep -h '^md|' "$@" 2>/dev/null | sed 's/^md|//'; }
{
  [ "$dry" = 1 ] && echo "## DRY RUN on one GPU (harness check; not a multi-GPU measurement)" && echo
  echo "## Multi-GPU run ($(date -u +%Y-%m-%d), ${ngpu} x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nvidia-smi topo -m 2>/dev/null | awk '$1=="GPU0" && $2=="X"{print $3; exit}'))"
  echo
  echo "Command: \`scripts/multigpu_run.sh\` (NCCL_NVLS_ENABLE=0, no multicast). One process per GPU unless said."
  echo
  echo "### Steps"
  echo
  echo "| step | result | s |"
  echo "|---|---|---|"
  printf '%s\n' "${steps[@]}"
  echo
  if [ -f "$out/tests.log" ]; then
    echo "Tests (multigpu_launch_gpus): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$out/tests.log" | tr '\n' ' ' | sed 's/  */ /g')"
    grep -E '^\[  FAILED  \] [A-Za-z]' "$out/tests.log" | sed 's/^/- /'
    echo
  fi
  echo "### Links (cudaMemcpyPeerAsync, copy engines, 256 MiB copies; GB/s = 1e9 B/s)"
  echo
  echo "| GPUs | pair one way | pair both ways (sum) | all pairs: each GPU receives | all pairs: total | local D2D |"
  echo "|---|---|---|---|---|---|"
  md "$out/link.log"
  echo
  echo "### Publication per layer (GLM-5, 32768-token prefill + 4 decodes, indexer layer, block 64)"
  echo
  echo "Per rank the median of $repeats runs after 5 warm-up (CUDA events per stage, cold L2: 256 MiB overwritten before"
  echo "each run); a stage's ms is the max over ranks of the per-rank medians; total = max over ranks of each"
  echo "rank's median total. collect = dispatch + 3 all-gathers ($collect_via) + insert; staging = dispatch with P2P stores"
  echo "+ fence + combine; direct = dispatch with P2P stores + fence. P2P = bytes each GPU receives from its peers"
  echo "during dispatch / dispatch time, and dispatch / (received / all-pairs link bandwidth${link_gbps:+ = $link_gbps GB/s}). Oracle: every replica"
  echo "== the single-process CPU reference byte for byte, guard bytes intact, staging == direct."
  echo
  echo "| PCP | format | transport | stages ms (max over ranks) | total ms | per-rank total ms | vs collect | P2P receive | oracle |"
  echo "|---|---|---|---|---|---|---|---|---|"
  md "$out/publish.log"
  grep -h "staging == direct" "$out/publish.log" 2>/dev/null | sed 's/^ */- /'
  echo
  echo "### All-reduce, bf16 (us per call: max over ranks of each rank's median over graph replays)"
  echo
  echo "| GPUs | message | one-shot | two-shot | NCCL | fastest | table picks now | oracle |"
  echo "|---|---|---|---|---|---|---|---|"
  md "$out/allreduce.log"
  echo
  grep -h -E "bench-allreduce: [0-9]+ processes|crossover" "$out/allreduce.log" 2>/dev/null | sed 's/^ */- /'
  echo
  echo "### Fence (SPEC section 5, us per layer; 61 layers back to back, 2 barrier indices)"
  echo
  echo "| processes | placement | median us | max over ranks | graph us/layer | layers x iters | note |"
  echo "|---|---|---|---|---|---|---|"
  md "$out/fence.log"
  echo
  echo "Processes sharing one GPU without MPS time-slice: those rows measure context switches, not the fence."
  echo
  echo "Total wall time: $((SECONDS - t0)) s."
} > "$out/summary.md"
cat "$out/summary.md"
