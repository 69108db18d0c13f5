#!/usr/bin/env bash
# scratch (not committed): the last 3 python files on main (ab_base) + A/B of the two-plane weights
set -u
T0=$SECONDS
el() { echo $((SECONDS - T0)); }
mkdir -p $OUT/ab $OUT/py2
(AB_ROUNDS=0 AB_JOBS=5 scripts/bench_ab.sh /tmp/ab base=$PWD/ab_base > $OUT/ab/build_base.log 2>&1; echo "base build rc=$?") &
(cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF > $OUT/ab/cfg_new.log 2>&1 &&
 ninja -C build-gpu -j5 pcpkv_cli cuda_test_publish_kernels cuda_test_publish_variants cuda_test_topk_fill > $OUT/ab/build_new.log 2>&1; echo "new build rc=$?") &
(cd ab_base/python && CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDA_HOME=/usr/local/cuda MAX_JOBS=6 timeout 420 python3 setup.py build_ext --inplace > $OUT/py2/ext_build.log 2>&1; echo "ext rc=$?") &
wait
echo "built at $(el) s"
for t in "cuda_test_publish_kernels --gtest_filter=DispatchKernel*:*Launch*" cuda_test_publish_variants cuda_test_topk_fill; do
  timeout 90 build-gpu/tests/$t --gtest_brief=1 > $OUT/ab/bytes_${t%% *}.log 2>&1; echo "bytes $t rc=$? $(tail -1 $OUT/ab/bytes_${t%% *}.log)"
done
F="--models glm-5,deepseek-v3.2 --pcp 8 --kv-formats fp8_ds_mla --single-rank-tokens 4096,32768 --variants warp --layer-variants warp:fused:2 --iters 20 --pdl-tokens none --topk-fill tail"
for r in 1 2 3; do for n in base new; do
  b=/tmp/ab/build-base/pcpkv; [ $n = new ] && b=build-gpu/pcpkv
  timeout 60 $b bench $F --markdown $OUT/ab/${n}_$r.md --json $OUT/ab/${n}_$r.json > $OUT/ab/${n}_$r.log 2>&1; echo "$n $r rc=$? at $(el) s"
done; done
left=$((570 - $(el)))
echo "python budget ${left}s"
OUT=$OUT/py2 SKIP_BUILD=1 PYTEST_FILES="test_consumers.py test_distributed_model.py test_models.py" timeout $left bash ab_base/python/run_device_tests.sh > $OUT/py2/summary.txt 2>&1
echo "py rc=$?"; tail -5 $OUT/py2/summary.txt
rm -f $OUT/py2/junit_*
tar czf $OUT/call2.tgz -C $OUT ab py2 && rm -rf $OUT/ab $OUT/py2
