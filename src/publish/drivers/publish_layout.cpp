// Shared layout and checks of the per-process publication drivers (see publish_layout.h).
#include "publish/drivers/publish_layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "pcpkv/publish/validate.h"
#include "pcpkv/core/error.h"

namespace pcpkv {

void validate_publish_setup(const PublishSetup& s) {
  PCPKV_CHECK(s.model != nullptr, "publish: setup.model is null");
  PCPKV_CHECK(s.plan != nullptr, "publish: setup.plan is null");
  s.model->validate();
  validate_plan(*s.plan);
  validate_cache_format(s.fmt);
  for (size_t g = 0; g < s.plan->global_positions.size(); ++g)
    PCPKV_CHECK(s.plan->global_positions[g] >= 0, "plan: global_positions[{}] = {} must be >= 0", g,
                s.plan->global_positions[g]);
  // The model (and the RoPE table built for it) stops at max_position_embeddings: refuse, do not extrapolate.
  validate_positions(*s.plan, s.model->max_position_embeddings, "publish: plan");
  const AllocationOptions& a = s.alloc;
  PCPKV_CHECK(a.guard_bytes >= 0, "alloc: guard_bytes = {} must be >= 0", a.guard_bytes);
  PCPKV_CHECK(a.base_offset >= 0, "alloc: base_offset = {} must be >= 0", a.base_offset);
  PCPKV_CHECK((a.guard_bytes + a.base_offset) % 16 == 0,
              "alloc: guard_bytes + base_offset = {} must be a multiple of 16 (caches start vector-aligned)",
              a.guard_bytes + a.base_offset);
  PCPKV_CHECK(a.mla_row_pad >= 0, "alloc: mla_row_pad = {} must be >= 0", a.mla_row_pad);
  PCPKV_CHECK(a.mla_block_pad >= 0, "alloc: mla_block_pad = {} must be >= 0", a.mla_block_pad);
  PCPKV_CHECK(a.index_block_pad >= 0, "alloc: index_block_pad = {} must be >= 0", a.index_block_pad);
  PCPKV_CHECK(s.topk_width >= 0, "publish: topk_width = {} must be >= 0", s.topk_width);
  PCPKV_CHECK(s.topk_fill_mode == TopkFill::kFull || s.topk_fill_mode == TopkFill::kTail ||
                  s.topk_fill_mode == TopkFill::kNone,
              "publish: topk_fill_mode = {} is not a TopkFill", static_cast<int>(s.topk_fill_mode));
  PCPKV_CHECK(s.num_ubatches >= 1, "publish: num_ubatches = {} must be >= 1", s.num_ubatches);
  PCPKV_CHECK(s.layer_idx >= 0, "publish: layer_idx = {} must be >= 0", s.layer_idx);
  PCPKV_CHECK(s.repeats >= 1, "publish: repeats = {} must be >= 1", s.repeats);
}

void validate_publish_inputs(const PublishSetup& s, const GlobalInputs& in, Transport transport) {
  PCPKV_CHECK(transport == Transport::kCollect || transport == Transport::kStaging || transport == Transport::kDirect,
              "publish: transport = {} is not a Transport", static_cast<int>(transport));
  validate_inputs(in, *s.model, *s.plan, s.fmt.has_indexer);
}

PublishLayout make_publish_layout(const PublishSetup& s) {
  const PcpPlan& plan = *s.plan;
  const AllocationOptions& a = s.alloc;
  PublishLayout l;
  l.mla.num_blocks = plan.num_blocks;
  l.mla.block_size = plan.block_size;
  l.mla.row_stride = mla_row_bytes(s.fmt.kv_format) + a.mla_row_pad;
  l.mla.block_stride = l.mla.row_stride * plan.block_size + a.mla_block_pad;
  validate_geometry(l.mla, s.fmt.kv_format);
  l.index.num_blocks = plan.indexer_blocks();  // its own block table, or the MLA cache's blocks (spec 4.2)
  l.index.block_size = plan.block_size;
  l.index.block_stride = int64_t{plan.block_size} * kIndexerSlotBytes + a.index_block_pad;
  validate_geometry(l.index);
  l.head = a.guard_bytes + a.base_offset;
  l.mla_alloc_bytes = l.head + l.mla.bytes() + a.guard_bytes;
  l.index_alloc_bytes = l.head + l.index.bytes() + a.guard_bytes;
  l.index_region_offset = (l.mla_alloc_bytes + 255) / 256 * 256;
  l.caches_bytes = l.index_region_offset + l.index_alloc_bytes;
  l.row = transport_row_layout(s.fmt);
  l.staging.num_ubatches = s.num_ubatches;
  l.staging.pcp_world = plan.pcp_world;
  l.staging.max_local_tokens = plan.max_local_tokens;
  l.staging.row_bytes = l.row.row_bytes;
  const int64_t M = plan.max_local_tokens;
  l.collect_kv_offset = 0;
  l.collect_kpe_offset = M * 512 * 2;
  l.collect_index_offset = l.collect_kpe_offset + M * 64 * 2;
  l.collect_bytes = std::max<int64_t>(16, l.collect_index_offset + (s.fmt.has_indexer ? M * 128 * 2 : 0));
  l.fill_topk = s.topk_width > 0 && s.fmt.has_indexer;  // shared layers keep the previous layer's top-k
  for (int64_t p : plan.global_positions) l.max_position = std::max(l.max_position, p);
  return l;
}

DispatchParams base_dispatch_params(const PublishSetup& s, const PublishLayout& l, const DispatchInputs& in) {
  const ModelConfig& model = *s.model;
  DispatchParams d;
  d.num_tokens = s.plan->max_local_tokens;
  d.q_lora_rank = model.q_lora_rank;
  if (s.materialize_q) {
    d.q_c = in.q_c;
    d.q_c_stride = model.q_lora_rank;
    d.q_c_out = in.q_c_out;
  }
  d.kv = in.kv;
  d.k_pe = in.k_pe;
  d.index_k = s.fmt.has_indexer ? in.index_k : nullptr;
  d.positions = in.positions;
  d.q_norm_w = in.q_norm_w;
  d.kv_norm_w = in.kv_norm_w;
  if (s.fmt.has_indexer) {
    d.index_ln_w = in.index_ln_w;
    d.index_ln_b = in.index_ln_b;
  }
  d.rope_cos_sin = in.rope_cos_sin;
  d.rope_num_positions = in.rope_num_positions;
  d.q_eps = static_cast<float>(model.rms_norm_eps);
  d.kv_eps = static_cast<float>(model.rms_norm_eps);
  d.index_eps = static_cast<float>(model.index_norm_eps);
  d.mla_rope = model.mla_rope_interleave ? RopeStyle::kInterleaved : RopeStyle::kNeox;
  d.index_rope = model.indexer_rope_interleave ? RopeStyle::kInterleaved : RopeStyle::kNeox;
  d.index_hadamard = model.indexer_hadamard;
  d.fmt = s.fmt;
  if (l.fill_topk) {
    d.topk_fill = in.topk;
    d.topk_width = s.topk_width;
    d.topk_fill_mode = s.topk_fill_mode;
    d.topk_indexer_rows = in.topk_indexer_rows;
  }
  return d;
}

int64_t topk_first_row(const PublishSetup& s, int32_t rank) {
  const PcpPlan& plan = *s.plan;
  return topk_fill_first_row(s.topk_fill_mode, plan.ranks[static_cast<size_t>(rank)].num_local_tokens,
                             plan.max_local_tokens);
}

std::string describe_rank(int32_t pcp_rank, const std::vector<int32_t>& global_ranks, const std::vector<int64_t>& pids) {
  std::string s = fmt::format("rank {}", pcp_rank);
  const bool has_global = pcp_rank >= 0 && pcp_rank < static_cast<int32_t>(global_ranks.size()) &&
                          global_ranks[static_cast<size_t>(pcp_rank)] != pcp_rank;
  const bool has_pid = pcp_rank >= 0 && pcp_rank < static_cast<int32_t>(pids.size());
  if (has_global && has_pid)
    return fmt::format("{} (global rank {}, pid {})", s, global_ranks[static_cast<size_t>(pcp_rank)],
                       pids[static_cast<size_t>(pcp_rank)]);
  if (has_pid) return fmt::format("{} (pid {})", s, pids[static_cast<size_t>(pcp_rank)]);
  return s;
}

}  // namespace pcpkv
