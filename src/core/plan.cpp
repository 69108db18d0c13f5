// PCP batch plan (SPEC section 4): DualChunkSwap split, decode replication or ownership, local order, padding,
// slot mappings.
#include "pcpkv/core/plan.h"

#include <algorithm>
#include <climits>
#include <numeric>
#include <unordered_map>

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {
namespace {

bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::vector<std::pair<int64_t, int64_t>> dual_chunk_swap_chunks(int64_t L, int32_t P, int32_t r) {
  PCPKV_CHECK(P >= 1, "pcp_world = {} must be >= 1", P);
  PCPKV_CHECK(r >= 0 && r < P, "pcp rank {} is out of range [0, {})", r, P);
  PCPKV_CHECK(L >= 0, "prefill length {} must be >= 0", L);
  std::vector<std::pair<int64_t, int64_t>> out;
  if (L == 0) return out;
  const int64_t chunk = ceil_div(L, 2 * int64_t{P});
  for (int64_t idx : {int64_t{r}, int64_t{2 * P - 1 - r}}) {
    const int64_t begin = idx * chunk;
    const int64_t end = std::min((idx + 1) * chunk, L);
    if (begin < end) out.emplace_back(begin, end);
  }
  return out;
}

std::vector<int64_t> dual_chunk_swap_tokens(int64_t L, int32_t P, int32_t r) {
  std::vector<int64_t> out;
  for (const auto& [begin, end] : dual_chunk_swap_chunks(L, P, r))
    for (int64_t t = begin; t < end; ++t) out.push_back(t);
  return out;
}

const char* to_string(LocalOrder o) { return o == LocalOrder::kLocal ? "local" : "request"; }
const char* to_string(DecodeOwnership o) {
  return o == DecodeOwnership::kRoundRobin ? "round_robin" : "replicated";
}

LocalOrder parse_local_order(const std::string& s, const std::string& field) {
  if (s == "request") return LocalOrder::kRequest;
  if (s == "local") return LocalOrder::kLocal;
  PCPKV_FAIL("{}: unknown local order '{}'; expected request or local", field, clip(s));
}

DecodeOwnership parse_decode_ownership(const std::string& s, const std::string& field) {
  if (s == "replicated") return DecodeOwnership::kReplicated;
  if (s == "round_robin") return DecodeOwnership::kRoundRobin;
  PCPKV_FAIL("{}: unknown decode ownership '{}'; expected replicated or round_robin", field, clip(s));
}

int64_t PcpPlan::num_written_slots() const {
  return std::count_if(gathered_slot_mapping.begin(), gathered_slot_mapping.end(), [](int64_t s) { return s >= 0; });
}

PcpPlan make_plan(const PlanConfig& c) {
  // Named as PlanConfig's field (pcpkv_torch.make_plan's argument) and the CLI's flag: both kinds of caller get here.
  PCPKV_CHECK(c.pcp_world >= 1, "pcp_world (--pcp) = {} must be >= 1", c.pcp_world);
  PCPKV_CHECK(c.pcp_world <= 1024, "pcp_world (--pcp) = {} is larger than 1024", c.pcp_world);
  PCPKV_CHECK(is_pow2(c.block_size), "block_size (--block-size) = {} must be a power of two", c.block_size);
  PCPKV_CHECK(!c.requests.empty(), "plan: the batch has no requests");
  PCPKV_CHECK(c.extra_blocks >= 0, "plan: extra_blocks = {} must be >= 0", c.extra_blocks);
  // Block ids are int32 (vLLM block tables) and positions int64: refuse sizes that overflow either.
  constexpr int64_t kMaxTokensPerRequest = int64_t{1} << 40;
  for (size_t i = 0; i < c.requests.size(); ++i) {
    const RequestSpec& q = c.requests[i];
    PCPKV_CHECK(q.context_len >= 0, "requests[{}].context_len = {} must be >= 0", i, q.context_len);
    PCPKV_CHECK(q.context_len <= kMaxTokensPerRequest && q.num_new_tokens <= kMaxTokensPerRequest,
                "requests[{}]: context_len = {} / num_new_tokens = {} exceed 2^40 tokens", i, q.context_len,
                q.num_new_tokens);
    if (q.kind == RequestKind::kDecode)
      PCPKV_CHECK(q.num_new_tokens == 1, "requests[{}]: a decode request must have num_new_tokens = 1, got {}", i,
                  q.num_new_tokens);
    else
      PCPKV_CHECK(q.num_new_tokens >= 1, "requests[{}]: a prefill needs num_new_tokens >= 1, got {}", i,
                  q.num_new_tokens);
  }

  PcpPlan p;
  p.pcp_world = c.pcp_world;
  p.block_size = c.block_size;
  p.reserve_null_block = c.reserve_null_block;
  p.requests = c.requests;
  const int64_t B = c.block_size;

  // Blocks per request cover positions [0, context_len + num_new_tokens); independent of pcp_world, so a
  // PCP-1 plan over the same requests and seed has the same block tables (the single-rank reference).
  std::vector<int64_t> need(c.requests.size());
  int64_t total = 0;
  for (size_t i = 0; i < c.requests.size(); ++i) {
    need[i] = ceil_div(c.requests[i].context_len + c.requests[i].num_new_tokens, B);
    total += need[i];
  }
  const int64_t first = c.reserve_null_block ? 1 : 0;
  PCPKV_CHECK(total + c.extra_blocks + first <= int64_t{INT32_MAX},
              "plan: {} cache blocks needed (block_size {}); block ids are int32, at most {}",
              total + c.extra_blocks + first, c.block_size, INT32_MAX);
  p.num_blocks = first + total + c.extra_blocks;
  std::vector<int32_t> ids(static_cast<size_t>(p.num_blocks - first));
  std::iota(ids.begin(), ids.end(), static_cast<int32_t>(first));
  if (c.shuffle_blocks) {
    uint64_t state = c.seed ^ 0x5bd1e995ull;
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[splitmix64(state) % i]);
  }
  size_t next = 0;
  p.block_tables.resize(c.requests.size());
  for (size_t i = 0; i < c.requests.size(); ++i)
    for (int64_t b = 0; b < need[i]; ++b) p.block_tables[i].push_back(ids[next++]);

  // The indexer cache's own block table (docs/spec.md section 4.2): another permutation, its own size.
  std::vector<std::vector<int32_t>> index_tables;
  if (c.own_index_blocks) {
    PCPKV_CHECK(c.index_extra_blocks >= 0, "plan: index_extra_blocks = {} must be >= 0", c.index_extra_blocks);
    PCPKV_CHECK(total + c.index_extra_blocks + first <= int64_t{INT32_MAX},
                "plan: {} indexer cache blocks needed; block ids are int32, at most {}",
                total + c.index_extra_blocks + first, INT32_MAX);
    p.index_num_blocks = first + total + c.index_extra_blocks;
    std::vector<int32_t> iids(static_cast<size_t>(p.index_num_blocks - first));
    std::iota(iids.begin(), iids.end(), static_cast<int32_t>(first));
    uint64_t state = c.seed ^ 0x2545f4914f6cdd1dull;
    for (size_t i = iids.size(); i > 1; --i) std::swap(iids[i - 1], iids[splitmix64(state) % i]);
    size_t inext = 0;
    index_tables.resize(c.requests.size());
    for (size_t i = 0; i < c.requests.size(); ++i)
      for (int64_t b = 0; b < need[i]; ++b) index_tables[i].push_back(iids[inext++]);
  }

  // Global order: requests in order, each request's new tokens contiguous.
  std::vector<int64_t> request_start(c.requests.size());
  for (size_t i = 0; i < c.requests.size(); ++i) {
    request_start[i] = static_cast<int64_t>(p.global_slots.size());
    const RequestSpec& q = c.requests[i];
    for (int64_t t = 0; t < q.num_new_tokens; ++t) {
      const int64_t pos = q.context_len + t;
      const int64_t block = p.block_tables[i][static_cast<size_t>(pos / B)];
      p.global_positions.push_back(pos);
      p.global_slots.push_back(block * B + pos % B);
      p.global_request.push_back(static_cast<int32_t>(i));
      if (c.own_index_blocks)
        p.global_index_slots.push_back(index_tables[i][static_cast<size_t>(pos / B)] * B + pos % B);
    }
  }

  // Decode owners: rank 0 (replicated) or decode i -> rank i % P (round robin), i counted among decodes.
  p.local_order = c.local_order;
  p.decode_ownership = c.decode_ownership;
  p.decode_owner.assign(c.requests.size(), -1);
  int64_t decode_idx = 0;
  for (size_t i = 0; i < c.requests.size(); ++i) {
    if (c.requests[i].kind != RequestKind::kDecode) continue;
    p.decode_owner[i] = c.decode_ownership == DecodeOwnership::kRoundRobin
                            ? static_cast<int32_t>(decode_idx % c.pcp_world)
                            : 0;
    ++decode_idx;
  }

  // Each rank's segments in request order (SPEC section 4.1): a decode's token (every rank, or its owner only),
  // a prefill's DualChunkSwap tokens of this rank as runs of consecutive offsets.
  struct Segment {
    size_t request;
    int64_t begin, end;  // token offsets within the request
    bool decode;
  };
  p.ranks.resize(static_cast<size_t>(c.pcp_world));
  for (int32_t r = 0; r < c.pcp_world; ++r) {
    std::vector<Segment> segs;
    for (size_t i = 0; i < c.requests.size(); ++i) {
      const RequestSpec& q = c.requests[i];
      if (q.kind == RequestKind::kDecode) {
        if (c.decode_ownership == DecodeOwnership::kReplicated || p.decode_owner[i] == r)
          segs.push_back({i, 0, 1, true});
        continue;
      }
      for (const auto& [begin, end] : dual_chunk_swap_chunks(q.num_new_tokens, c.pcp_world, r)) {
        if (!segs.empty() && segs.back().request == i && segs.back().end == begin)
          segs.back().end = end;  // adjacent chunks (P = 1) are one run
        else
          segs.push_back({i, begin, end, false});
      }
    }
    if (c.local_order == LocalOrder::kLocal) {
      // vLLM's PCPManager moves "pure prefill" segments, those of a prefill starting at position 0, last.
      std::stable_partition(segs.begin(), segs.end(), [&](const Segment& s) {
        return s.decode || c.requests[s.request].context_len + s.begin != 0;
      });
    }
    RankPlan& rp = p.ranks[static_cast<size_t>(r)];
    for (const Segment& s : segs) {
      for (int64_t t = s.begin; t < s.end; ++t) {
        const int64_t g = request_start[s.request] + t;
        rp.global_index.push_back(g);
        rp.positions.push_back(p.global_positions[static_cast<size_t>(g)]);
        const bool writes = !s.decode || p.decode_owner[s.request] == r;
        rp.slot_mapping.push_back(writes ? p.global_slots[static_cast<size_t>(g)] : -1);
        if (c.own_index_blocks)
          rp.indexer_slot_mapping.push_back(writes ? p.global_index_slots[static_cast<size_t>(g)] : -1);
        ++(s.decode ? rp.num_decode_tokens : rp.num_prefill_tokens);
      }
    }
    rp.num_local_tokens = static_cast<int64_t>(rp.global_index.size());
    p.max_local_tokens = std::max(p.max_local_tokens, rp.num_local_tokens);
  }
  for (RankPlan& rp : p.ranks) {
    rp.global_index.resize(static_cast<size_t>(p.max_local_tokens), -1);
    rp.positions.resize(static_cast<size_t>(p.max_local_tokens), 0);
    rp.slot_mapping.resize(static_cast<size_t>(p.max_local_tokens), -1);
    p.gathered_slot_mapping.insert(p.gathered_slot_mapping.end(), rp.slot_mapping.begin(), rp.slot_mapping.end());
    if (!c.own_index_blocks) continue;
    rp.indexer_slot_mapping.resize(static_cast<size_t>(p.max_local_tokens), -1);
    p.gathered_indexer_slot_mapping.insert(p.gathered_indexer_slot_mapping.end(), rp.indexer_slot_mapping.begin(),
                                           rp.indexer_slot_mapping.end());
  }
  validate_plan(p);
  return p;
}

void validate_slot_mapping(const int64_t* slots, int64_t n, int64_t num_slots, const std::string& name,
                           int64_t null_block_size) {
  PCPKV_CHECK(n >= 0, "{}: length {} must be >= 0", name, n);
  PCPKV_CHECK(n == 0 || slots != nullptr, "{}: null pointer for {} entries", name, n);
  // The field without its context ("dispatch: slot_mapping" -> "slot_mapping"), for the earlier entry.
  const size_t colon = name.rfind(": ");
  const std::string field = colon == std::string::npos ? name : name.substr(colon + 2);
  std::unordered_map<int64_t, int64_t> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = slots[i];
    if (s == -1) continue;
    PCPKV_CHECK(s >= 0 && s < num_slots, "{}[{}] = {} is out of range [0, {}) (or -1 to skip)", name, i, s,
                num_slots);
    PCPKV_CHECK(s >= null_block_size, "{}[{}] = {} lies in the null block 0 (slots [0, {})), which is never written",
                name, i, s, null_block_size);
    auto [it, inserted] = seen.emplace(s, i);
    PCPKV_CHECK(inserted, "{}[{}] = {} duplicates {}[{}]", name, i, s, field, it->second);
  }
}

