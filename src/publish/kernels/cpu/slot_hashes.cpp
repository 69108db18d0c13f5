// The CPU oracles of the replica check's kernels (pcpkv/publish/replica_hash.h; docs/spec.md section 5.2): the hashes
// of a replica's written slots, and the comparison of every rank's hashes with rank 0's.
#include <cstddef>

#include "pcpkv/core/error.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv {

void validate_slot_hashes_shape(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                                int64_t num_slots, const uint64_t* hashes) {
  validate_cache_format(fmt);
  validate_cache_target(target, fmt, "slot hashes: target");
  PCPKV_CHECK(num_slots >= 0, "slot hashes: num_slots = {} must be >= 0", num_slots);
  PCPKV_CHECK(num_slots == 0 || (slots != nullptr && hashes != nullptr), "slot hashes: slots ({}) or hashes ({}) is null",
              slots ? "set" : "null", hashes ? "set" : "null");
  // The kernel addresses both caches with the MLA cache's block size.
  PCPKV_CHECK(!fmt.has_indexer || (target.index.block_size == target.mla.block_size &&
                                    target.index.num_blocks >= target.mla.num_blocks),
              "slot hashes: the indexer cache ({} blocks of {}) does not cover the MLA cache ({} blocks of {})",
              target.index.num_blocks, target.index.block_size, target.mla.num_blocks, target.mla.block_size);
}

void validate_hash_slots(const int64_t* slots, int64_t num_slots, int64_t num_cache_slots) {
  for (int64_t i = 0; i < num_slots; ++i)
    PCPKV_CHECK(slots[i] >= 0 && slots[i] < num_cache_slots,
                "slot hashes: slots[{}] = {} is outside [0, {}) (the cache's slots)", i, slots[i], num_cache_slots);
}

void slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, int64_t num_slots,
                           uint64_t* hashes) {
  validate_slot_hashes_shape(target, fmt, slots, num_slots, hashes);
  validate_hash_slots(slots, num_slots, target.mla.num_slots());
  const int64_t row_bytes = mla_row_bytes(fmt.kv_format);
  // w(j) once per call rather than per byte (pcpkv run hashes every replica of every transport).
  uint64_t w[hash::kMaxHashedBytes];
  for (int j = 0; j < hash::kMaxHashedBytes; ++j) w[j] = hash::replica_hash_weight(static_cast<uint64_t>(j));
  auto add = [&](uint64_t h, const uint8_t* bytes, int64_t n, int64_t first) {
    for (int64_t j = 0; j < n; ++j) h += w[first + j] * bytes[j];
    return h;
  };
  for (int64_t i = 0; i < num_slots; ++i) {
    const int64_t s = slots[i];
    uint64_t h = add(0, target.mla_base + target.mla.row_offset(s), row_bytes, 0);
    if (fmt.has_indexer) {
      h = add(h, target.index_base + target.index.data_offset(s), kIndexHeadDim, row_bytes);
      h = add(h, target.index_base + target.index.scale_offset(s), 4, row_bytes + kIndexHeadDim);
    }
    hashes[i] = h;
  }
}

std::vector<uint64_t> slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt,
                                            const std::vector<int64_t>& slots) {
  std::vector<uint64_t> h(slots.size());
  slot_hashes_reference(target, fmt, slots.data(), static_cast<int64_t>(slots.size()), h.data());
  return h;
}

std::vector<ReplicaHashDiff> compare_replica_hashes_reference(const std::vector<std::vector<uint64_t>>& hashes) {
  PCPKV_CHECK(!hashes.empty(), "compare replica hashes: no ranks");
  const std::vector<uint64_t>& base = hashes[0];
  std::vector<ReplicaHashDiff> diffs(hashes.size());
  for (size_t q = 1; q < hashes.size(); ++q) {
    PCPKV_CHECK(hashes[q].size() == base.size(), "compare replica hashes: rank {} has {} hashes, rank 0 {}", q,
                hashes[q].size(), base.size());
    for (size_t i = 0; i < base.size(); ++i) {
      if (hashes[q][i] == base[i]) continue;
      if (diffs[q].num_diff++ == 0) diffs[q].first = static_cast<int64_t>(i);
    }
  }
  return diffs;
}

}  // namespace pcpkv
