// Inputs files: load_inputs (inputs.h), read_inputs_batch, apply_slot_mapping (inputs_io.h).
#include "pcpkv/core/inputs_io.h"

#include <algorithm>
#include <charconv>

#include "pcpkv/device/codec.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/safetensors.h"

namespace pcpkv {
namespace {

// A norm weight stored as BF16 (checkpoint dtype, converts exactly) or F32.
std::vector<float> read_weight(const SafetensorsReader& r, const std::string& name, int64_t len) {
  const StTensorInfo& t = r.get(name);
  if (t.dtype == StDtype::kBF16) {
    const auto bits = r.read_as<uint16_t>(name, StDtype::kBF16, {len});
    std::vector<float> out(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) out[i] = codec::bf16_to_float(bits[i]);
    return out;
  }
  PCPKV_CHECK(t.dtype == StDtype::kF32, "{}: tensor '{}' (file offset {}): expected BF16 or F32 [{}], got {} {}",
              r.path(), name, r.data_start() + t.begin, len, to_string(t.dtype), shape_string(t.shape));
  return r.read_as<float>(name, StDtype::kF32, {len});
}

std::string kind_name(RequestKind k) { return k == RequestKind::kPrefill ? "prefill" : "decode"; }

// Levenshtein distance, for "did you mean": names are short (the known ones at most 21 characters).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// Notes for the tensors no reader uses: a misspelled optional tensor ('slot_maping') would otherwise be
// skipped silently and the run would use the plan's slots instead of the file's.
std::vector<std::string> unknown_tensor_notes(const SafetensorsReader& r) {
  constexpr size_t kMaxNotes = 20;
  std::vector<std::string> notes;
  size_t unknown = 0;
  for (const StTensorInfo& t : r.tensors()) {
    const auto& known = inputs_tensor_names();
    if (std::find(known.begin(), known.end(), t.name) != known.end()) continue;
    if (++unknown > kMaxNotes) continue;
    std::string closest;
    size_t best = 3;  // at most 2 edits away
    if (t.name.size() < 64) {
      for (const std::string& k : known) {
        const size_t d = edit_distance(t.name, k);
        if (d < best) best = d, closest = k;
      }
    }
    notes.push_back(fmt::format("tensor '{}' is not read (not a tensor pcpkv knows{})", clip(t.name),
                                closest.empty() ? std::string() : fmt::format("; did you mean '{}'?", closest)));
  }
  if (unknown > kMaxNotes) notes.push_back(fmt::format("{} more tensors are not read", unknown - kMaxNotes));
  return notes;
}

}  // namespace

const std::vector<std::string>& inputs_tensor_names() {
  static const std::vector<std::string> names = {
      "q_c", "kv", "k_pe", "index_k", "positions", "q_norm_w", "kv_norm_w", "index_ln_w", "index_ln_b",
      "requests", "block_tables", "slot_mapping",
      // written by --save, not read back: the caches are recomputed from the activations
      "gathered_slot_mapping", "mla_cache", "index_cache"};
  return names;
}

GlobalInputs load_inputs(const std::string& file, const ModelConfig& model, const PcpPlan& plan, bool has_indexer) {
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  const SafetensorsReader r(file);
  const int64_t n = plan.num_global_tokens();
  const int64_t q = model.q_lora_rank;
  GlobalInputs in;
  in.num_tokens = n;
  in.q_lora_rank = q;
  in.q_c = r.read_as<uint16_t>("q_c", StDtype::kBF16, {n, q});
  in.kv = r.read_as<uint16_t>("kv", StDtype::kBF16, {n, kKvLoraRank});
  in.k_pe = r.read_as<uint16_t>("k_pe", StDtype::kBF16, {n, kRopeDims});
  if (has_indexer) {
    PCPKV_CHECK(r.has("index_k"),
                "{}: tensor 'index_k' is missing, but an indexer layer (--layer indexer) needs it; use --layer "
                "shared for a layer without an indexer",
                path);
    in.index_k = r.read_as<uint16_t>("index_k", StDtype::kBF16, {n, kIndexHeadDim});
  }
  in.positions = r.read_as<int64_t>("positions", StDtype::kI64, {n});
  for (int64_t i = 0; i < n; ++i) {
    PCPKV_CHECK(in.positions[i] == plan.global_positions[i],
                "{}: positions[{}] = {}, but the batch's requests give position {} (request {}, {})", path, i,
                in.positions[i], plan.global_positions[i], plan.global_request[i],
                kind_name(plan.requests[plan.global_request[i]].kind));
  }
  in.weights.q_norm_w = read_weight(r, "q_norm_w", q);
  in.weights.kv_norm_w = read_weight(r, "kv_norm_w", kKvLoraRank);
  if (has_indexer) {
    in.weights.index_ln_w = read_weight(r, "index_ln_w", kIndexHeadDim);
    in.weights.index_ln_b = read_weight(r, "index_ln_b", kIndexHeadDim);
  }
  return in;
}

InputsBatch read_inputs_batch(const std::string& file) {
  const std::string path = clip(file);  // as messages quote it (kMaxQuotedChars)
  const SafetensorsReader r(file);
  InputsBatch b;
  const StTensorInfo& kv = r.get("kv");
  PCPKV_CHECK(kv.shape.size() == 2, "{}: tensor 'kv': expected 2 dimensions [N, 512], got {} {}", path,
              to_string(kv.dtype), shape_string(kv.shape));
  b.num_tokens = kv.shape[0];
  b.has_index_k = r.has("index_k");
  b.notes = unknown_tensor_notes(r);
  auto saved = [&r](const char* key) {
    const auto it = r.metadata().find(key);
    return it == r.metadata().end() ? std::string() : clip(it->second);
  };
  b.saved_kv_format = saved("kv_format");
  b.saved_ds_mla_scale = saved("ds_mla_scale");
  b.saved_k_scale = saved("k_scale");
  b.saved_has_indexer = saved("has_indexer");
  if (const auto it = r.metadata().find("block_size"); it != r.metadata().end()) {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
    if (ec == std::errc() && end == it->second.data() + it->second.size() && v > 0) b.saved_block_size = v;
  }
  if (r.has("requests")) {
    const auto rows = r.read_as<int64_t>("requests", StDtype::kI64, {-1, 3});
    const size_t num_requests = rows.size() / 3;
    PCPKV_CHECK(num_requests >= 1, "{}: tensor 'requests' has no rows", path);
    int64_t total = 0;
    for (size_t i = 0; i < num_requests; ++i) {
      const int64_t kind = rows[3 * i], num_new = rows[3 * i + 1], context = rows[3 * i + 2];
      // Rows are [kind, num_new_tokens, context_len]; the message quotes the row as stored.
      const std::string row = fmt::format("{}: requests[{}] = [{}, {}, {}]", path, i, kind, num_new, context);
      PCPKV_CHECK(kind == 0 || kind == 1, "{}: kind = {}, expected 0 (prefill) or 1 (decode)", row, kind);
      PCPKV_CHECK(num_new >= 1, "{}: num_new_tokens = {} must be >= 1", row, num_new);
      PCPKV_CHECK(kind == 0 || num_new == 1, "{}: a decode request (kind 1) must have num_new_tokens = 1, got {}", row,
                  num_new);
      PCPKV_CHECK(context >= 0, "{}: context_len = {} must be >= 0", row, context);
      // Checked before adding: huge rows must not overflow the running total.
      PCPKV_CHECK(num_new <= b.num_tokens - total,
                  "{}: the rows up to this one add up to more new tokens than the {} rows of tensor 'kv'", row,
                  b.num_tokens);
      b.requests.push_back({kind == 0 ? RequestKind::kPrefill : RequestKind::kDecode, num_new, context});
      total += num_new;
    }
    PCPKV_CHECK(total == b.num_tokens, "{}: tensor 'requests' adds up to {} new tokens, but tensor 'kv' has {} rows",
                path, total, b.num_tokens);
  }
  if (r.has("slot_mapping")) b.slot_mapping = r.read_as<int64_t>("slot_mapping", StDtype::kI64, {b.num_tokens});
  if (r.has("block_tables")) {
    const StTensorInfo& t = r.expect("block_tables", StDtype::kI32, {-1, -1});
    const int64_t rows = t.shape[0], cols = t.shape[1];
    PCPKV_CHECK(b.requests.empty() || rows == static_cast<int64_t>(b.requests.size()),
                "{}: tensor 'block_tables' has {} rows, but tensor 'requests' lists {} requests", path, rows,
                b.requests.size());
    const auto flat = r.read_as<int32_t>("block_tables", StDtype::kI32, {rows, cols});
    b.block_tables.resize(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) {
      b.block_tables[static_cast<size_t>(i)].assign(flat.begin() + i * cols, flat.begin() + (i + 1) * cols);
    }
  }
  return b;
}

namespace {

// Rewrites the plan's slots from `slots` (global order): global_slots, each rank's slot_mapping (rows without a
// slot stay -1: padding, decode copies another rank writes) and the gathered mapping.
void set_slots(PcpPlan& plan, const std::vector<int64_t>& slots) {
  plan.global_slots = slots;
  for (int32_t r = 0; r < plan.pcp_world; ++r) {
    RankPlan& rp = plan.ranks[r];
    for (size_t i = 0; i < rp.slot_mapping.size(); ++i) {
      const int64_t g = rp.global_index[i];
      if (g < 0) continue;  // padding stays -1
      const bool decode_copy = rp.slot_mapping[i] < 0;  // the plan gave this row no slot: another rank writes it
      rp.slot_mapping[i] = decode_copy ? -1 : slots[g];
      plan.gathered_slot_mapping[r * plan.max_local_tokens + static_cast<int64_t>(i)] = rp.slot_mapping[i];
    }
  }
}

// Index of request i's first token in the global order.
std::vector<int64_t> request_starts(const PcpPlan& plan) {
  std::vector<int64_t> start(plan.requests.size(), 0);
  int64_t at = 0;
  for (size_t i = 0; i < plan.requests.size(); ++i) {
    start[i] = at;
    at += plan.requests[i].num_new_tokens;
  }
  return start;
}

int64_t blocks_needed(const RequestSpec& r, int64_t block_size) {
  return (r.context_len + r.num_new_tokens + block_size - 1) / block_size;
}

}  // namespace

void apply_slot_mapping(PcpPlan& plan, const std::vector<int64_t>& slots, const std::string& origin) {
  const int64_t n = plan.num_global_tokens();
  PCPKV_CHECK(static_cast<int64_t>(slots.size()) == n, "{}: slot_mapping has {} entries, the batch has {} tokens",
              origin, slots.size(), n);
  // Every new token of the batch must land somewhere: the plan writes each exactly once.
  for (int64_t i = 0; i < n; ++i) {
    PCPKV_CHECK(slots[i] >= 0, "{}: slot_mapping[{}] = {}: every new token needs a slot (>= 0)", origin, i, slots[i]);
    PCPKV_CHECK(slots[i] < plan.num_slots(),
                "{}: slot_mapping[{}] = {} is out of range [0, {}) (the cache has {} blocks of {} slots)", origin, i,
                slots[i], plan.num_slots(), plan.num_blocks, plan.block_size);
  }
  // The checker names both entries of a duplicate: prefix the origin once, not before each name.
  try {
    validate_slot_mapping(slots.data(), n, plan.num_slots(), "slot_mapping",
                          plan.reserve_null_block ? plan.block_size : 0);
  } catch (const Error& e) {
    throw Error(origin + ": " + e.what(), e.where());
  }

  // The block tables that produce these slots (SPEC 4: slot = block_id * block_size + position % block_size):
  // a block holding a new token is the slot's block; a block holding only context gets the plan's block
  // when no new token claimed it, else the lowest free one. Checked before the plan changes.
  const int64_t B = plan.block_size;
  const std::vector<int64_t> start = request_starts(plan);
  std::vector<std::vector<int32_t>> tables(plan.requests.size());
  std::vector<int64_t> owner(static_cast<size_t>(plan.num_blocks), -1);  // global token that claimed a block
  for (size_t r = 0; r < plan.requests.size(); ++r) {
    tables[r].assign(static_cast<size_t>(blocks_needed(plan.requests[r], B)), -1);
    for (int64_t t = 0; t < plan.requests[r].num_new_tokens; ++t) {
      const int64_t g = start[r] + t;
      const int64_t pos = plan.global_positions[g], s = slots[g];
      PCPKV_CHECK(s % B == pos % B,
                  "{}: slot_mapping[{}] = {} does not follow a block table: token {} (request {}, position {}) "
                  "belongs at offset {} of a block of {} slots (--block-size), the slot is at offset {} (slot = "
                  "block_id * block_size + position % block_size)",
                  origin, g, s, g, r, pos, pos % B, B, s % B);
      int32_t& entry = tables[r][static_cast<size_t>(pos / B)];
      const auto block = static_cast<int32_t>(s / B);
      if (entry < 0) {
        const int64_t other = owner[static_cast<size_t>(block)];
        PCPKV_CHECK(other < 0,
                    "{}: slot_mapping[{}] = {} puts request {}'s position {} in block {}, which slot_mapping[{}] = {} "
                    "already gives to request {} position {}: two logical blocks cannot share a cache block",
                    origin, g, s, r, pos, block, other, slots[other], plan.global_request[other],
                    plan.global_positions[other]);
        entry = block;
        owner[static_cast<size_t>(block)] = g;
      }
      PCPKV_CHECK(entry == block,
                  "{}: slot_mapping[{}] = {} puts request {}'s position {} in block {}, but its earlier tokens put "
                  "positions {}..{} in block {}",
                  origin, g, s, r, pos, block, pos / B * B, pos / B * B + B - 1, entry);
    }
  }
  // Context-only blocks: keep the plan's choice when free, else the lowest free block.
  std::vector<bool> taken(static_cast<size_t>(plan.num_blocks), false);
  for (size_t b = 0; b < owner.size(); ++b) taken[b] = owner[b] >= 0;
  if (plan.reserve_null_block && plan.num_blocks > 0) taken[0] = true;
  std::vector<std::pair<size_t, size_t>> unassigned;
  for (size_t r = 0; r < tables.size(); ++r) {
    for (size_t k = 0; k < tables[r].size(); ++k) {
      if (tables[r][k] >= 0) continue;
      const int32_t mine = k < plan.block_tables[r].size() ? plan.block_tables[r][k] : -1;
      if (mine >= 0 && mine < plan.num_blocks && !taken[static_cast<size_t>(mine)]) {
        tables[r][k] = mine;
        taken[static_cast<size_t>(mine)] = true;
      } else {
        unassigned.emplace_back(r, k);
      }
    }
  }
  size_t next = 0;
  for (const auto& [r, k] : unassigned) {
    while (next < taken.size() && taken[next]) ++next;
    PCPKV_CHECK(next < taken.size(), "{}: the cache has no free block left for request {}'s block {}", origin, r, k);
    tables[r][k] = static_cast<int32_t>(next);
    taken[next] = true;
  }

  plan.block_tables = std::move(tables);
  set_slots(plan, slots);
}

void apply_block_tables(PcpPlan& plan, const std::vector<std::vector<int32_t>>& tables, const std::string& origin) {
  PCPKV_CHECK(tables.size() == plan.requests.size(), "{}: block_tables has {} rows, the batch has {} requests", origin,
              tables.size(), plan.requests.size());
  const int64_t B = plan.block_size;
  const int32_t first = plan.reserve_null_block ? 1 : 0;
  std::vector<std::vector<int32_t>> trimmed(tables.size());
  std::vector<std::pair<int64_t, int64_t>> used(static_cast<size_t>(plan.num_blocks), {-1, -1});  // (row, col)
  for (size_t r = 0; r < tables.size(); ++r) {
    const int64_t need = blocks_needed(plan.requests[r], B);
    const auto& row = tables[r];
    PCPKV_CHECK(static_cast<int64_t>(row.size()) >= need,
                "{}: block_tables[{}] has {} columns, but request {} (context {} + {} new tokens) needs {} "
                "blocks of {} slots (--block-size)",
                origin, r, row.size(), r, plan.requests[r].context_len, plan.requests[r].num_new_tokens, need, B);
    for (size_t k = 0; k < row.size(); ++k) {
      const int32_t id = row[k];
      if (static_cast<int64_t>(k) >= need) {
        PCPKV_CHECK(id == -1,
                    "{}: block_tables[{}][{}] = {}: request {} needs only {} blocks of {} slots (--block-size), so "
                    "the rest of its row must be -1",
                    origin, r, k, id, r, need, B);
        continue;
      }
      PCPKV_CHECK(id >= first && id < plan.num_blocks, "{}: block_tables[{}][{}] = {} is out of range [{}, {}){}",
                  origin, r, k, id, first, plan.num_blocks, first ? " (block 0 is the null block)" : "");
      auto& u = used[static_cast<size_t>(id)];
      PCPKV_CHECK(u.first < 0, "{}: block_tables[{}][{}] = {} duplicates block_tables[{}][{}]", origin, r, k, id,
                  u.first, u.second);
      u = {static_cast<int64_t>(r), static_cast<int64_t>(k)};
    }
    trimmed[r].assign(row.begin(), row.begin() + need);
  }
  std::vector<int64_t> slots(static_cast<size_t>(plan.num_global_tokens()));
  for (int64_t g = 0; g < plan.num_global_tokens(); ++g) {
    const int64_t pos = plan.global_positions[g];
    slots[g] = int64_t{trimmed[plan.global_request[g]][static_cast<size_t>(pos / B)]} * B + pos % B;
  }
  plan.block_tables = std::move(trimmed);
  set_slots(plan, slots);
}

}  // namespace pcpkv
