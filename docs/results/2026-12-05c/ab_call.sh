#!/usr/bin/env bash
# Issue 34, perf-log 40: the warp dispatch's CTA start. Three builds of section 38's event-timed harness
# (../2026-12-05b-h200/token_clock.cu -DNO_STAMP: the kernel as pcpkv builds it, one launch between events, median
# of 40) over three kernel sources:
#   base      src/publish/cuda/dispatch_warp.cu as it is (run at 6e9e6b8)
#   prefetch  base + prefetch.patch: the first token's rows bulk-prefetched to L2 before the norm weights' copy
#   peel      base + peel.patch: the first item's loads into registers before the weights' copy (spills)
# run in the order base, prefetch, peel, peel, prefetch, base at 4096, 8192 and 32768 tokens.
set -uo pipefail
d=docs/results/2026-12-05c
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
src=src/publish/cuda/dispatch_warp.cu
for v in prefetch peel; do patch -s -o /tmp/dispatch_warp_$v.cu $src < $d/$v.patch || exit 1; done
flags="-O3 -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -DFMT_USE_CONSTEXPR=1 -Xcompiler=-ffp-contract=off -Iinclude -Isrc -DNO_STAMP"
h=docs/results/2026-12-05b-h200/token_clock.cu
nvcc $flags $h -o /tmp/tc_base &
nvcc $flags '-DDISPATCH_SRC="/tmp/dispatch_warp_prefetch.cu"' $h -o /tmp/tc_prefetch &
nvcc $flags '-DDISPATCH_SRC="/tmp/dispatch_warp_peel.cu"' $h -o /tmp/tc_peel &
wait
for T in 4096 8192 32768; do
  for v in base prefetch peel peel prefetch base; do
    echo "## $v T=$T"
    /tmp/tc_$v $T
  done
done 2>&1 | tee "$out/ab.md"