namespace {
// The indexer cache's own slots (docs/spec.md section 4.2): none, or one per local row, -1 exactly where the MLA
// slot is -1, the gathered mapping their rank-major concatenation, every token's indexer slot written once.
void validate_index_slots(const PcpPlan& p, int64_t null_slots) {
  const size_t M = static_cast<size_t>(p.max_local_tokens);
  if (!p.has_index_slots()) {
    PCPKV_CHECK(p.index_num_blocks == 0 && p.gathered_indexer_slot_mapping.empty() && p.global_index_slots.empty(),
                "plan: index_num_blocks = {} with {} gathered indexer slots: both or neither", p.index_num_blocks,
                p.gathered_indexer_slot_mapping.size());
    for (size_t r = 0; r < p.ranks.size(); ++r)
      PCPKV_CHECK(p.ranks[r].indexer_slot_mapping.empty(),
                  "plan: rank {} has an indexer_slot_mapping but the plan has no indexer blocks", r);
    return;
  }
  PCPKV_CHECK(p.global_index_slots.size() == p.global_slots.size(),
              "plan: global_index_slots has {} entries, expected one per token ({})", p.global_index_slots.size(),
              p.global_slots.size());
  PCPKV_CHECK(p.gathered_indexer_slot_mapping.size() == p.gathered_slot_mapping.size(),
              "plan: gathered_indexer_slot_mapping has {} entries, expected pcp_world * max_local_tokens = {}",
              p.gathered_indexer_slot_mapping.size(), p.gathered_slot_mapping.size());
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const RankPlan& rp = p.ranks[r];
    PCPKV_CHECK(rp.indexer_slot_mapping.size() == M, "plan: rank {} indexer_slot_mapping has {} entries, expected {}",
                r,
                rp.indexer_slot_mapping.size(), M);
    for (size_t i = 0; i < M; ++i) {
      const int64_t s = rp.indexer_slot_mapping[i];
      PCPKV_CHECK((s >= 0) == (rp.slot_mapping[i] >= 0) && p.gathered_indexer_slot_mapping[r * M + i] == s,
                  "plan: rank {} indexer_slot_mapping[{}] = {} disagrees with its slot_mapping ({}) or the gathered "
                  "indexer mapping ({})",
                  r, i, s, rp.slot_mapping[i], p.gathered_indexer_slot_mapping[r * M + i]);
      if (s >= 0 && rp.global_index[i] >= 0)
        PCPKV_CHECK(p.global_index_slots[static_cast<size_t>(rp.global_index[i])] == s,
                    "plan: rank {} indexer_slot_mapping[{}] = {} is not its token's indexer slot {}", r, i, s,
                    p.global_index_slots[static_cast<size_t>(rp.global_index[i])]);
    }
  }
  validate_slot_mapping(p.gathered_indexer_slot_mapping.data(),
                        static_cast<int64_t>(p.gathered_indexer_slot_mapping.size()),
                        p.index_num_blocks * p.block_size, "gathered_indexer_slot_mapping", null_slots);
}
}  // namespace

