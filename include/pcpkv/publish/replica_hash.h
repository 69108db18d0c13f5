// pcpkv/publish/replica_hash.h: the run-time replica check (docs/spec.md section 5.2; a debug mode, off by
// default: `--check-replicas` of `pcpkv run` / `pcpkv mp-publish`, PCPKV_CHECK_REPLICAS=1).
//
// After a publication every rank hashes the slots the publication wrote (written_slots: the plan's gathered slot
// mapping without its -1 entries) in its own replica, one uint64 per slot (pcpkv/device/replica_hash.h), and the
// ranks compare their hashes with rank 0's. Where the indexer cache has its own slots (docs/spec.md 4.2) an entry
// is a written row: its MLA row at its MLA slot and its indexer row at its indexer slot (written_index_slots). A
// mismatch is a failed Check (pcpkv/publish/checks.h) naming the layer, the transport, the ranks that differ and
// the first differing slot. Only the written rows are read: guard
// bytes, padding and unwritten slots are not part of any hash (check_guards covers those).
//
// Implementations: the CPU oracles here (host pointers), the CUDA kernels in pcpkv/publish/kernels.h
// (launch_slot_hashes, launch_compare_replica_hashes: the hashes never leave the GPU for the comparison).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/publish/checks.h"

namespace pcpkv {

class Bootstrap;

/// PCPKV_CHECK_REPLICAS (read_env_switch of pcpkv/core/env.h): true for "1", false when unset, empty or "0".
/// Throws pcpkv::Error naming the variable and its value for anything else (a typo must not switch a debug check
/// off silently).
bool replica_check_from_env();

/// Bytes one slot hashes: mla_row_bytes(fmt.kv_format), plus 128 + 4 (indexer data and scale) on an indexer layer.
int64_t replica_hash_bytes_per_slot(const CacheFormat& fmt);

/// The slots a publication of `plan` writes, in the order of plan.gathered_slot_mapping (rank-major local rows),
/// -1 entries dropped: [plan.num_written_slots()] int64. "First differing slot" refers to this order (the same
/// as pcpkv_torch's ReplicaCheck.written_slots). With the plan's own indexer blocks (docs/spec.md 4.2) the rows
/// where either gathered mapping is >= 0 (a valid plan has -1 in both at once), their MLA slots.
std::vector<int64_t> written_slots(const PcpPlan& plan);
/// The indexer slots of written_slots' rows ([written_slots(plan).size()], gathered_indexer_slot_mapping's entries)
/// when the plan gives the indexer cache its own blocks; empty when one slot addresses both caches.
std::vector<int64_t> written_index_slots(const PcpPlan& plan);

/// CPU oracle of cuda::launch_slot_hashes: hashes[i] = the replica hash of slot slots[i] of `target`
/// (docs/spec.md 5.2), for i < num_slots. Host pointers: target's bases, slots [num_slots] int64, hashes
/// [num_slots] uint64. Reads only the hashed bytes of those slots. Throws pcpkv::Error (nothing written) on a bad
/// target (validate_cache_target) or a slot outside [0, target.mla.num_slots()), naming its index and value.
void slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots, int64_t num_slots,
                           uint64_t* hashes);
std::vector<uint64_t> slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt,
                                            const std::vector<int64_t>& slots);
/// The indexer cache at its own slots (docs/spec.md 4.2 and 5.2; CPU oracle of cuda::launch_slot_hashes_own_index):
/// hashes[i] = the hash of entry i, its MLA row at slots[i] (none when -1) then, on an indexer layer, its indexer
/// data and scale at index_slots[i] of target.index (none when -1), with the one-slot form's weights: equal to
/// slot_hashes_reference where index_slots == slots. Only the 132 bytes of a written indexer slot are read, never
/// the padding of a padded block stride. Throws pcpkv::Error naming slots[i] / index_slots[i] outside their cache.
void slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                           const int64_t* index_slots, int64_t num_slots, uint64_t* hashes);
/// index_slots empty: the one-slot form; else of slots' length.
std::vector<uint64_t> slot_hashes_reference(const CacheTarget& target, const CacheFormat& fmt,
                                            const std::vector<int64_t>& slots, const std::vector<int64_t>& index_slots);
/// The checks both slot_hashes_reference and launch_slot_hashes make first, reading no memory behind the pointers:
/// format and target (validate_cache_target), num_slots >= 0, slots and hashes set when num_slots > 0, and an
/// indexer cache (indexer layers) of the MLA cache's block size with at least its blocks (index_slots null: one slot
/// addresses both caches; set: the indexer cache has its own block count). Throws pcpkv::Error.
void validate_slot_hashes_shape(const CacheTarget& target, const CacheFormat& fmt, const int64_t* slots,
                                int64_t num_slots, const uint64_t* hashes, const int64_t* index_slots = nullptr);
