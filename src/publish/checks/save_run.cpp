// `pcpkv run --save`: the inputs, the batch and rank 0's caches of a publication (pcpkv/publish/save_run.h).
#include "pcpkv/publish/save_run.h"

#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/safetensors.h"

namespace pcpkv {

void save_run(const std::string& path, const ModelConfig& model, const PcpPlan& plan, const CacheFormat& fmt,
              const GlobalInputs& in, const PublishResult& result, const SaveInfo& info) {
  PCPKV_CHECK(!result.mla_alloc.empty(), "--save {}: the result holds no replica", clip(path));
  const int64_t n = in.num_tokens;
  const int64_t q = in.q_lora_rank;
  SafetensorsWriter w;
  w.add("q_c", StDtype::kBF16, {n, q}, in.q_c);
  w.add("kv", StDtype::kBF16, {n, kKvLoraRank}, in.kv);
  w.add("k_pe", StDtype::kBF16, {n, kRopeDims}, in.k_pe);
  if (!in.index_k.empty()) w.add("index_k", StDtype::kBF16, {n, kIndexHeadDim}, in.index_k);
  w.add("positions", StDtype::kI64, {n}, in.positions);
  w.add("q_norm_w", StDtype::kF32, {q}, in.weights.q_norm_w);
  w.add("kv_norm_w", StDtype::kF32, {kKvLoraRank}, in.weights.kv_norm_w);
  if (!in.weights.index_ln_w.empty()) {
    w.add("index_ln_w", StDtype::kF32, {kIndexHeadDim}, in.weights.index_ln_w);
    w.add("index_ln_b", StDtype::kF32, {kIndexHeadDim}, in.weights.index_ln_b);
  }

  const auto num_requests = static_cast<int64_t>(plan.requests.size());
  std::vector<int64_t> requests;
  for (const RequestSpec& r : plan.requests) {
    requests.insert(requests.end(), {r.kind == RequestKind::kPrefill ? 0 : 1, r.num_new_tokens, r.context_len});
  }
  w.add("requests", StDtype::kI64, {num_requests, 3}, requests);
  w.add("slot_mapping", StDtype::kI64, {n}, plan.global_slots);
  size_t max_blocks = 0;
  for (const auto& t : plan.block_tables) max_blocks = std::max(max_blocks, t.size());
  std::vector<int32_t> tables(plan.block_tables.size() * max_blocks, -1);
  for (size_t r = 0; r < plan.block_tables.size(); ++r) {
    std::copy(plan.block_tables[r].begin(), plan.block_tables[r].end(), tables.begin() + r * max_blocks);
  }
  w.add("block_tables", StDtype::kI32, {num_requests, static_cast<int64_t>(max_blocks)}, tables);
  w.add("gathered_slot_mapping", StDtype::kI64, {plan.pcp_world, plan.max_local_tokens}, plan.gathered_slot_mapping);

  const MlaCacheGeometry& mg = result.mla_geometry;
  const auto& mla_alloc = result.mla_alloc[0];
  PCPKV_CHECK(
      result.mla_cache_offset >= 0 && result.mla_cache_offset + mg.bytes() <= static_cast<int64_t>(mla_alloc.size()),
      "--save {}: MLA cache [{}, +{}) lies outside its allocation of {} bytes", clip(path), result.mla_cache_offset,
      mg.bytes(), mla_alloc.size());
  const bool dense_rows = mg.block_stride == int64_t{mg.block_size} * mg.row_stride;
  std::vector<int64_t> mla_shape = dense_rows ? std::vector<int64_t>{mg.num_blocks, mg.block_size, mg.row_stride}
                                              : std::vector<int64_t>{mg.num_blocks, mg.block_stride};
  w.add("mla_cache", StDtype::kU8, mla_shape, mla_alloc.data() + result.mla_cache_offset, mg.bytes());
  const IndexerCacheGeometry& ig = result.index_geometry;
  if (fmt.has_indexer) {
    const auto& index_alloc = result.index_alloc.at(0);
    PCPKV_CHECK(result.index_cache_offset >= 0 &&
                    result.index_cache_offset + ig.bytes() <= static_cast<int64_t>(index_alloc.size()),
                "--save {}: indexer cache [{}, +{}) lies outside its allocation of {} bytes", clip(path),
                result.index_cache_offset, ig.bytes(), index_alloc.size());
    w.add("index_cache", StDtype::kU8, {ig.num_blocks, ig.block_stride}, index_alloc.data() + result.index_cache_offset,
          ig.bytes());
  }

  w.set_metadata("format", "pcpkv-run");
  w.set_metadata("model", model.name);
  w.set_metadata("model_type", model.model_type);
  w.set_metadata("kv_format", to_string(fmt.kv_format));
  w.set_metadata("ds_mla_scale", to_string(fmt.ds_mla_scale));
  w.set_metadata("k_scale", fmt::format("{}", fmt.k_scale));
  w.set_metadata("has_indexer", fmt.has_indexer ? "true" : "false");
  w.set_metadata("pcp_world", std::to_string(plan.pcp_world));
  w.set_metadata("block_size", std::to_string(plan.block_size));
  w.set_metadata("num_blocks", std::to_string(plan.num_blocks));
  w.set_metadata("reserve_null_block", plan.reserve_null_block ? "true" : "false");
  w.set_metadata("mla_row_bytes", std::to_string(mla_row_bytes(fmt.kv_format)));
  w.set_metadata("mla_row_stride", std::to_string(mg.row_stride));
  w.set_metadata("mla_block_stride", std::to_string(mg.block_stride));
  if (fmt.has_indexer) w.set_metadata("index_block_stride", std::to_string(ig.block_stride));
  w.set_metadata("caches_of", fmt::format("rank 0, transport {}", info.transport));
  for (const auto& [k, v] : info.metadata) w.set_metadata(k, v);
  w.write(path);
}

}  // namespace pcpkv
