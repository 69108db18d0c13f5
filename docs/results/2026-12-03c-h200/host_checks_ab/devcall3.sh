#!/usr/bin/env bash
# scratch: eager layer times, main vs the cheaper host checks (perf.md 31)
set -u
mkdir -p $OUT/ab
(AB_ROUNDS=0 AB_JOBS=8 scripts/bench_ab.sh /tmp/ab base=$PWD/ab_base > $OUT/ab/build_base.log 2>&1; echo "base rc=$?") &
(cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF -DPCPKV_TESTS=OFF > /dev/null && ninja -C build-gpu -j8 pcpkv_cli > $OUT/ab/build_new.log 2>&1; echo "new rc=$?") &
wait; echo "built $SECONDS s"
F="--models glm-5,deepseek-v3.2 --pcp 8 --kv-formats fp8_ds_mla --single-rank-tokens none --per-gpu-pcp 0 --replica-check-pcp 0 --pdl-tokens none --layer-variants warp:fused:2 --topk-fill tail --iters 20"
for r in 1 2 3; do for n in base new; do
  b=/tmp/ab/build-base/pcpkv; [ $n = new ] && b=build-gpu/pcpkv
  timeout 40 $b bench $F --markdown $OUT/ab/${n}_$r.md > $OUT/ab/${n}_$r.log 2>&1; echo "$n $r rc=$? $SECONDS s"
  grep -E "^\| (glm-5|deepseek-v3.2) \| 8 \| fp8_ds_mla \| (staging|direct) \| warp:fused:2 \(fill tail\) \| (dispatch|combine) " $OUT/ab/${n}_$r.md | awk -F'|' '{printf "%s %s %s %s; ", $2,$5,$7,$8}'; echo
done; done
tar czf $OUT/call3.tgz -C $OUT ab && rm -rf $OUT/ab
