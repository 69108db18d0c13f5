// The HF config.json loader (pcpkv/core/model.h load_hf_config / parse_hf_config): the keys pcpkv reads over the base
// preset, the ones it knows to be harmless, and the notes of what it kept or ignored. Values are read by hf_json.h,
// the RoPE keys by hf_rope.cpp.
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/hf_json.h"
#include "core/hf_rope.h"
#include "core/json_keys.h"
#include "core/model_presets.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/model.h"

namespace pcpkv {
namespace {

using namespace hf_json;

// HF keys pcpkv does not need and knows to be harmless.
const std::set<std::string>& known_unused_keys() {
  static const std::set<std::string> keys = {
      "architectures", "vocab_size", "intermediate_size", "moe_intermediate_size", "num_key_value_heads",
      "n_shared_experts", "torch_dtype", "dtype", "hidden_act", "initializer_range", "use_cache",
      "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_bias",
      "attention_dropout", "transformers_version", "topk_method", "scoring_func", "aux_loss_alpha",
      "seq_aux", "num_nextn_predict_layers", "ep_size", "moe_layer_freq", "auto_map", "quantization_config",
      "mlp_layer_types", "head_dim", "qk_head_dim", "pretraining_tp", "partial_rotary_factor",
      "output_router_logits", "router_aux_loss_coef", "index_share_for_mtp_iteration", "moe_router_dtype",
      "use_qk_norm", "max_window_layers", "sliding_window", "use_sliding_window", "rope_type",
      "num_experts", "model_name", "_name_or_path", "generation_config", "tokenizer_class"};
  return keys;
}

ModelConfig parse_hf_json(const json& j, const std::string& json_text, const std::string& base_preset,
                          ConfigNotes* notes, bool strict, const std::string& origin) {
  PCPKV_CHECK(j.is_object(), "{}: top level must be a JSON object, got {}", origin, j.type_name());
  const JsonPaths paths = scan_json(json_text);

  std::string model_type;
  if (j.contains("model_type")) {
    const json& t = j.at("model_type");
    if (t.is_string()) {
      model_type = t.get<std::string>();
    } else {
      // A number or a list is a broken file; null only says "unknown", which --model can settle.
      PCPKV_CHECK(t.is_null(), "{}: 'model_type' must be a string (deepseek_v32 or glm_moe_dsa), got {}", origin,
                  with_type(as_written(t, &paths, "model_type"), t));
      PCPKV_CHECK(!base_preset.empty(),
                  "{}: 'model_type' is null, so the base preset is unknown; name one with --model (deepseek-v3.2, "
                  "glm-5)",
                  origin);
    }
  }
  std::string base_name = base_preset;
  if (base_name.empty()) {
    PCPKV_CHECK(j.contains("model_type"),
                "{}: 'model_type' is missing, so the base preset is unknown; name one with --model (deepseek-v3.2, "
                "glm-5)",
                origin);
    base_name = preset_for_model_type(model_type);
  }
  PCPKV_CHECK(!base_name.empty(),
              "{}: model_type '{}' is not a known DSA model (known: deepseek_v32, glm_moe_dsa); name a base "
              "preset with --model",
              origin, clip(model_type));
  ModelConfig m = builtin_preset(base_name);
  if (!model_type.empty()) m.model_type = model_type;

  Reader r(j, origin, &paths);
  std::set<std::string> used = {"model_type"};
  ConfigNotes local;
  ConfigNotes& n = notes ? *notes : local;
  auto rd = [&](const char* key, auto& field) {
    used.insert(key);
    // A key pcpkv needs may be absent (the preset value stays) but not null: null means "this model has
    // none", which the cache layouts cannot serve.
    PCPKV_CHECK(!(j.contains(key) && j.at(key).is_null()), "{}: '{}' is null; pcpkv needs a value", origin, key);
    if (!r.read(key, field)) n.missing.push_back(fmt::format("{} (kept preset {} value)", key, base_name));
  };
  rd("hidden_size", m.hidden_size);
  rd("num_attention_heads", m.num_attention_heads);
  rd("q_lora_rank", m.q_lora_rank);
  rd("kv_lora_rank", m.kv_lora_rank);
  rd("qk_nope_head_dim", m.qk_nope_head_dim);
  rd("qk_rope_head_dim", m.qk_rope_head_dim);
  rd("v_head_dim", m.v_head_dim);
  rd("index_n_heads", m.index_n_heads);
  rd("index_head_dim", m.index_head_dim);
  rd("index_topk", m.index_topk);
  rd("rms_norm_eps", m.rms_norm_eps);
  rd("max_position_embeddings", m.max_position_embeddings);
  // Positions past it are a run-time matter (plan checks); 0 or less cannot describe any model.
  PCPKV_CHECK(m.max_position_embeddings >= 1, "{}: 'max_position_embeddings' = {} must be >= 1", origin,
              j.contains("max_position_embeddings")
                  ? as_written(j.at("max_position_embeddings"), &paths, "max_position_embeddings")
                  : std::to_string(m.max_position_embeddings));
  rd("num_hidden_layers", m.num_hidden_layers);
  rd("n_routed_experts", m.n_routed_experts);
  rd("num_experts_per_tok", m.num_experts_per_tok);
  rd("n_group", m.n_group);
  rd("topk_group", m.topk_group);
  rd("routed_scaling_factor", m.routed_scaling_factor);
  // Optional keys: absent in many configs, so no note.
  auto opt = [&](const char* key, auto& field) {
    used.insert(key);
    r.read(key, field);
  };
  opt("first_k_dense_replace", m.first_k_dense_replace);
  opt("norm_topk_prob", m.norm_topk_prob);
  opt("router_logits_fp32", m.router_logits_fp32);
  opt("rope_interleave", m.mla_rope_interleave);
  opt("indexer_rope_interleave", m.indexer_rope_interleave);
  opt("indexer_hadamard", m.indexer_hadamard);
  opt("index_norm_eps", m.index_norm_eps);
  opt("index_topk_freq", m.index_topk_freq);
  opt("index_skip_topk_offset", m.index_skip_topk_offset);
  used.insert("rope_theta");
  apply_rope(j, m, r, origin, used, paths, base_name, n, strict);

  for (const char* key : {"indexer_types", "index_topk_pattern"}) {
    used.insert(key);
    if (!j.contains(key) || j.at(key).is_null()) continue;
    const json& v = j.at(key);
    std::vector<std::string> types;
    if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        PCPKV_CHECK(v[i].is_string() && (v[i] == "full" || v[i] == "shared"),
                    "{}: {}[{}] must be \"full\" or \"shared\", got {}", origin, key, i, clip(v[i].dump()));
        types.push_back(v[i].get<std::string>());
      }
    } else if (v.is_string()) {  // index_topk_pattern: "F"/"S" per layer
      for (size_t i = 0; i < v.get<std::string>().size(); ++i) {
        const char c = v.get<std::string>()[i];
        PCPKV_CHECK(c == 'F' || c == 'S', "{}: {}[{}] must be 'F' or 'S', got '{}'", origin, key, i, c);
        types.push_back(c == 'F' ? "full" : "shared");
      }
    } else {
      PCPKV_FAIL("{}: '{}' must be a list or a string, got {}", origin, key, with_type(clip(v.dump()), v));
    }
    if (m.indexer_types.empty()) m.indexer_types = std::move(types);
  }

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (used.count(it.key()) || known_unused_keys().count(it.key())) continue;
    PCPKV_CHECK(!strict, "{}: unknown key '{}' (strict mode)", origin, clip(it.key()));
    n.ignored.push_back(clip(it.key()));
  }
  m.name = origin;  // messages of validate() name the file, not the base preset
  m.validate();
  return m;
}

}  // namespace

