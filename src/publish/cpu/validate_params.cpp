// Parameter checks of the kernel contracts (pcpkv/publish/dispatch.h), shared by the CPU reference and any launcher
// that wants the same messages. Nothing here writes memory.
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <string>

#include "pcpkv/publish/cpu.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/plan.h"

namespace pcpkv {
namespace {

// Slots a target can address: the smaller of its MLA and (indexer layers) indexer caches.
int64_t target_num_slots(const CacheTarget& t, const CacheFormat& fmt) {
  int64_t n = t.mla.num_slots();
  if (fmt.has_indexer) n = std::min(n, t.index.num_slots());
  return n;
}

void check_eps(float eps, const char* name) {
  PCPKV_CHECK(std::isfinite(eps) && eps >= 0.0f, "{} = {} must be finite and >= 0", name, eps);
}

void check_rope_style(RopeStyle s, const char* name) {
  PCPKV_CHECK(s == RopeStyle::kInterleaved || s == RopeStyle::kNeox, "{} = {} is not a RopeStyle", name,
              static_cast<int>(s));
}

}  // namespace

void validate_cache_format(const CacheFormat& fmt) {
  PCPKV_CHECK(fmt.kv_format == KvFormat::kBf16 || fmt.kv_format == KvFormat::kFp8 ||
                  fmt.kv_format == KvFormat::kFp8DsMla,
              "fmt.kv_format = {} is not a KvFormat", static_cast<int>(fmt.kv_format));
  PCPKV_CHECK(fmt.ds_mla_scale == DsMlaScale::kPow2 || fmt.ds_mla_scale == DsMlaScale::kRaw,
              "fmt.ds_mla_scale = {} is not a DsMlaScale", static_cast<int>(fmt.ds_mla_scale));
  // Whatever kv_format (as before): a subnormal scale passed here and made x / k_scale inf.
  if (const auto why = scale_problem(fmt.k_scale)) PCPKV_FAIL("fmt.k_scale = {} {}", fmt.k_scale, *why);
}

void validate_cache_target(const CacheTarget& t, const CacheFormat& fmt, const char* name) {
  PCPKV_CHECK(t.mla_base != nullptr, "{}.mla_base is null", name);
  validate_geometry(t.mla, fmt.kv_format);
  if (fmt.has_indexer) {
    PCPKV_CHECK(t.index_base != nullptr, "{}.index_base is null on a layer with an indexer", name);
    validate_geometry(t.index);
  }
}

void validate_dispatch_shape(const DispatchParams& p) {
  const int64_t T = p.num_tokens;
  PCPKV_CHECK(T >= 0, "dispatch: num_tokens = {} must be >= 0", T);
  validate_cache_format(p.fmt);
  check_rope_style(p.mla_rope, "dispatch: mla_rope");
  check_rope_style(p.index_rope, "dispatch: index_rope");
  // Q norm: all or nothing.
  if (p.q_c_out != nullptr || p.q_c != nullptr) {
    PCPKV_CHECK(T == 0 || (p.q_c != nullptr && p.q_c_out != nullptr), "dispatch: q_c ({}) and q_c_out ({}) go together",
                p.q_c ? "set" : "null", p.q_c_out ? "set" : "null");
    PCPKV_CHECK(p.q_lora_rank >= 8 && p.q_lora_rank <= 4096 && p.q_lora_rank % 8 == 0,
                "dispatch: q_lora_rank = {} must be a multiple of 8 in [8, 4096]", p.q_lora_rank);
    PCPKV_CHECK(p.q_c_stride >= p.q_lora_rank, "dispatch: q_c_stride = {} is smaller than q_lora_rank = {}",
                p.q_c_stride, p.q_lora_rank);
    PCPKV_CHECK(p.q_norm_w != nullptr, "dispatch: q_norm_w is null");
    check_eps(p.q_eps, "dispatch: q_eps");
  }
  PCPKV_CHECK(T == 0 || p.kv != nullptr, "dispatch: kv is null");
  PCPKV_CHECK(p.kv_stride >= kKvLoraRank, "dispatch: kv_stride = {} is smaller than 512", p.kv_stride);
  PCPKV_CHECK(T == 0 || p.k_pe != nullptr, "dispatch: k_pe is null");
  PCPKV_CHECK(p.k_pe_stride >= kRopeDims, "dispatch: k_pe_stride = {} is smaller than 64", p.k_pe_stride);
  PCPKV_CHECK(p.kv_norm_w != nullptr, "dispatch: kv_norm_w is null");
  check_eps(p.kv_eps, "dispatch: kv_eps");
  PCPKV_CHECK(T == 0 || p.positions != nullptr, "dispatch: positions is null");
  PCPKV_CHECK(p.rope_cos_sin != nullptr, "dispatch: rope_cos_sin is null");
  PCPKV_CHECK(p.rope_num_positions >= 1, "dispatch: rope_num_positions = {} must be >= 1", p.rope_num_positions);
  if (p.fmt.has_indexer) {
    PCPKV_CHECK(T == 0 || p.index_k != nullptr, "dispatch: index_k is null but fmt.has_indexer = true");
    PCPKV_CHECK(p.index_k_stride >= kIndexHeadDim, "dispatch: index_k_stride = {} is smaller than 128",
                p.index_k_stride);
    PCPKV_CHECK(p.index_ln_w != nullptr && p.index_ln_b != nullptr, "dispatch: index_ln_w / index_ln_b is null");
    check_eps(p.index_eps, "dispatch: index_eps");
  } else {
    PCPKV_CHECK(p.index_k == nullptr, "dispatch: index_k is set but fmt.has_indexer = false");
    PCPKV_CHECK(p.index_k_out == nullptr, "dispatch: index_k_out is set but fmt.has_indexer = false");
  }
  if (p.topk_fill != nullptr)
    PCPKV_CHECK(p.topk_width >= 1 && p.topk_width <= INT32_MAX,
                "dispatch: topk_width = {} must be in [1, 2^31) when topk_fill is set", p.topk_width);
  PCPKV_CHECK(p.topk_fill_mode == TopkFill::kFull || p.topk_fill_mode == TopkFill::kTail ||
                  p.topk_fill_mode == TopkFill::kNone,
              "dispatch: topk_fill_mode = {} is not a TopkFill", static_cast<int>(p.topk_fill_mode));
  if (p.topk_fill_mode == TopkFill::kTail)
    PCPKV_CHECK(p.topk_indexer_rows >= 0 && p.topk_indexer_rows <= T,
                "dispatch: topk_indexer_rows = {} must be in [0, num_tokens = {}] for topk_fill_mode = tail",
                p.topk_indexer_rows, T);
  PCPKV_CHECK(p.num_targets >= 0, "dispatch: num_targets = {} must be >= 0", p.num_targets);
  if (p.num_targets > 0) {
    PCPKV_CHECK(p.targets != nullptr, "dispatch: targets is null for num_targets = {}", p.num_targets);
    PCPKV_CHECK(T == 0 || p.slot_mapping != nullptr, "dispatch: slot_mapping is null but num_targets = {}",
                p.num_targets);
    for (int32_t d = 0; d < p.num_targets; ++d)
      validate_cache_target(p.targets[d], p.fmt, fmt::format("dispatch: targets[{}]", d).c_str());
  }
  PCPKV_CHECK(p.num_row_dests >= 0, "dispatch: num_row_dests = {} must be >= 0", p.num_row_dests);
  if (p.num_row_dests > 0) {
    PCPKV_CHECK(p.row_dests != nullptr, "dispatch: row_dests is null for num_row_dests = {}", p.num_row_dests);
    for (int32_t d = 0; d < p.num_row_dests; ++d)
      PCPKV_CHECK(p.row_dests[d] != nullptr, "dispatch: row_dests[{}] is null", d);
    const int64_t want = transport_row_layout(p.fmt).row_bytes;
    PCPKV_CHECK(p.row_bytes == want, "dispatch: row_bytes = {} but a {}{} transport row has {} B", p.row_bytes,
                to_string(p.fmt.kv_format), p.fmt.has_indexer ? " + indexer" : "", want);
  }
}

void validate_dispatch(const DispatchParams& p) {
  validate_dispatch_shape(p);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t pos = p.positions[t];
    PCPKV_CHECK(pos >= 0 && pos < p.rope_num_positions, "dispatch: positions[{}] = {} is out of range [0, {})", t,
                pos, p.rope_num_positions);
  }
  if (p.num_targets > 0) {
    int64_t num_slots = target_num_slots(p.targets[0], p.fmt);
    for (int32_t d = 1; d < p.num_targets; ++d) num_slots = std::min(num_slots, target_num_slots(p.targets[d], p.fmt));
    validate_slot_mapping(p.slot_mapping, p.num_tokens, num_slots, "dispatch: slot_mapping");
  }
}

