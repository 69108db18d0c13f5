// The run-time replica check (pcpkv/publish/replica_hash.h; docs/spec.md section 5.2): which slots it hashes, the
// Check it reports, the one-process comparison and its switch PCPKV_CHECK_REPLICAS (the one-process-per-rank
// comparison exchanges hashes between ranks: src/publish/drivers/replica_check_across.cpp).
#include <algorithm>
#include <chrono>
#include <string>

#include <fmt/format.h>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/device/replica_hash.h"
#include "pcpkv/publish/replica_hash.h"
#include "publish/checks/replica_check.h"

namespace pcpkv {

std::string replica_rank_name(int32_t q, const std::vector<int32_t>& rank_names) {
  return rank_names.size() > static_cast<size_t>(q) ? fmt::format("{}", rank_names[static_cast<size_t>(q)])
                                                    : fmt::format("{}", q);
}

namespace {

// "rank 7" / "ranks 3, 7" (at most 20 named, then "and N more").
std::string ranks_phrase(const std::vector<int32_t>& ranks, const std::vector<int32_t>& rank_names) {
  std::string list;
  for (size_t k = 0; k < ranks.size() && k < 20; ++k)
    list += (k ? ", " : "") + replica_rank_name(ranks[k], rank_names);
  if (ranks.size() > 20) list += fmt::format(" and {} more", ranks.size() - 20);
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", list);
}

std::string site_text(const ReplicaCheckSite& site) {
  std::string s = fmt::format("layer {}", site.layer_idx);
  if (!site.transport.empty() || !site.iteration.empty()) {
    std::string in = site.transport;
    if (!site.iteration.empty()) in += (in.empty() ? "" : ", ") + site.iteration;
    s += fmt::format(" ({})", in);
  }
  return s;
}

}  // namespace

bool replica_check_from_env() { return read_env_switch("PCPKV_CHECK_REPLICAS"); }

int64_t replica_hash_bytes_per_slot(const CacheFormat& fmt) {
  return mla_row_bytes(fmt.kv_format) + (fmt.has_indexer ? kIndexerSlotBytes : 0);
}

namespace {

// The entries of `mapping` (gathered_slot_mapping or gathered_indexer_slot_mapping) at the gathered rows a
// publication writes: either mapping >= 0 (docs/spec.md 4.2: each mapping's -1 skips its own cache only; a valid
// plan has -1 in both at once).
std::vector<int64_t> at_written_rows(const PcpPlan& plan, const std::vector<int64_t>& mapping) {
  const bool own = plan.has_index_slots();
  PCPKV_CHECK(!own || plan.gathered_indexer_slot_mapping.size() == plan.gathered_slot_mapping.size(),
              "replica check: the plan's gathered_indexer_slot_mapping has {} entries, gathered_slot_mapping {}",
              plan.gathered_indexer_slot_mapping.size(), plan.gathered_slot_mapping.size());
  std::vector<int64_t> s;
  s.reserve(static_cast<size_t>(plan.num_written_slots()));
  for (size_t i = 0; i < plan.gathered_slot_mapping.size(); ++i)
    if (plan.gathered_slot_mapping[i] >= 0 || (own && plan.gathered_indexer_slot_mapping[i] >= 0))
      s.push_back(mapping[i]);
  return s;
}

}  // namespace

std::vector<int64_t> written_slots(const PcpPlan& plan) { return at_written_rows(plan, plan.gathered_slot_mapping); }

std::vector<int64_t> written_index_slots(const PcpPlan& plan) {
  return plan.has_index_slots() ? at_written_rows(plan, plan.gathered_indexer_slot_mapping) : std::vector<int64_t>{};
}

Check replica_hash_check(const std::vector<ReplicaHashDiff>& diffs, const std::vector<int64_t>& slots,
                         int64_t bytes_per_slot, const ReplicaCheckSite& site, const std::vector<int32_t>& rank_names,
                         const std::vector<int64_t>& index_slots) {
  const int64_t W = static_cast<int64_t>(diffs.size());
  const int64_t n = static_cast<int64_t>(slots.size());
  PCPKV_CHECK(index_slots.empty() || index_slots.size() == slots.size(),
              "replica check: index_slots has {} entries, slots {} (one indexer slot per entry, or none)",
              index_slots.size(), slots.size());
  Check c;
  c.name = "replica hashes agree";
  c.transport = site.transport;
  c.num_bytes = W * n * bytes_per_slot;
  std::vector<int32_t> differing, at_first;
  int64_t first = -1;
  for (int32_t q = 1; q < W; ++q) {
    const ReplicaHashDiff& d = diffs[static_cast<size_t>(q)];
    if (d.num_diff == 0) continue;
    PCPKV_CHECK(d.first >= 0 && d.first < n, "replica check: rank {}: first differing index {} is outside [0, {})", q,
                d.first, n);
    c.num_diff += d.num_diff;
    differing.push_back(q);
    if (first < 0 || d.first < first) first = d.first;
  }
  c.pass = differing.empty();
  const std::string where = site_text(site);
  if (c.pass) {
    c.detail = fmt::format("{} replicas x {} written slots ({} B hashed per slot) equal rank {}'s hashes, {}", W, n,
                           bytes_per_slot, replica_rank_name(0, rank_names), where);
    return c;
  }
  // A rank that differs at some slot has its first difference there or earlier; so the ranks differing at the
  // first differing slot are exactly those whose first difference is that slot.
  for (int32_t q : differing)
    if (diffs[static_cast<size_t>(q)].first == first) at_first.push_back(q);
  std::string per_rank;
  for (size_t k = 0; k < differing.size() && k < 20; ++k)
    per_rank += fmt::format("{}{}: {}", k ? ", " : "", replica_rank_name(differing[k], rank_names),
                            diffs[static_cast<size_t>(differing[k])].num_diff);
  if (differing.size() > 20) per_rank += fmt::format(" and {} more ranks", differing.size() - 20);
  std::string others;
  if (at_first.size() != differing.size()) {
    std::vector<int32_t> later;
    for (int32_t q : differing)
      if (std::find(at_first.begin(), at_first.end(), q) == at_first.end()) later.push_back(q);
    others = fmt::format("; {} also differ{} at later slots", ranks_phrase(later, rank_names),
                         later.size() == 1 ? "s" : "");
  }
  // The entry's slot; with the indexer at its own slots (docs/spec.md 4.2) its indexer slot too.
  const size_t f = static_cast<size_t>(first);
  std::string at = fmt::format("slot {}", slots[f]);
  if (!index_slots.empty())
    at = slots[f] < 0          ? fmt::format("indexer slot {} (no MLA row)", index_slots[f])
         : index_slots[f] < 0  ? fmt::format("slot {} (no indexer row)", slots[f])
                               : fmt::format("slot {} (indexer slot {})", slots[f], index_slots[f]);
  c.detail = fmt::format(
      "{}: {} {} from rank {} at {} (the first differing slot of the {} written in this layer; differing slots "
      "per rank: {}){}; replicas diverged",
      where, ranks_phrase(at_first, rank_names), at_first.size() == 1 ? "differs" : "differ",
      replica_rank_name(0, rank_names), at, n, per_rank, others);
  return c;
}

Check check_replica_hashes(const PublishResult& r, const PcpPlan& plan, const CacheFormat& fmt, int32_t layer_idx) {
  const int32_t W = plan.pcp_world;
  PCPKV_CHECK(static_cast<int32_t>(r.mla_alloc.size()) == W &&
                  (!fmt.has_indexer || static_cast<int32_t>(r.index_alloc.size()) == W),
              "replica check: the result holds {} MLA / {} indexer replicas, the plan has {} ranks", r.mla_alloc.size(),
              r.index_alloc.size(), W);
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int64_t> slots = written_slots(plan);
  const std::vector<int64_t> index_slots = written_index_slots(plan);  // empty: one slot addresses both caches
  std::vector<std::vector<uint64_t>> hashes(static_cast<size_t>(W));
  for (int32_t q = 0; q < W; ++q) {
    // The host copies are whole allocations; the caches start at the recorded offsets. Only rows are read.
    const std::vector<uint8_t>& mla = r.mla_alloc[static_cast<size_t>(q)];
    PCPKV_CHECK(r.mla_cache_offset >= 0 &&
                    r.mla_cache_offset + r.mla_geometry.bytes() <= static_cast<int64_t>(mla.size()),
                "replica check: rank {}'s MLA allocation ({} B) is smaller than its cache at offset {} ({} B)", q,
                mla.size(), r.mla_cache_offset, r.mla_geometry.bytes());
    CacheTarget t;
    t.mla_base = const_cast<uint8_t*>(mla.data()) + r.mla_cache_offset;
    t.mla = r.mla_geometry;
    if (fmt.has_indexer) {
      const std::vector<uint8_t>& idx = r.index_alloc[static_cast<size_t>(q)];
      PCPKV_CHECK(r.index_cache_offset >= 0 &&
                      r.index_cache_offset + r.index_geometry.bytes() <= static_cast<int64_t>(idx.size()),
                  "replica check: rank {}'s indexer allocation ({} B) is smaller than its cache at offset {} ({} B)", q,
                  idx.size(), r.index_cache_offset, r.index_geometry.bytes());
      t.index_base = const_cast<uint8_t*>(idx.data()) + r.index_cache_offset;
      t.index = r.index_geometry;
    }
    hashes[static_cast<size_t>(q)] = slot_hashes_reference(t, fmt, slots, index_slots);
  }
  Check c = replica_hash_check(compare_replica_hashes_reference(hashes), slots, replica_hash_bytes_per_slot(fmt),
                               {layer_idx, to_string(r.transport), ""}, {}, index_slots);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (c.pass) c.detail += fmt::format("; {:.1f} ms on the CPU", ms);
  return c;
}

uint64_t replica_hashes_digest(const std::vector<uint64_t>& hashes) {
  uint64_t d = 0;
  for (size_t i = 0; i < hashes.size(); ++i) d += hash::replica_hash_weight(i) * hashes[i];
  return d;
}

}  // namespace pcpkv