/// Every slot of slots [num_slots] (host memory) in [0, num_cache_slots) (or -1 where allow_skip: the own-slot
/// form's "no row in this cache"); throws pcpkv::Error naming `field`, the index and value of the first that is
/// not (what the kernel cannot check, the host checks before a launch).
void validate_hash_slots(const int64_t* slots, int64_t num_slots, int64_t num_cache_slots, const char* field = "slots",
                         bool allow_skip = false);

/// How rank q's hashes differ from rank 0's: how many entries, and the index (into the slot list) of the first
/// (-1: none).
struct ReplicaHashDiff {
  int64_t num_diff = 0;
  int64_t first = -1;
};

/// CPU oracle of cuda::launch_compare_replica_hashes: hashes [W][n] (rank q's hashes of the same n slots)
/// -> [W] diffs against hashes[0] (rank 0's entry is always empty). Throws pcpkv::Error when W == 0 or the rows
/// differ in length.
std::vector<ReplicaHashDiff> compare_replica_hashes_reference(const std::vector<std::vector<uint64_t>>& hashes);

/// Where a check ran: named in its detail ("layer 0 (direct)").
struct ReplicaCheckSite {
  int32_t layer_idx = 0;
  std::string transport;  // "" when not one transport's publication
  std::string iteration;  // e.g. "after 3 graph replays"; "" for none
};

/// The Check "replica hashes agree" from per-rank diffs ([W], compare_replica_hashes_reference or the kernel's),
/// the slots hashed ([n], written_slots) and bytes_per_slot (replica_hash_bytes_per_slot). Passes when no rank
/// differs. Fails with a detail naming the layer, the transport, every rank that differs from rank 0, the first
/// differing slot and the ranks that differ there, and the differing slots per rank:
///   "layer 0 (direct): rank 7 differs from rank 0 at slot 4711 (the first differing slot of the 32772 written
///    in this layer; differing slots per rank: 7: 1); replicas diverged".
/// num_bytes: bytes hashed over every rank (W * n * bytes_per_slot); num_diff: the (rank, slot) pairs whose hashes
/// differ. rank_names[q] names rank q (a group's global ranks, e.g. {2, 3} for the second group of --tp 2 x PCP 2:
/// "rank 3 differs from rank 2"; empty: "rank q", the group's first rank being "rank 0"). index_slots [n]
/// (written_index_slots; empty: one slot addresses both caches) names the entry's indexer slot too:
/// "at slot 4711 (indexer slot 93)".
Check replica_hash_check(const std::vector<ReplicaHashDiff>& diffs, const std::vector<int64_t>& slots,
                         int64_t bytes_per_slot, const ReplicaCheckSite& site,
                         const std::vector<int32_t>& rank_names = {}, const std::vector<int64_t>& index_slots = {});

/// Every replica of a one-process publication (`pcpkv run`: host copies of every rank's allocation), hashed with
/// slot_hashes_reference over written_slots(plan) (and written_index_slots(plan)) and compared. r's transport names
/// the site. Throws pcpkv::Error when r does not hold plan.pcp_world replicas.
Check check_replica_hashes(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt, int32_t layer_idx);

/// Digest of one rank's hashes: sum_i w(i) * hashes[i] mod 2^64 (w of pcpkv/device/replica_hash.h), so a change
/// confined to one byte of one row changes it too (d * w(j) * w(i) is never 0 mod 2^64).
uint64_t replica_hashes_digest(const std::vector<uint64_t>& hashes);

/// One process per rank: collective over `group` (every rank calls it with the hashes of its own replica over the
/// same slots). One small exchange: every rank all-gathers the digests (16 bytes each); only when they differ
/// are the hashes themselves all-gathered to find the differing ranks and slots. Returns the same Check on every
/// rank (replica_hash_check; index_slots as there). Throws pcpkv::Error when the ranks hashed different numbers of
/// slots.
Check check_replica_hashes_across(Bootstrap& group, const std::vector<uint64_t>& mine,
                                  const std::vector<int64_t>& slots, int64_t bytes_per_slot,
                                  const ReplicaCheckSite& site, const std::vector<int32_t>& rank_names = {},
                                  const std::vector<int64_t>& index_slots = {});

}  // namespace pcpkv
