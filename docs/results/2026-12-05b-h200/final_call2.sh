#!/usr/bin/env bash
# The lead's second device call of 2026-12-05: with kSplitMaxTokensPerWarp = 2, the dispatch byte tests and the
# issue 34 bench (warp, which now splits at 4096, beside warp_token), eager and graph columns.
set -uo pipefail
out="${OUT:?}"
build=build-gpu
t0=$SECONDS
say() { echo "[+$((SECONDS - t0))s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF > /tmp/cfg.log 2>&1 &&
  ninja -C $build -j 16 pcpkv_cli cuda_test_publish_kernels > /tmp/build.log 2>&1
say "build rc=$?"
timeout 60 $build/tests/cuda_test_publish_kernels --gtest_brief=1 > "$out/byte_tests2.log" 2>&1
say "byte tests rc=$?"; tail -2 "$out/byte_tests2.log"
timeout 120 $build/pcpkv bench --models glm-5,deepseek-v3.2 --pcp 8 --kv-formats fp8_ds_mla --topk-fill tail \
  --pdl-tokens none --single-rank-tokens 4096,8192,32768 --variants warp_token,warp \
  --layer-variants warp_token:fused:2,warp:fused:2 --json "$out/bench2.json" --markdown "$out/bench2.md" > "$out/bench2.log" 2>&1
say "bench rc=$?"
grep -A12 "^## dispatch alone" "$out/bench2.md" | tail -9
grep -A12 "^## per GPU" "$out/bench2.md" | tail -9
