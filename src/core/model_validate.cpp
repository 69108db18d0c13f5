// ModelConfig's rules: validate() (what the cache layouts and kernels can serve) and what its fields imply for a
// layer (layer_has_indexer) and for attention (softmax_scale).
#include <algorithm>
#include <cmath>

#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/rope.h"

namespace pcpkv {

bool ModelConfig::layer_has_indexer(int64_t layer_idx) const {
  PCPKV_CHECK(layer_idx >= 0 && (num_hidden_layers <= 0 || layer_idx < num_hidden_layers),
              "layer: index {} is out of range [0, {})", layer_idx, num_hidden_layers);
  if (!indexer_types.empty()) {
    PCPKV_CHECK(layer_idx < static_cast<int64_t>(indexer_types.size()),
                "layer: index {} has no entry in indexer_types (size {})", layer_idx, indexer_types.size());
    return indexer_types[static_cast<size_t>(layer_idx)] == "full";
  }
  if (index_topk_freq <= 1) return true;
  // vLLM's IndexShare schedule: skip_topk = max(l - offset + 1, 0) % freq != 0.
  const int64_t k = std::max<int64_t>(layer_idx - index_skip_topk_offset + 1, 0);
  return k % index_topk_freq == 0;
}

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_nope_head_dim + qk_rope_head_dim));
  if (rope.scaling == RopeScaling::kDeepseekYarn && rope.mscale_all_dim > 0 && rope.factor > 1) {
    const double m = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

void ModelConfig::validate() const {
  const std::string& o = name.empty() ? model_type : name;
  PCPKV_CHECK(kv_lora_rank == 512, "{}: kv_lora_rank = {}; the MLA cache layouts (SPEC 3) need 512", o, kv_lora_rank);
  PCPKV_CHECK(qk_rope_head_dim == 64, "{}: qk_rope_head_dim = {}; the layouts need 64", o, qk_rope_head_dim);
  PCPKV_CHECK(index_head_dim == 128, "{}: index_head_dim = {}; the indexer-K layout needs 128", o, index_head_dim);
  PCPKV_CHECK(q_lora_rank > 0 && q_lora_rank % 8 == 0 && q_lora_rank <= kMaxQLoraRank,
              "{}: q_lora_rank = {}; must be a multiple of 8 in [8, {}]", o, q_lora_rank, kMaxQLoraRank);
  PCPKV_CHECK(hidden_size > 0, "{}: hidden_size = {} must be positive", o, hidden_size);
  PCPKV_CHECK(num_attention_heads > 0, "{}: num_attention_heads = {} must be positive", o, num_attention_heads);
  PCPKV_CHECK(qk_nope_head_dim > 0, "{}: qk_nope_head_dim = {} must be positive", o, qk_nope_head_dim);
  PCPKV_CHECK(index_n_heads > 0, "{}: index_n_heads = {} must be positive", o, index_n_heads);
  PCPKV_CHECK(index_topk > 0, "{}: index_topk = {} must be positive", o, index_topk);
  PCPKV_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0 && rms_norm_eps < 1,
              "{}: rms_norm_eps = {} must be in (0, 1)", o, rms_norm_eps);
  PCPKV_CHECK(std::isfinite(index_norm_eps) && index_norm_eps > 0 && index_norm_eps < 1,
              "{}: index_norm_eps = {} must be in (0, 1)", o, index_norm_eps);
  validate_rope(rope, o, "rope.");
  PCPKV_CHECK(num_hidden_layers >= 1, "{}: num_hidden_layers = {} must be >= 1", o, num_hidden_layers);
  // One entry per layer (HF's GlmMoeDsa reads indexer_types[layer_idx]), checked here: a shorter list would fail only
  // when a layer past its end is looked up, a longer one never (pcpkv_torch.ModelSpec refuses both).
  PCPKV_CHECK(indexer_types.empty() || static_cast<int64_t>(indexer_types.size()) == num_hidden_layers,
              "{}: indexer_types has {} entries but num_hidden_layers = {}", o, indexer_types.size(),
              num_hidden_layers);
  PCPKV_CHECK(index_topk_freq >= 1, "{}: index_topk_freq = {} must be >= 1", o, index_topk_freq);
  PCPKV_CHECK(index_skip_topk_offset >= 0, "{}: index_skip_topk_offset = {} must be >= 0", o,
              index_skip_topk_offset);
  PCPKV_CHECK(n_group >= 1 && n_routed_experts % n_group == 0,
              "{}: n_group = {} must divide n_routed_experts = {}", o, n_group, n_routed_experts);
  PCPKV_CHECK(topk_group >= 1 && topk_group <= n_group, "{}: topk_group = {} must be in [1, n_group = {}]", o,
              topk_group, n_group);
  PCPKV_CHECK(num_experts_per_tok >= 1 && num_experts_per_tok <= n_routed_experts,
              "{}: num_experts_per_tok = {} must be in [1, n_routed_experts = {}]", o, num_experts_per_tok,
              n_routed_experts);
}

}  // namespace pcpkv
