// pcpkv/core/model.h: model presets (SPEC section 1) and the HF config.json loader that overrides them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pcpkv {

enum class RopeScaling : uint8_t { kDefault, kDeepseekYarn };

/// Rotary embedding of the 64 rope dims (SPEC section 1).
struct RopeConfig {
  RopeScaling scaling = RopeScaling::kDefault;
  double theta = 10000.0;                    // rope_theta
  // DeepSeek YaRN fields (used when scaling == kDeepseekYarn)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 1.0;
};

/// Largest q_lora_rank pcpkv takes (a multiple of 8): the dispatch's q_c RMSNorm holds one row's partial sums
/// in fixed buffers (the CPU reference's 512 leaves of 8). Config loading and the dispatch check this one bound.
constexpr int64_t kMaxQLoraRank = 4096;

/// Everything pcpkv needs to know about a DSA/MLA model. Field names follow HF config.json keys.
struct ModelConfig {
  std::string name;                 // preset name ("glm-5", "deepseek-v3.2") or config path
  std::string model_type;           // HF model_type ("glm_moe_dsa", "deepseek_v32")
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;          // width of q_c (multiple of 8, <= kMaxQLoraRank)
  int64_t kv_lora_rank = 512;       // width of kv_c; the cache layouts fix it at 512
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 64;    // the layouts fix it at 64
  int64_t v_head_dim = 0;
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 128;     // the layouts fix it at 128
  int64_t index_topk = 2048;
  double rms_norm_eps = 1e-6;       // q_a_layernorm and kv_a_layernorm
  double index_norm_eps = 1e-6;     // indexer k_norm (LayerNorm)
  int64_t max_position_embeddings = 0;
  RopeConfig rope;
  bool mla_rope_interleave = true;      // q_pe / k_pe pairs (2i, 2i+1)
  bool indexer_rope_interleave = false; // false: NeoX half split (i, i+32)
  bool indexer_hadamard = false;        // DeepSeek reference's 128-point Hadamard (vLLM: off)
  int64_t num_hidden_layers = 0;
  int64_t first_k_dense_replace = 0;
  // IndexShare (GLM-5.2, vLLM's schedule): layer l has an indexer iff index_topk_freq <= 1 or
  // max(l - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (freq 4, offset 3: 21 of 78 layers);
  // indexer_types (or index_topk_pattern "F"/"S"), when present, lists per layer "full"/"shared" and wins.
  int64_t index_topk_freq = 1;
  int64_t index_skip_topk_offset = 0;
  std::vector<std::string> indexer_types;
  // MoE router (SPEC section 7)
  int64_t n_routed_experts = 256;
  int64_t num_experts_per_tok = 8;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  bool router_logits_fp32 = false;

  /// Whether layer layer_idx has its own indexer (and writes indexer K). Throws on a bad layer_idx.
  bool layer_has_indexer(int64_t layer_idx) const;
  /// Attention softmax scale: (qk_nope + qk_rope)^-0.5 times YaRN's mscale^2 (SPEC section 1).
  double softmax_scale() const;
  /// Throws pcpkv::Error naming the first field whose value pcpkv cannot serve.
  void validate() const;
};

/// Names of the built-in presets: {"deepseek-v3.2", "glm-5"}.
std::vector<std::string> preset_names();

/// The preset `name`, read from the shipped HF config in configs/<name>.json.
/// Throws pcpkv::Error("unknown model 'x'; known: deepseek-v3.2, glm-5").
ModelConfig preset(const std::string& name);

/// Messages produced while loading a config (missing keys that kept the preset value, ignored keys).
struct ConfigNotes {
  std::vector<std::string> missing;   // "q_lora_rank (kept preset value 2048)"
  std::vector<std::string> ignored;   // keys pcpkv does not use and does not know
  std::vector<std::string> remarks;   // other decisions worth a line, naming file and key
                                      // ("c.json: 'rope_scaling' is null: default RoPE (no scaling), ...")
};

/// Loads a HF config.json. The base preset is chosen by model_type (deepseek_v32 -> deepseek-v3.2,
/// glm_moe_dsa -> glm-5) unless base_preset is non-empty. Every key pcpkv reads overrides the preset;
/// a key with the wrong JSON type or an unusable value throws pcpkv::Error naming key and value (every
/// nlohmann exception included: a number that overflows a double, a syntax error);
/// unknown keys are listed in notes->ignored (strict: they throw instead). "rope_scaling": null (HF's
/// "no scaling") selects the default RoPE and adds a line to notes->remarks. RoPE parameters outside sane
/// ranges (rope_theta in (1, 1e12], YaRN factor [1, 1e4], beta (0, 1e4], mscale and mscale_all_dim
/// [0, 1e3], table magnitude <= 1e4), YaRN beta_fast < beta_slow (an inverted ramp), max_position_embeddings
/// < 1 and num_hidden_layers < 1 throw. Sub-keys of rope_scaling / rope_parameters: each YaRN key the file
/// lacks (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim) adds a
/// remark naming the preset value used (and HF transformers' differing fallback, if any); a key pcpkv does
/// not know adds a remark ("c.json: 'rope_scaling.bogus' ...", strict: throws); a YaRN key under the
/// default type adds a "not used" remark. attention_factor (HF: replaces the mscale ratio as the cos/sin
/// multiplier) throws unless it equals mscale(factor, mscale) / mscale(factor, mscale_all_dim);
/// truncate: false (HF's unfloored ramp ends) throws; rope_type and type that disagree throw.
ModelConfig load_hf_config(const std::string& path, const std::string& base_preset = {},
                           ConfigNotes* notes = nullptr, bool strict = false);

/// Same, from a JSON text (for tests and for engines that hold the config in memory).
ModelConfig parse_hf_config(const std::string& json_text, const std::string& base_preset = {},
                            ConfigNotes* notes = nullptr, bool strict = false,
                            const std::string& origin = "config");

/// Directory holding the shipped configs: PCPKV_CONFIG_DIR when set, else configs/ of the source tree the
/// library was built from, else (an installed library without its source tree) <prefix>/share/pcpkv/configs.
std::string config_dir();

}  // namespace pcpkv
