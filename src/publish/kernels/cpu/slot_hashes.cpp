// The CPU oracles of the replica check's kernels (pcpkv/publish/replica_hash.h; docs/spec.md section 5.2): the hashes
// of a replica's written slots, and the comparison of every rank's hashes with rank 0's.
#include <cstddef>

#include "pcpkv/core/error.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/cpu.h"
#include "pcpkv/publish/replica_hash.h"

namespace pcpkv {

void validate_slot_hashes_shape(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                                int64_t num_slots, const uint64_t* hashes, const int64_t* index_slots) {
  validate_cache_format(fmt);
  validate_cache_target(target, fmt, "slot hashes: target");
  PCPKV_CHECK(num_slots >= 0, "slot hashes: num_slots = {} must be >= 0", num_slots);
  PCPKV_CHECK(num_slots == 0 || (slots != nullptr && hashes != nullptr), "slot hashes: slots ({}) or hashes ({}) is null",
              slots ? "set" : "null", hashes ? "set" : "null");
  // The kernel addresses both caches with the MLA cache's block size; one slot for both needs the indexer cache to
  // hold every MLA slot, its own slots (docs/spec.md 4.2) only its own block count.
  PCPKV_CHECK(!fmt.has_indexer || (target.index.block_size == target.mla.block_size &&
                                    (index_slots != nullptr || target.index.num_blocks >= target.mla.num_blocks)),
              "slot hashes: the indexer cache ({} blocks of {}) does not cover the MLA cache ({} blocks of {})",
              target.index.num_blocks, target.index.block_size, target.mla.num_blocks, target.mla.block_size);
}

void validate_hash_slots(const int64_t* slots, int64_t num_slots, int64_t num_cache_slots, const char* field,
                         bool allow_skip) {
  for (int64_t i = 0; i < num_slots; ++i)
    PCPKV_CHECK((slots[i] >= 0 || (allow_skip && slots[i] == -1)) && slots[i] < num_cache_slots,
                "slot hashes: {}[{}] = {} is outside [0, {}) (the cache's slots{})", field, i, slots[i],
                num_cache_slots, allow_skip ? "; -1: none" : "");
}

void slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                           const int64_t* index_slots, int64_t num_slots, uint64_t* hashes) {
  validate_slot_hashes_shape(target, fmt, slots, num_slots, hashes, index_slots);
  const bool own = index_slots != nullptr;
  validate_hash_slots(slots, num_slots, target.mla.num_slots(), "slots", own);
  if (own && fmt.has_indexer)
    validate_hash_slots(index_slots, num_slots, target.index.num_slots(), "index_slots", true);
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
    const int64_t is = own ? index_slots[i] : s;
    // The indexer bytes keep their weights w(row_bytes + j) with or without an MLA row (docs/spec.md 5.2), so the
    // own-slot form with index_slots == slots is the one-slot form bit for bit.
    uint64_t h = s >= 0 ? add(0, target.mla_base + target.mla.row_offset(s), row_bytes, 0) : 0;
    if (fmt.has_indexer && is >= 0) {
      h = add(h, target.index_base + target.index.data_offset(is), kIndexHeadDim, row_bytes);
      h = add(h, target.index_base + target.index.scale_offset(is), 4, row_bytes + kIndexHeadDim);
    }
    hashes[i] = h;
  }
}

void slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, int64_t num_slots,
                           uint64_t* hashes) {
  slot_hashes_reference(target, fmt, slots, nullptr, num_slots, hashes);
}

std::vector<uint64_t> slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt,
                                            const std::vector<int64_t>& slots) {
  return slot_hashes_reference(target, fmt, slots, {});
}

std::vector<uint64_t> slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt,
                                            const std::vector<int64_t>& slots,
                                            const std::vector<int64_t>& index_slots) {
  PCPKV_CHECK(index_slots.empty() || index_slots.size() == slots.size(),
              "slot hashes: index_slots has {} entries, slots {} (one indexer slot per entry, or none)",
              index_slots.size(), slots.size());
  std::vector<uint64_t> h(slots.size());
  slot_hashes_reference(target, fmt, slots.data(), index_slots.empty() ? nullptr : index_slots.data(),
                        static_cast<int64_t>(slots.size()), h.data());
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