void validate_plan(const PcpPlan& p) {
  PCPKV_CHECK(p.pcp_world >= 1, "plan: pcp_world = {} must be >= 1", p.pcp_world);
  PCPKV_CHECK(is_pow2(p.block_size), "plan: block_size = {} must be a power of two", p.block_size);
  PCPKV_CHECK(static_cast<int64_t>(p.ranks.size()) == p.pcp_world, "plan: {} rank plans for pcp_world = {}",
              p.ranks.size(), p.pcp_world);
  const int64_t N = p.num_global_tokens();
  PCPKV_CHECK(static_cast<int64_t>(p.global_positions.size()) == N &&
                  static_cast<int64_t>(p.global_request.size()) == N,
              "plan: global tensors disagree in length ({} slots, {} positions, {} request ids)", N,
              p.global_positions.size(), p.global_request.size());
  const int64_t null_slots = p.reserve_null_block ? p.block_size : 0;
  validate_slot_mapping(p.global_slots.data(), N, p.num_slots(), "global_slots", null_slots);
  PCPKV_CHECK(static_cast<int64_t>(p.gathered_slot_mapping.size()) == p.pcp_world * p.max_local_tokens,
              "plan: gathered_slot_mapping has {} entries, expected pcp_world * max_local_tokens = {}",
              p.gathered_slot_mapping.size(), p.pcp_world * p.max_local_tokens);
  for (int32_t r = 0; r < p.pcp_world; ++r) {
    const RankPlan& rp = p.ranks[static_cast<size_t>(r)];
    const auto M = static_cast<size_t>(p.max_local_tokens);
    PCPKV_CHECK(rp.positions.size() == M && rp.slot_mapping.size() == M && rp.global_index.size() == M,
                "plan: rank {} vectors are not padded to max_local_tokens = {}", r, M);
    PCPKV_CHECK(rp.num_local_tokens == rp.num_prefill_tokens + rp.num_decode_tokens &&
                    rp.num_local_tokens <= p.max_local_tokens,
                "plan: rank {} counts disagree ({} local, {} prefill, {} decode)", r, rp.num_local_tokens,
                rp.num_prefill_tokens, rp.num_decode_tokens);
    for (size_t i = 0; i < M; ++i) {
      const int64_t g = rp.global_index[i];
      if (static_cast<int64_t>(i) >= rp.num_local_tokens) {
        PCPKV_CHECK(g == -1 && rp.slot_mapping[i] == -1, "plan: rank {} padding row {} has global index {} / slot {}",
                    r, i, g, rp.slot_mapping[i]);
        continue;
      }
      PCPKV_CHECK(g >= 0 && g < N, "plan: rank {} row {} has global index {} outside [0, {})", r, i, g, N);
      PCPKV_CHECK(rp.positions[i] == p.global_positions[static_cast<size_t>(g)],
                  "plan: rank {} row {} position {} != global position {}", r, i, rp.positions[i],
                  p.global_positions[static_cast<size_t>(g)]);
      const int64_t s = rp.slot_mapping[i];
      PCPKV_CHECK(s == -1 || s == p.global_slots[static_cast<size_t>(g)],
                  "plan: rank {} row {} slot {} != global slot {}", r, i, s, p.global_slots[static_cast<size_t>(g)]);
      PCPKV_CHECK(p.gathered_slot_mapping[static_cast<size_t>(r) * M + i] == s,
                  "plan: gathered_slot_mapping[{}] = {} != rank {} slot_mapping[{}] = {}",
                  static_cast<size_t>(r) * M + i, p.gathered_slot_mapping[static_cast<size_t>(r) * M + i], r, i, s);
    }
  }
  // A decode's row has a slot only on its owner (empty decode_owner: a plan built by hand, owners unchecked).
  if (!p.decode_owner.empty()) {
    PCPKV_CHECK(p.decode_owner.size() == p.requests.size(), "plan: decode_owner has {} entries for {} requests",
                p.decode_owner.size(), p.requests.size());
    for (size_t i = 0; i < p.requests.size(); ++i) {
      const bool decode = p.requests[i].kind == RequestKind::kDecode;
      PCPKV_CHECK(decode ? (p.decode_owner[i] >= 0 && p.decode_owner[i] < p.pcp_world) : p.decode_owner[i] == -1,
                  "plan: decode_owner[{}] = {} for a {} (expected {})", i, p.decode_owner[i],
                  decode ? "decode" : "prefill", decode ? fmt::format("a rank in [0, {})", p.pcp_world) : "-1");
    }
    for (int32_t r = 0; r < p.pcp_world; ++r) {
      const RankPlan& rp = p.ranks[static_cast<size_t>(r)];
      for (int64_t i = 0; i < rp.num_local_tokens; ++i) {
        const int32_t q = p.global_request[static_cast<size_t>(rp.global_index[static_cast<size_t>(i)])];
        if (q < 0 || static_cast<size_t>(q) >= p.requests.size() || p.decode_owner[q] < 0) continue;
        PCPKV_CHECK((rp.slot_mapping[static_cast<size_t>(i)] >= 0) == (p.decode_owner[q] == r),
                    "plan: rank {} row {} (decode request {}, owner rank {}) has slot {}", r, i, q, p.decode_owner[q],
                    rp.slot_mapping[static_cast<size_t>(i)]);
      }
    }
  }
  // Every global slot written exactly once over the gathered mapping.
  validate_slot_mapping(p.gathered_slot_mapping.data(), static_cast<int64_t>(p.gathered_slot_mapping.size()),
                        p.num_slots(), "gathered_slot_mapping", null_slots);
  PCPKV_CHECK(p.num_written_slots() == N, "plan: {} slots written over all ranks, expected one per token ({})",
              p.num_written_slots(), N);
  validate_index_slots(p, null_slots);
}

