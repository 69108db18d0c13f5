// check_replica_hashes_across (pcpkv/publish/replica_hash.h; docs/spec.md section 5.2): the replica check of one
// process per rank, which exchanges each rank's hashes over the group (a driver: the checks know no ranks).
#include <cstddef>
#include <cstdint>
#include <vector>

#include <fmt/format.h>

#include "pcpkv/core/error.h"
#include "pcpkv/publish/replica_hash.h"
#include "pcpkv/ranks/bootstrap.h"
#include "publish/checks/replica_check.h"

namespace pcpkv {

Check check_replica_hashes_across(Bootstrap& group, const std::vector<uint64_t>& mine,
                                  const std::vector<int64_t>& slots, int64_t bytes_per_slot,
                                  const ReplicaCheckSite& site, const std::vector<int32_t>& rank_names,
                                  const std::vector<int64_t>& index_slots) {
  const int32_t W = group.world_size();
  PCPKV_CHECK(mine.size() == slots.size(), "replica check: {} hashes for {} slots", mine.size(), slots.size());
  const uint64_t summary[2] = {replica_hashes_digest(mine), static_cast<uint64_t>(mine.size())};
  std::vector<uint64_t> all(2 * static_cast<size_t>(W));
  group.all_gather(summary, sizeof(summary), all.data());
  bool same = true;
  for (int32_t q = 0; q < W; ++q) {  // the same message on every rank
    PCPKV_CHECK(all[2 * q + 1] == all[1], "replica check: rank {} hashed {} slots, rank {} {}: the ranks' plans differ",
                replica_rank_name(q, rank_names), all[2 * q + 1], replica_rank_name(0, rank_names), all[1]);
    same = same && all[2 * q] == all[0];
  }
  std::vector<ReplicaHashDiff> diffs(static_cast<size_t>(W));
  if (!same) {  // every rank saw the same digests, so every rank takes this branch
    std::vector<uint64_t> flat(static_cast<size_t>(W) * mine.size());
    group.all_gather(mine.data(), mine.size() * sizeof(uint64_t), flat.data());
    std::vector<std::vector<uint64_t>> hashes(static_cast<size_t>(W));
    for (int32_t q = 0; q < W; ++q)
      hashes[static_cast<size_t>(q)].assign(flat.begin() + static_cast<ptrdiff_t>(q * mine.size()),
                                            flat.begin() + static_cast<ptrdiff_t>((q + 1) * mine.size()));
    diffs = compare_replica_hashes_reference(hashes);
  }
  return replica_hash_check(diffs, slots, bytes_per_slot, site, rank_names, index_slots);
}

}  // namespace pcpkv
