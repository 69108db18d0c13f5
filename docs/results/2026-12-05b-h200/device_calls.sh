#!/usr/bin/env bash
# docs/perf.md 38 (issue 34): what the two device calls of 2026-12-05 ran, from the repo root on the GPU machine.
#   round 1: the build, the probe at 4096 (twice) and 32768, the per-token profile, the kernel byte tests, the A/B
#            bench (the command with warp_token beside warp_split / warp)
#   round p: no library build: the probe, the per-item profile and the kernel timed by events (token_clock.cu)
#   round 2: the build, the per-token profile again, the goals' bench (three rounds), the kernel byte tests
set -uo pipefail
round="${1:?round 1, 2 or p}"
out="${OUT:?}"
build=build-gpu
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$SECONDS
say() { echo "[+$((SECONDS - t0))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [ "$round" = p ]; then
  # probes only (no library build): the byte-pattern probe, the kernel's per-item profile at 4096 and the kernel
  # itself (NO_STAMP: as pcpkv builds it) timed by events at 4096..32768, token instance beside the split instance
  f=(-O3 -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -DFMT_USE_CONSTEXPR=1 -Xcompiler=-ffp-contract=off -Iinclude -Isrc)
  nvcc "${f[@]}" docs/results/2026-12-05b-h200/token_clock.cu -o /tmp/token_clock &
  nvcc "${f[@]}" -DNO_STAMP docs/results/2026-12-05b-h200/token_clock.cu -o /tmp/token_time &
  nvcc -O3 -arch=sm_90 -std=c++17 docs/results/2026-12-05-h200/split_probe.cu -o /tmp/split_probe
  wait
  say "built"
  for t in 4096 4096 32768; do timeout 40 /tmp/split_probe $t; echo; done > "$out/probe.md" 2>&1
  say "probe rc=$?"
  timeout 40 /tmp/token_clock 4096 > "$out/token_clock.md" 2>&1
  say "token_clock rc=$?"
  for t in 4096 8192 16384 32768 4096; do timeout 40 /tmp/token_time $t; echo; done > "$out/token_time.md" 2>&1
  say "token_time rc=$?"
  cat "$out/token_time.md"
  exit 0
fi
flags=(-O3 -std=c++20 -arch=sm_90 --expt-relaxed-constexpr -DFMT_USE_CONSTEXPR=1 -Xcompiler=-ffp-contract=off -Iinclude -Isrc)
(
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF > /tmp/cfg.log 2>&1 &&
    ninja -C $build -j 16 pcpkv_cli cuda_test_publish_kernels
) > /tmp/build.log 2>&1 &
bpid=$!
nvcc "${flags[@]}" docs/results/2026-12-05b-h200/token_clock.cu -o /tmp/token_clock > /tmp/tc_build.log 2>&1 ||
  { tail -20 /tmp/tc_build.log; }
if [ "$round" = 1 ]; then
  nvcc -O3 -arch=sm_90 -std=c++17 docs/results/2026-12-05-h200/split_probe.cu -o /tmp/split_probe || exit 1
  for t in 4096 4096 32768; do timeout 60 /tmp/split_probe $t; echo; done > "$out/probe.md" 2>&1
  say "probe rc=$?"
fi
timeout 60 /tmp/token_clock 4096 > "$out/token_clock_$round.md" 2>&1
say "token_clock rc=$?"
wait $bpid
brc=$?
say "build rc=$brc"
grep -E "error|FAILED" /tmp/build.log | head -20
tail -3 /tmp/build.log
[ $brc = 0 ] || { cp /tmp/build.log "$out/build.log"; exit 1; }
# the kernel byte tests (every dispatch case against the CPU oracle, every variant)
tests() {
  timeout 70 $build/tests/cuda_test_publish_kernels --gtest_filter='*Dispatch*' --gtest_brief=1 > "$out/tests_$round.log" 2>&1
  say "tests rc=$?"
  tail -4 "$out/tests_$round.log"
}
common=(--models glm-5,deepseek-v3.2 --pcp 8 --kv-formats fp8_ds_mla --topk-fill tail --pdl-tokens none)
if [ "$round" = 1 ]; then
  tests
  timeout 170 $build/pcpkv bench "${common[@]}" --single-rank-tokens 4096,8192,32768 \
    --variants warp_token,warp_split --layer-variants warp_token:fused:2,warp:fused:2 \
    --json "$out/bench_1.json" --markdown "$out/bench_1.md" > "$out/bench_1.log" 2>&1
  say "bench rc=$?"
  tail -5 "$out/bench_1.log"
  python3 bench/vllm_peer.py  # vLLM is not on the device image: it says why it skips
else
  for i in 1 2 3; do
    json=(); [ $i = 1 ] && json=(--json "$out/bench_2_1.json")
    timeout 150 $build/pcpkv bench "${common[@]}" --single-rank-tokens 4096,32768 \
      --variants warp_token,warp --layer-variants warp_token:fused:2,warp:fused:2 \
      "${json[@]}" --markdown "$out/bench_2_$i.md" > /tmp/bench.log 2>&1
    say "bench $i rc=$?"
  done
  tail -5 /tmp/bench.log
  python3 bench/vllm_peer.py  # vLLM is not on the device image: it says why it skips
  tests
fi
