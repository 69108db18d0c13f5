// The run-time replica check's kernels (docs/spec.md section 5.2; pcpkv/publish/kernels.h): the hashes of a
// replica's written slots, and every rank's hashes against rank 0's. The hash is exact integer arithmetic mod
// 2^64, so the warp's reduction order gives the CPU oracle's sum (slot_hashes_reference) bit for bit.
#include <algorithm>

#include "core/cuda/check.h"
#include "core/cuda/device.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/kernels.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kIndexerHashedBytes = 128 + 4;  // indexer e4m3 data, then the fp32 scale's bytes

struct SlotHashArgs {
  const uint8_t* mla_base;
  int64_t mla_row_stride, mla_block_stride;
  const uint8_t* index_base;  // null: the MLA row alone (a layer without an indexer)
  int64_t index_block_stride;
  const int64_t* index_slots; // [num_slots] the indexer's own slots (docs/spec.md 4.2; -1: none), or null: slots
  int32_t block_shift;        // log2(block_size): both caches share the block size (validated on the host)
  int32_t mla_row_bytes;
  const int64_t* slots;       // [num_slots]
  int64_t num_slots;
  uint64_t* hashes;           // [num_slots]
};

// One warp per slot (grid-stride): lane l adds the terms of bytes l, l + 32, ...; a butterfly sums the lanes.
// Byte loads by 32 consecutive lanes read whole 32-byte sectors, so the rows stream at memory speed without
// any alignment assumption on row or block strides.
__global__ void __launch_bounds__(kThreads) slot_hashes_kernel(const __grid_constant__ SlotHashArgs a) {
  __shared__ uint64_t w[hash::kMaxHashedBytes];
  const int total = a.mla_row_bytes + (a.index_base ? kIndexerHashedBytes : 0);
  for (int j = threadIdx.x; j < total; j += kThreads) w[j] = hash::replica_hash_weight(static_cast<uint64_t>(j));
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t block_mask = (int64_t{1} << a.block_shift) - 1;
  for (int64_t i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; i < a.num_slots; i += int64_t{gridDim.x} * kWarps) {
    const int64_t slot = a.slots[i];
    // -1 (the own-slot form only: host-checked) hashes no row of that cache; the indexer bytes keep their weights.
    const int64_t islot = a.index_slots ? a.index_slots[i] : slot;
    uint64_t h = 0;
    if (slot >= 0) {
      const int64_t block = slot >> a.block_shift, offset = slot & block_mask;
      const uint8_t* row = a.mla_base + block * a.mla_block_stride + offset * a.mla_row_stride;
#pragma unroll 4
      for (int j = lane; j < a.mla_row_bytes; j += 32) h += w[j] * row[j];
    }
    if (a.index_base && islot >= 0) {
      // The 132 bytes of the slot only: a padded block stride's padding lies past block_size * 132.
      const int64_t block = islot >> a.block_shift, offset = islot & block_mask;
      const uint8_t* blk = a.index_base + block * a.index_block_stride;
      const uint8_t* data = blk + offset * 128;
      const uint8_t* scale = blk + (block_mask + 1) * 128 + offset * 4;
      for (int j = lane; j < kIndexerHashedBytes; j += 32)
        h += w[a.mla_row_bytes + j] * (j < 128 ? data[j] : scale[j - 128]);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1)
      h += static_cast<uint64_t>(__shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(h), m));
    if (lane == 0) a.hashes[i] = h;
  }
}

__global__ void init_diffs_kernel(DeviceHashDiff* diffs, int32_t world) {
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  if (q < world) diffs[q] = DeviceHashDiff{0ull, ~0ull};
}

// Thread i compares entry i of every rank with rank 0's; atomics only where they differ (a clean check writes
// nothing).
__global__ void __launch_bounds__(kThreads)
    compare_hashes_kernel(const uint64_t* hashes, int32_t world, int64_t num_slots, DeviceHashDiff* diffs) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < num_slots; i += int64_t{gridDim.x} * kThreads) {
    const uint64_t h0 = hashes[i];
    for (int32_t q = 1; q < world; ++q) {
      if (hashes[int64_t{q} * num_slots + i] == h0) continue;
      atomicAdd(&diffs[q].num_diff, 1ull);
      atomicMin(&diffs[q].first, static_cast<unsigned long long>(i));
    }
  }
}

int64_t grid_for(int64_t items, int64_t per_block, int64_t blocks_per_sm) {
  return std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, int64_t{num_sms()} * blocks_per_sm));
}

void launch_hashes(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, const int64_t* index_slots,
                   int64_t num_slots, uint64_t* hashes, cudaStream_t stream) {
  validate_slot_hashes_shape(target, fmt, slots, num_slots, hashes, index_slots);
  if (num_slots == 0) return;
  SlotHashArgs a{};
  a.mla_base = target.mla_base;
  a.mla_row_stride = target.mla.row_stride;
  a.mla_block_stride = target.mla.block_stride;
  a.index_base = fmt.has_indexer ? target.index_base : nullptr;
  a.index_block_stride = target.index.block_stride;
  a.index_slots = index_slots;
  while ((int64_t{1} << a.block_shift) < target.mla.block_size) ++a.block_shift;  // a power of two (validated)
  a.mla_row_bytes = static_cast<int32_t>(mla_row_bytes(fmt.kv_format));
  a.slots = slots;
  a.num_slots = num_slots;
  a.hashes = hashes;
  const int64_t blocks = grid_for(num_slots, kWarps, 8);
  slot_hashes_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  PCPKV_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_slot_hashes(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, int64_t num_slots,
                        uint64_t* hashes, cudaStream_t stream) {
  launch_hashes(target, fmt, slots, nullptr, num_slots, hashes, stream);
}

void launch_slot_hashes_own_index(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                                  const int64_t* index_slots, int64_t num_slots, uint64_t* hashes,
                                  cudaStream_t stream) {
  PCPKV_CHECK(num_slots == 0 || index_slots != nullptr, "slot hashes: index_slots is null for num_slots = {}",
              num_slots);
  // Null with no slots: still the own-slot form (the indexer cache need not cover the MLA cache).
  static const int64_t kNone = -1;
  launch_hashes(target, fmt, slots, index_slots ? index_slots : &kNone, num_slots, hashes, stream);
}

void launch_compare_replica_hashes(const uint64_t* hashes, int32_t world, int64_t num_slots, DeviceHashDiff* diffs,
                                   cudaStream_t stream) {
  PCPKV_CHECK(world >= 1, "compare replica hashes: world = {} must be >= 1", world);
  PCPKV_CHECK(num_slots >= 0, "compare replica hashes: num_slots = {} must be >= 0", num_slots);
  PCPKV_CHECK(diffs != nullptr && (num_slots == 0 || hashes != nullptr),
              "compare replica hashes: hashes ({}) or diffs ({}) is null", hashes ? "set" : "null",
              diffs ? "set" : "null");
  init_diffs_kernel<<<(world + 127) / 128, 128, 0, stream>>>(diffs, world);
  PCPKV_CUDA_CHECK_LAUNCH();
  if (num_slots == 0 || world == 1) return;
  const int64_t blocks = grid_for(num_slots, kThreads, 4);
  compare_hashes_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(hashes, world, num_slots, diffs);
  PCPKV_CUDA_CHECK_LAUNCH();
}

}  // namespace pcpkv::cuda
