#!/usr/bin/env bash
# Issue 34, perf-log 40: the warp dispatch's CTA start. Three builds of the same event-timed harness
# (token_clock_ab.cu, -DNO_STAMP: the kernel as pcpkv builds it, one launch between events, median of 40):
#   base      dispatch_warp_base.cu (HEAD 6e9e6b8's source)
#   prefetch  dispatch_warp_prefetch.cu: the first token's rows bulk-prefetched to L2
#             before the norm weights' copy
#   peel      dispatch_warp_peel.cu: the first item's loads into registers before the weights' copy (spills)
# run in the order base, prefetch, peel, peel, prefetch, base at 4096, 8192 and 32768 tokens.
set -uo pipefail
d=docs/results/2026-12-05c
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
flags="-O3 -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -DFMT_USE_CONSTEXPR=1 -Xcompiler=-ffp-contract=off -Iinclude -Isrc -DNO_STAMP"
nvcc $flags '-DDISPATCH_SRC="dispatch_warp_base.cu"' $d/token_clock_ab.cu -o /tmp/tc_base &
nvcc $flags '-DDISPATCH_SRC="dispatch_warp_prefetch.cu"' $d/token_clock_ab.cu -o /tmp/tc_prefetch &
nvcc $flags '-DDISPATCH_SRC="dispatch_warp_peel.cu"' $d/token_clock_ab.cu -o /tmp/tc_peel &
wait
for T in 4096 8192 32768; do
  for v in base prefetch peel peel prefetch base; do
    echo "## $v T=$T"
    /tmp/tc_$v $T
  done
done 2>&1 | tee "$out/ab.md"
