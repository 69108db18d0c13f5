#!/usr/bin/env bash
# scripts/multigpu_probe.sh: first look at a multi-GPU machine with the commands that exist today:
# topology, the per-process publication at PCP = 2 and = number of GPUs, the fence across GPUs.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build-gpu/out}"; mkdir -p "$out"
build="$root/build-gpu"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L | wc -l)
{ nvidia-smi -L; nvidia-smi topo -m; } 2>&1 | tee "$out/topo.log"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DPCPKV_BENCH=OFF > "$out/configure.log" 2>&1
fi
ninja -C "$build" -j "$(nproc)" pcpkv_cli > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
pcpkv="$build/pcpkv"
gpus=$(seq -s, 0 $((ngpu - 1)))
for P in 2 $ngpu; do
  for kv in fp8 fp8_ds_mla; do
    echo "== mp-publish PCP $P $kv"
    timeout 120 "$pcpkv" launch --nproc $P --gpus "$gpus" --output rank0 -- mp-publish --backend cuda \
      --tokens 32768 --decodes 4 --kv-format $kv --repeats 20 --collect-via nccl
    echo "rc=$?"
  done
done 2>&1 | tee "$out/publish.log"
for P in 2 $ngpu; do
  echo "== bench-fence $P processes on $P GPUs"
  timeout 60 "$pcpkv" launch --nproc $P --gpus "$gpus" --output rank0 -- bench-fence --backend cuda --layers 61 --iters 20
  echo "rc=$?"
done 2>&1 | tee "$out/fence.log"
