// pcpkv/core/plan.h: the PCP batch plan (SPEC section 4).
//
// A batch is a list of requests in global order. Prefill requests are split across the PCP world by
// DualChunkSwap (head-tail balance); decode requests are replicated on every rank and only rank 0's copy
// writes KV (or, DecodeOwnership::kRoundRobin, held and written by one owner rank each). A rank's local rows
// follow the request order (or LocalOrder::kLocal, vLLM's). Local buffers are padded to max_local_tokens;
// padded rows have slot -1.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pcpkv {

enum class RequestKind : uint8_t { kPrefill, kDecode };

struct RequestSpec {
  RequestKind kind = RequestKind::kPrefill;
  int64_t num_new_tokens = 0;  // prefill: L >= 1; decode: 1
  int64_t context_len = 0;     // tokens already cached; the first new token has position context_len
};

/// Order of a rank's local rows (SPEC section 4.1). The rows are grouped in segments: a segment is a maximal
/// run of consecutive positions of one request on one rank (a decode's token; a DualChunkSwap chunk).
enum class LocalOrder : uint8_t {
  kRequest,  // segments in request order, a request's segments by position (the default)
  kLocal,    // vLLM's PCPManager: a stable partition of the request order; the segments that start at position
             // 0 (fresh prefills' head chunks) last, every other segment (decodes, continued prefills, the
             // other chunks of fresh prefills) first
};

/// Which rank holds and writes a decode's row (SPEC section 4.1).
enum class DecodeOwnership : uint8_t {
  kReplicated,  // every rank holds every decode; only rank 0's row has a slot (the default)
  kRoundRobin,  // vLLM #52162: decode i (0-based, in request order among the batch's decodes) is held, computed
                // and written by rank i % pcp_world only; the other ranks have no row for it
};

const char* to_string(LocalOrder o);        // "request" | "local"
const char* to_string(DecodeOwnership o);   // "replicated" | "round_robin"
/// Parses "request" | "local". `field` names the flag or argument in the message, e.g. pcpkv::Error("--local-order:
/// unknown local order 'fifo'; expected request or local").
LocalOrder parse_local_order(const std::string& s, const std::string& field = "local_order");
/// Parses "replicated" | "round_robin"; errors as parse_local_order.
DecodeOwnership parse_decode_ownership(const std::string& s, const std::string& field = "decode_ownership");

struct PlanConfig {
  int32_t pcp_world = 1;       // P >= 1
  int32_t pcp_rank_base = 0;   // global rank of PCP rank 0 (for TP x PCP subgroups); informational
  int32_t block_size = 64;     // power of two
  std::vector<RequestSpec> requests;
  int64_t extra_blocks = 0;    // spare blocks beyond those the requests need
  bool reserve_null_block = true;  // block 0 is vLLM's null block: never written
  bool shuffle_blocks = true;      // block ids drawn as a seeded permutation (non-contiguous tables)
  uint64_t seed = 0;
  LocalOrder local_order = LocalOrder::kRequest;
  DecodeOwnership decode_ownership = DecodeOwnership::kReplicated;
  /// The indexer cache gets its own block table (docs/spec.md section 4.2: vLLM's hybrid allocator): its blocks
  /// drawn as another seeded permutation of first + needed + index_extra_blocks blocks, so a token's indexer slot
  /// differs from its MLA slot. false: one slot addresses both caches (the default).
  bool own_index_blocks = false;
  int64_t index_extra_blocks = 0;
};

/// One rank's local view. Every vector has max_local_tokens entries.
struct RankPlan {
  int64_t num_local_tokens = 0;     // real (unpadded) local tokens
  int64_t num_prefill_tokens = 0;
  int64_t num_decode_tokens = 0;
  std::vector<int64_t> positions;      // [max_local_tokens], global positions; 0 for padding
  std::vector<int64_t> slot_mapping;   // [max_local_tokens], -1: padding or a decode copy another rank writes
  std::vector<int64_t> global_index;   // [max_local_tokens], index into the global token order; -1 padding
  /// [max_local_tokens] indexer-cache slots when the plan has its own indexer blocks (-1 where slot_mapping is -1),
  /// else empty: slot_mapping addresses both caches.
  std::vector<int64_t> indexer_slot_mapping;
  /// indexer_slot_mapping's data, or null when slot_mapping addresses both caches
  /// (DispatchParams::indexer_slot_mapping).
  const int64_t* index_slots_or_null() const {
    return indexer_slot_mapping.empty() ? nullptr : indexer_slot_mapping.data();
  }
};