ModelConfig load_hf_config(const std::string& path, const std::string& base_preset, ConfigNotes* notes,
                           bool strict) {
  ModelConfig m =
      parse_hf_config(read_input_file("--config", path, kMaxConfigFileBytes), base_preset, notes, strict, clip(path));
  m.name = path;
  return m;
}

ModelConfig parse_hf_config(const std::string& json_text, const std::string& base_preset, ConfigNotes* notes,
                            bool strict, const std::string& origin) {
  // nlohmann reads a std::string only up to its first NUL: '{...}\0garbage' would pass as '{...}'.
  if (const size_t nul = json_text.find('\0'); nul != std::string::npos)
    PCPKV_FAIL("{}: a NUL byte at offset {}; a config.json is text (a binary or truncated file?)", origin, nul);
  check_json_depth(json_text, origin);  // before any parse: no walk below may recurse past it
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail_unparsable(json_text, origin, e);
  }
  // nlohmann keeps the last of two equal keys: '"q_lora_rank": 2048, "q_lora_rank": 1024' would read 1024 silently.
  if (const auto dup = first_duplicate_key(json_text)) {
    PCPKV_FAIL("{}: the key '{}' appears twice in one object; every key must be unique (which value was meant?)",
               origin, clip(dup->path));
  }
  // Any other nlohmann exception below (a type or range error this code did not foresee) still names the
  // file and reaches the user as bad input, not as an internal error.
  try {
    return parse_hf_json(j, json_text, base_preset, notes, strict, origin);
  } catch (const json::exception& e) {
    PCPKV_FAIL("{}: unusable value: {}", origin, clip(e.what()));
  }
}

}  // namespace pcpkv
