// pcpkv/device/replica_hash.h: the hash of the run-time replica check (docs/spec.md section 5.2), the one
// definition the CPU oracle (slot_hashes_reference), the CUDA kernel (cuda::launch_slot_hashes) and, through
// torch.ops.pcpkv.replica_hash_weights, pcpkv_torch.models.replica_check share.
//
// A slot's hashed bytes b[0..n) are its MLA row (mla_row_bytes of the format) and, on an indexer layer, its 128
// indexer e4m3 bytes and the 4 bytes of its fp32 scale, in that order. Its hash is
//   H = sum_j w(j) * b[j]  mod 2^64,   w(j) = splitmix64 output number j + 1, made odd (| 1).
// A change of one byte by d (0 < |d| < 256) changes H by d * w(j), which is never 0 mod 2^64 because w(j) is odd:
// so any single-byte change of a hashed row changes its hash. The sum is exact integer arithmetic, so the order
// in which a kernel adds the terms does not change it (a warp reduction equals the sequential CPU loop).
#pragma once

#include <cstdint>

#include "pcpkv/device/config.h"

namespace pcpkv::hash {

/// Most bytes a slot hashes: a bf16 MLA row (1152) and an indexer slot (128 + 4).
constexpr int kMaxHashedBytes = 1152 + 132;

/// w(j): splitmix64 (Steele, Lea, Flood 2014) of the state (j + 1) * 0x9E3779B97F4A7C15, with the low bit set.
/// Python reads these through torch.ops.pcpkv.replica_hash_weights (python/csrc/replica_hash.cpp).
/// w(0) = 0xE220A8397B1DCDAF.
PCPKV_HD uint64_t replica_hash_weight(uint64_t j) {
  uint64_t z = (j + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) | 1ull;
}

}  // namespace pcpkv::hash