struct PcpPlan {
  int32_t pcp_world = 1;
  int32_t block_size = 0;
  int64_t num_blocks = 0;              // cache blocks, including the null block when reserved
  bool reserve_null_block = true;
  LocalOrder local_order = LocalOrder::kRequest;
  DecodeOwnership decode_ownership = DecodeOwnership::kReplicated;
  std::vector<RequestSpec> requests;
  /// [num_requests] the rank whose row writes each decode (0 when replicated), -1 for a prefill.
  std::vector<int32_t> decode_owner;
  std::vector<std::vector<int32_t>> block_tables;  // [num_requests][blocks of that request]
  // Global token order: requests in order, tokens of one request contiguous.
  std::vector<int64_t> global_positions;  // [num_global_tokens]
  std::vector<int64_t> global_slots;      // [num_global_tokens]
  std::vector<int32_t> global_request;    // [num_global_tokens] request index
  int64_t max_local_tokens = 0;
  std::vector<RankPlan> ranks;            // [pcp_world]
  /// Rank-major concatenation of the local slot mappings: [pcp_world * max_local_tokens]. Row
  /// r * max_local_tokens + i of a staging buffer or an all-gathered tensor lands in this slot.
  std::vector<int64_t> gathered_slot_mapping;
  /// The indexer cache's own blocks (docs/spec.md section 4.2), or 0: the indexer cache has num_blocks blocks and
  /// slot_mapping addresses both caches (the vectors below are then empty).
  int64_t index_num_blocks = 0;
  std::vector<int64_t> global_index_slots;            // [num_global_tokens]
  std::vector<int64_t> gathered_indexer_slot_mapping;  // [pcp_world * max_local_tokens], rank-major like the above

  bool has_index_slots() const { return index_num_blocks > 0; }
  /// Blocks of the indexer cache: index_num_blocks, or num_blocks when one slot addresses both caches.
  int64_t indexer_blocks() const { return has_index_slots() ? index_num_blocks : num_blocks; }
  /// gathered_indexer_slot_mapping's data, or null (CombineParams / InsertParams::indexer_slot_mapping).
  const int64_t* gathered_index_slots_or_null() const {
    return has_index_slots() ? gathered_indexer_slot_mapping.data() : nullptr;
  }
  int64_t num_global_tokens() const { return static_cast<int64_t>(global_slots.size()); }
  int64_t num_slots() const { return num_blocks * block_size; }
  /// Slots written by the batch (each exactly once over the gathered mapping).
  int64_t num_written_slots() const;
};

/// DualChunkSwap chunks of a prefill of length L over P ranks: chunk = ceil(L / (2P)); rank r owns chunks
/// r and 2P-1-r; chunk idx covers [idx*chunk, min((idx+1)*chunk, L)), empty chunks dropped.
/// Returns the token offsets (within the request, in local order) rank r owns.
std::vector<int64_t> dual_chunk_swap_tokens(int64_t L, int32_t P, int32_t r);

/// The same split as half-open offset ranges [begin, end): chunk r, then chunk 2P-1-r, empty ones dropped.
std::vector<std::pair<int64_t, int64_t>> dual_chunk_swap_chunks(int64_t L, int32_t P, int32_t r);

/// Builds and validates the plan. Throws pcpkv::Error naming the field and value (pcp_world < 1,
/// block_size not a power of two, a request with no tokens, a decode with num_new_tokens != 1, ...).
PcpPlan make_plan(const PlanConfig& config);

/// Checks every invariant of a plan (sizes, slots in range and not in the null block, block tables,
/// every global slot written exactly once over the gathered mapping). Throws pcpkv::Error on the first.
void validate_plan(const PcpPlan& plan);

/// Checks a slot mapping against a cache of num_slots slots: every entry -1 or in [0, num_slots),
/// no slot twice, and (when null_block_size > 0) none in [0, null_block_size). `name` is the field name
/// used in the message, e.g. "slot_mapping". Throws pcpkv::Error("slot_mapping[17] = 9000 is out of
/// range [0, 8192)") or ("slot_mapping[5] = 130 duplicates slot_mapping[2]").
void validate_slot_mapping(const int64_t* slots, int64_t n, int64_t num_slots, const std::string& name,
                           int64_t null_block_size = 0);

/// Checks that every token's position is below the model's max_position_embeddings (the model, and the RoPE
/// tables built for it, cover positions [0, max_position_embeddings)). `origin` prefixes the message (e.g.
/// "publish: plan" or the CLI flags that made the batch). Throws pcpkv::Error naming the first request that
/// reaches it, e.g. "plan: request 0 (prefill of 200000 tokens from position 0) reaches position 163840, but
/// the model's max_position_embeddings is 163840 (positions must be < 163840)".
void validate_positions(const PcpPlan& plan, int64_t max_position_embeddings, const std::string& origin = "plan");

/// A short human description: tokens per rank, max_local_tokens, blocks.
std::string describe(const PcpPlan& plan);

}  // namespace pcpkv
