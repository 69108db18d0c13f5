#!/usr/bin/env bash
# The lead's one device call of 2026-12-05 (after the merges): build the CLI, the dispatch byte tests and the CUDA
# extension; run the byte tests (every variant, warp_split included, against the CPU oracle), the Python suites of
# today's GPU paths (EngineCaches over CUDA IPC, VllmPcpPublisher, the drop-in op), then the issue 34 bench.
set -uo pipefail
out="${OUT:?}"
build=build-gpu
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$SECONDS
say() { echo "[+$((SECONDS - t0))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import setuptools, torch; print('setuptools', setuptools.__version__, 'torch', torch.__version__)"
(cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF &&
  ninja -C $build -j 10 pcpkv_cli cuda_test_publish_kernels cuda_test_topk_fill cuda_test_publish_variants) \
  > /tmp/build.log 2>&1 &
bpid=$!
(cd python && CXX=/usr/bin/g++ CC=/usr/bin/gcc MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/ext.log 2>&1)
erc=$?
say "extension rc=$erc"
[ $erc = 0 ] || { grep -n -A5 "error" /tmp/ext.log | head -40; cp /tmp/ext.log "$out/"; }
wait $bpid
brc=$?
say "build rc=$brc"
[ $brc = 0 ] || { grep -E "error|FAILED" /tmp/build.log | head -20; cp /tmp/build.log "$out/"; }
for t in cuda_test_publish_kernels cuda_test_topk_fill cuda_test_publish_variants; do
  timeout 100 $build/tests/$t --gtest_brief=1 > "$out/$t.log" 2>&1
  say "$t rc=$?"
  tail -3 "$out/$t.log"
done
(cd python && timeout 260 python3 -m pytest tests/test_engine_caches.py tests/test_vllm_publish.py tests/test_vllm_dropin.py \
  tests/test_vllm_dropin_messages.py tests/test_vllm_semantics.py tests/test_errors.py -q -rs -p no:cacheprovider \
  > "$out/pytest.log" 2>&1)
say "pytest rc=$?"
tail -25 "$out/pytest.log"
timeout 150 $build/pcpkv bench --models glm-5,deepseek-v3.2 --pcp 8 --kv-formats fp8_ds_mla --topk-fill tail \
  --pdl-tokens none --single-rank-tokens 4096,32768 --variants warp_token,warp_split \
  --layer-variants warp_token:fused:2,warp:fused:2 --json "$out/bench.json" --markdown "$out/bench.md" > "$out/bench.log" 2>&1
say "bench rc=$?"
tail -40 "$out/bench.log"