void validate_combine_shape(const CombineParams& p) {
  validate_cache_format(p.fmt);
  PCPKV_CHECK(p.num_src_ranks >= 0, "combine: num_src_ranks = {} must be >= 0", p.num_src_ranks);
  PCPKV_CHECK(p.max_local_tokens >= 0, "combine: max_local_tokens = {} must be >= 0", p.max_local_tokens);
  const int64_t n = int64_t{p.num_src_ranks} * p.max_local_tokens;
  const int64_t want = transport_row_layout(p.fmt).row_bytes;
  PCPKV_CHECK(p.row_bytes == want, "combine: row_bytes = {} but a {}{} transport row has {} B", p.row_bytes,
              to_string(p.fmt.kv_format), p.fmt.has_indexer ? " + indexer" : "", want);
  PCPKV_CHECK(n == 0 || p.rows != nullptr, "combine: rows is null for {} rows", n);
  PCPKV_CHECK(n == 0 || p.slot_mapping != nullptr, "combine: slot_mapping is null for {} rows", n);
  validate_cache_target(p.target, p.fmt, "combine: target");
}

void validate_combine(const CombineParams& p) {
  validate_combine_shape(p);
  validate_slot_mapping(p.slot_mapping, int64_t{p.num_src_ranks} * p.max_local_tokens,
                        target_num_slots(p.target, p.fmt), "combine: slot_mapping");
}

void validate_insert_shape(const InsertParams& p) {
  validate_cache_format(p.fmt);
  const int64_t T = p.num_tokens;
  PCPKV_CHECK(T >= 0, "insert: num_tokens = {} must be >= 0", T);
  if (T > 0) {
    PCPKV_CHECK(p.kv_c != nullptr, "insert: kv_c is null");
    PCPKV_CHECK(p.k_pe != nullptr, "insert: k_pe is null");
    PCPKV_CHECK(p.slot_mapping != nullptr, "insert: slot_mapping is null");
    if (p.fmt.has_indexer) PCPKV_CHECK(p.index_k != nullptr, "insert: index_k is null but fmt.has_indexer = true");
  }
  if (!p.fmt.has_indexer) PCPKV_CHECK(p.index_k == nullptr, "insert: index_k is set but fmt.has_indexer = false");
  validate_cache_target(p.target, p.fmt, "insert: target");
}

void validate_insert(const InsertParams& p) {
  validate_insert_shape(p);
  validate_slot_mapping(p.slot_mapping, p.num_tokens, target_num_slots(p.target, p.fmt), "insert: slot_mapping");
}

}  // namespace pcpkv
