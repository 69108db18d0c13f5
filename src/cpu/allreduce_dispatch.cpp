// src/cpu/allreduce_dispatch.cpp: THE one-shot / two-shot threshold of the all-reduce (pcpkv/allreduce.h).
//
// One-shot reads W x the message per rank behind one barrier; two-shot reads 2 x the message behind two
// barriers. PROVISIONAL: the thresholds below follow the public custom all-reduces (vLLM, TRT-LLM: one-shot
// up to a few hundred KB, lower for larger worlds) until `pcpkv bench-serving --what allreduce` measures
// the crossover; multi-GPU values belong to the multi-GPU issue. Record date and command when replaced.
#include <cstdint>

#include "pcpkv/allreduce.h"
#include "pcpkv/error.h"

namespace pcpkv {

AllReduceAlgo choose_allreduce_algo(int64_t bytes, int32_t world_size) {
  PCPKV_CHECK(bytes >= 0, "all-reduce: bytes = {} must be >= 0", bytes);
  PCPKV_CHECK(world_size >= 1 && world_size <= kAllReduceMaxRanks, "all-reduce: world_size = {} is outside [1, {}]",
              world_size, kAllReduceMaxRanks);
  if (world_size <= 2) return AllReduceAlgo::kOneShot;  // two ranks: two-shot reads 1.5x instead of 2x, behind 2 barriers
  const int64_t one_shot_max = world_size <= 4 ? (int64_t{512} << 10) : (int64_t{256} << 10);
  return bytes <= one_shot_max ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
}

}  // namespace pcpkv
