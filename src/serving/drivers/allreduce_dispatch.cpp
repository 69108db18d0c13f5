// src/serving/drivers/allreduce_dispatch.cpp: THE one-shot / two-shot threshold of the all-reduce
// (pcpkv/serving/allreduce.h).
//
// One-shot reads W x the message per rank behind one barrier; two-shot reads 2 x the message behind two
// barriers, so one-shot wins small messages and loses once W x bytes outweighs a barrier.
//
// MEASURED: NVIDIA H200 (one GPU, CUDA 13.0), 2026-11-29, `pcpkv bench-serving` (defaults; W logical ranks
// on the one GPU, fused rows of hidden 6144), /work/notes/device_logs/run3_bench/serving.md. Microseconds,
// one-shot vs two-shot at the sizes around each crossover (bytes per rank):
//   plain  W=2: 4 MiB 18.00 vs 19.26, 16 MiB 91.42 vs 89.50        -> one-shot up to 4 MiB
//          W=4: 1 MiB 11.41 vs 12.84, 4 MiB 44.62 vs 40.48         -> one-shot up to 1 MiB
//          W=8: 768 KiB 18.25 vs 19.63, 1 MiB 23.18 vs 20.86       -> one-shot up to 768 KiB
//   fused  W=2, W=4: one-shot wins at every measured size (up to 768 KiB: 13.55 vs 18.14, 22.44 vs 23.84):
//          same thresholds as plain;
//          W=8: 96 KiB 14.72 vs 32.02, 768 KiB 45.58 vs 38.61     -> unmeasured in between; linear
//          interpolation puts the crossover near 500 KiB: one-shot up to 384 KiB (32 rows of 6144), a size
//          the bench now measures by default.
// W = 3, 5, 6, 7 take the next larger measured W's threshold. These are logical ranks sharing ONE GPU's
// SMs and HBM (one-shot's W x reads all land on the same memory).
// ACROSS GPUs (W = 2 only so far): 2 x H200 NV18, one process per GPU, 2026-11-29, `scripts/multigpu_run.sh`
// (docs/results/2026-11-29-h200x2/allreduce.log):
//   plain  4 MiB 51.76 vs 54.20, 8 MiB 99.66 vs 99.19                -> one-shot up to 4 MiB (unchanged)
//   fused  768 KiB 28.48 vs 29.11, 1536 KiB 51.24 vs 46.98            -> one-shot up to 768 KiB (was 4 MiB)
// There ncclAllReduce beats both from 128 KiB (plain: 7.37 vs 7.50 one-shot; 4 MiB 33.06 vs 51.76), and the
// fused NCCL + norm ties two-shot at 48 MiB. This function only splits one-shot / two-shot; routing large
// messages to NCCL is not done (docs/perf.md section 10 says what to measure first).
#include <cstdint>

#include "pcpkv/serving/allreduce.h"
#include "pcpkv/core/error.h"

namespace pcpkv {

AllReduceAlgo choose_allreduce_algo(int64_t bytes, int32_t world_size, bool fused) {
  PCPKV_CHECK(bytes >= 0, "all-reduce: bytes = {} must be >= 0", bytes);
  PCPKV_CHECK(world_size >= 1 && world_size <= kAllReduceMaxRanks, "all-reduce: world_size = {} is outside [1, {}]",
              world_size, kAllReduceMaxRanks);
  int64_t one_shot_max = 0;
  if (world_size <= 2)
    one_shot_max = fused ? int64_t{768} << 10 : int64_t{4} << 20;
  else if (world_size <= 4)
    one_shot_max = int64_t{1} << 20;
  else
    one_shot_max = fused ? int64_t{384} << 10 : int64_t{768} << 10;
  return bytes <= one_shot_max ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
}

AllReduceAlgo choose_allreduce_algo(int64_t bytes, int32_t world_size) {
  return choose_allreduce_algo(bytes, world_size, false);
}

}  // namespace pcpkv
