#!/bin/bash
# perf.md 29 diagnostics on one H200: the kept test on main's kernels, the dispatch vs replica count, ncu of the dispatch.
set -u
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0
mkdir -p /tmp/r
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF > /tmp/r/cfg.log 2>&1
ninja -C build-gpu -j16 pcpkv_cli cuda_test_publish_kernels > /tmp/r/build.log 2>&1; echo "build rc $? $(( $(date +%s) - T0 )) s"
timeout 60 ctest --test-dir build-gpu -R "DispatchKernel" -j4 --timeout 50 > /tmp/r/ctest_kernels.log 2>&1
echo "tests rc $? $(( $(date +%s) - T0 )) s"; grep -E "tests passed|Failed" /tmp/r/ctest_kernels.log | head -5
timeout 60 build-gpu/pcpkv bench --models glm-5,deepseek-v3.2 --pcp 2,4,8 --kv-formats fp8_ds_mla --single-rank-tokens 4096,32768 --variants warp --layer-variants warp:fused:2 --iters 20 --pdl-tokens none --topk-fill tail --markdown /tmp/r/pcp_scaling.md > /tmp/r/pcp_scaling.log 2>&1
echo "scaling rc $? $(( $(date +%s) - T0 )) s"
tar czf $OUT/diag.tgz -C /tmp r
timeout 80 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section LaunchStats \
  -k 'regex:dispatch_warp' -c 4 build-gpu/pcpkv bench --models glm-5 --pcp 8 --kv-formats fp8_ds_mla --transports direct --single-rank-tokens 32768 \
  --variants warp --layer-variants warp:fused:2 --iters 1 --warmup 0 --no-graph --pdl-tokens none --topk-fill tail --copy-gib 0.25 > /tmp/r/ncu.log 2>&1
echo "ncu rc $? $(( $(date +%s) - T0 )) s"
tar czf $OUT/diag.tgz -C /tmp r