void validate_positions(const PcpPlan& p, int64_t max_position_embeddings, const std::string& origin) {
  PCPKV_CHECK(max_position_embeddings >= 1, "{}: max_position_embeddings = {} must be >= 1", origin,
              max_position_embeddings);
  PCPKV_CHECK(p.global_request.size() == p.global_positions.size(),
              "{}: global_request has {} entries for {} global_positions", origin, p.global_request.size(),
              p.global_positions.size());
  for (size_t g = 0; g < p.global_positions.size(); ++g) {
    if (p.global_positions[g] < max_position_embeddings) continue;
    const int32_t r = p.global_request[g];
    std::string what = "a request not in plan.requests";
    if (r >= 0 && static_cast<size_t>(r) < p.requests.size()) {
      const RequestSpec& q = p.requests[r];
      what = q.kind == RequestKind::kDecode
                 ? fmt::format("decode at position {}", q.context_len)
                 : fmt::format("prefill of {} tokens from position {}", q.num_new_tokens, q.context_len);
    }
    PCPKV_FAIL("{}: request {} ({}) reaches position {}, but the model's max_position_embeddings is "
               "{} (positions must be < {})",
               origin, r, what, p.global_positions[g], max_position_embeddings,
               max_position_embeddings);
  }
}

std::string describe(const PcpPlan& p) {
  std::string s = fmt::format("PCP {} | {} tokens ({} requests) | block_size {} | {} blocks | max_local_tokens {}\n",
                              p.pcp_world, p.num_global_tokens(), p.requests.size(), p.block_size, p.num_blocks,
                              p.max_local_tokens);
  for (int32_t r = 0; r < p.pcp_world; ++r) {
    const RankPlan& rp = p.ranks[static_cast<size_t>(r)];
    s += fmt::format("  rank {}: {} local tokens ({} prefill, {} decode), {} padding\n", r, rp.num_local_tokens,
                     rp.num_prefill_tokens, rp.num_decode_tokens, p.max_local_tokens - rp.num_local_tokens);
  }
  return s;
}

}  // namespace pcpkv
