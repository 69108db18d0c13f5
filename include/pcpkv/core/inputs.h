// pcpkv/core/inputs.h: one layer's activations and weights, in global token order, and their per-rank views.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"

namespace pcpkv {

/// Norm weights of one layer, fp32 (bf16 checkpoint values convert exactly).
struct LayerWeights {
  std::vector<float> q_norm_w;    // [q_lora_rank]   q_a_layernorm.weight
  std::vector<float> kv_norm_w;   // [512]           kv_a_layernorm.weight
  std::vector<float> index_ln_w;  // [128]           indexer.k_norm.weight (empty: no indexer)
  std::vector<float> index_ln_b;  // [128]           indexer.k_norm.bias
};

/// Activations of the batch's new tokens in global order (bf16 bit patterns), N = num_tokens.
struct GlobalInputs {
  int64_t num_tokens = 0;          // N
  int64_t q_lora_rank = 0;
  std::vector<uint16_t> q_c;       // [N, q_lora_rank]  q_a_proj output
  std::vector<uint16_t> kv;        // [N, 512]          kv_a_proj_with_mqa output, first 512
  std::vector<uint16_t> k_pe;      // [N, 64]           kv_a_proj_with_mqa output, last 64
  std::vector<uint16_t> index_k;   // [N, 128]          indexer wk output (empty: layer without indexer)
  std::vector<int64_t> positions;  // [N]
  LayerWeights weights;
};

/// Seeded generator with LLM-like statistics: per-token magnitude variation (log-normal), a few outlier
/// channels tens of times larger than the rest, weights near 1 with spread; never all zeros.
/// Positions are the plan's global positions. has_indexer=false leaves index_k and the LN weights empty.
GlobalInputs generate_inputs(const ModelConfig& model, const PcpPlan& plan, bool has_indexer, uint64_t seed);

/// Counts of NaN/inf per tensor; total() == 0 means all finite.
struct NonFiniteReport {
  int64_t q_c = 0, kv = 0, k_pe = 0, index_k = 0, weights = 0;
  int64_t total() const { return q_c + kv + k_pe + index_k + weights; }
  std::string describe() const;  // "kv: 3 non-finite values, index_k: 1 ..."
};
NonFiniteReport count_nonfinite(const GlobalInputs& in);

/// Throws pcpkv::Error naming the tensor and its shape when a size disagrees with model / plan.
void validate_inputs(const GlobalInputs& in, const ModelConfig& model, const PcpPlan& plan, bool has_indexer);

/// Rank r's local tensors [max_local_tokens, ...]: rows gathered by plan.ranks[r].global_index; padding
/// rows hold seeded non-zero junk (engines leave garbage there; slot -1 keeps it out of the caches).
struct RankInputs {
  int64_t num_tokens = 0;           // max_local_tokens
  std::vector<uint16_t> q_c, kv, k_pe, index_k;
  std::vector<int64_t> positions;
  std::vector<int64_t> slot_mapping;
};
RankInputs rank_inputs(const GlobalInputs& in, const PcpPlan& plan, int32_t rank);
/// Same, into *out, reusing its vectors' storage (repeated publications avoid fresh page faults).
void rank_inputs(const GlobalInputs& in, const PcpPlan& plan, int32_t rank, RankInputs* out);

/// safetensors I/O (https://github.com/huggingface/safetensors format: u64 header size, JSON header,
/// data). load_inputs checks every tensor's name, dtype and shape against model/plan and throws
/// pcpkv::Error naming the tensor ("kv: expected BF16 [4096, 512], got F32 [4096, 512]"); a truncated
/// file names the offset. Tensor names: q_c, kv, k_pe, index_k (optional), positions (I64),
/// q_norm_w, kv_norm_w, index_ln_w, index_ln_b (BF16 or F32).
GlobalInputs load_inputs(const std::string& path, const ModelConfig& model, const PcpPlan& plan,
                         bool has_indexer);

}  // namespace pcpkv
