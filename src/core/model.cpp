// Model presets (SPEC section 1) and the HF config.json loader.
#include "pcpkv/model.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "pcpkv/error.h"

namespace pcpkv {
namespace {

using nlohmann::json;

// Built-in values of SPEC section 1; the shipped configs/<name>.json override them when found.
ModelConfig builtin_glm5() {
  ModelConfig m;
  m.name = "glm-5";
  m.model_type = "glm_moe_dsa";
  m.hidden_size = 6144;
  m.num_attention_heads = 64;
  m.q_lora_rank = 2048;
  m.qk_nope_head_dim = 192;
  m.v_head_dim = 256;
  m.index_n_heads = 32;
  m.rms_norm_eps = 1e-5;
  m.max_position_embeddings = 202752;
  m.rope.scaling = RopeScaling::kDefault;
  m.rope.theta = 1e6;
  m.mla_rope_interleave = true;
  m.indexer_rope_interleave = true;
  m.num_hidden_layers = 78;
  m.first_k_dense_replace = 3;
  m.n_group = 1;
  m.topk_group = 1;
  m.routed_scaling_factor = 2.5;
  m.router_logits_fp32 = true;
  return m;
}

ModelConfig builtin_deepseek_v32() {
  ModelConfig m;
  m.name = "deepseek-v3.2";
  m.model_type = "deepseek_v32";
  m.hidden_size = 7168;
  m.num_attention_heads = 128;
  m.q_lora_rank = 1536;
  m.qk_nope_head_dim = 128;
  m.v_head_dim = 128;
  m.index_n_heads = 64;
  m.rms_norm_eps = 1e-6;
  m.max_position_embeddings = 163840;
  m.rope.scaling = RopeScaling::kDeepseekYarn;
  m.rope.theta = 10000.0;
  m.rope.factor = 40.0;
  m.rope.original_max_position_embeddings = 4096;
  m.rope.beta_fast = 32.0;
  m.rope.beta_slow = 1.0;
  m.rope.mscale = 1.0;
  m.rope.mscale_all_dim = 1.0;
  m.mla_rope_interleave = true;
  m.indexer_rope_interleave = false;
  m.num_hidden_layers = 61;
  m.first_k_dense_replace = 3;
  m.n_group = 8;
  m.topk_group = 4;
  m.routed_scaling_factor = 2.5;
  m.router_logits_fp32 = false;
  return m;
}

ModelConfig builtin(const std::string& name) {
  if (name == "glm-5") return builtin_glm5();
  if (name == "deepseek-v3.2") return builtin_deepseek_v32();
  PCPKV_FAIL("--model: unknown model '{}'; known: deepseek-v3.2, glm-5", name);
}

std::string preset_for_model_type(const std::string& t) {
  if (t == "glm_moe_dsa") return "glm-5";
  if (t == "deepseek_v32" || t == "deepseek_v3") return "deepseek-v3.2";
  return {};
}

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

class Reader {
 public:
  Reader(const json& j, std::string origin) : j_(j), origin_(std::move(origin)) {}

  template <typename T>
  bool read(const char* key, T& out, const json* obj = nullptr) {
    const json& o = obj ? *obj : j_;
    if (!o.contains(key) || o.at(key).is_null()) return false;
    const json& v = o.at(key);
    try {
      if constexpr (std::is_same_v<T, bool>) {
        PCPKV_CHECK(v.is_boolean(), "{}: '{}' must be a boolean, got {}", origin_, key, v.dump());
        out = v.get<bool>();
      } else if constexpr (std::is_integral_v<T>) {
        PCPKV_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
                    "{}: '{}' must be an integer, got {}", origin_, key, v.dump());
        out = static_cast<T>(v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>()));
      } else if constexpr (std::is_floating_point_v<T>) {
        PCPKV_CHECK(v.is_number(), "{}: '{}' must be a number, got {}", origin_, key, v.dump());
        out = v.get<double>();
      } else {
        PCPKV_CHECK(v.is_string(), "{}: '{}' must be a string, got {}", origin_, key, v.dump());
        out = v.get<std::string>();
      }
    } catch (const json::exception& e) {
      PCPKV_FAIL("{}: '{}' has an unusable value {}: {}", origin_, key, v.dump(), e.what());
    }
    return true;
  }

 private:
  const json& j_;
  std::string origin_;
};

void apply_rope(const json& j, ModelConfig& m, Reader& r, const std::string& origin, std::set<std::string>& used) {
  r.read("rope_theta", m.rope.theta);
  const json* rs = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    used.insert(key);
    if (j.contains(key) && !j.at(key).is_null()) {
      PCPKV_CHECK(j.at(key).is_object(), "{}: '{}' must be an object, got {}", origin, key, j.at(key).dump());
      rs = &j.at(key);
      break;
    }
  }
  if (!rs) return;
  Reader rr(*rs, origin + ": rope");
  rr.read("rope_theta", m.rope.theta, rs);
  std::string type;
  if (!rr.read("rope_type", type, rs)) rr.read("type", type, rs);
  if (type == "yarn" || type == "deepseek_yarn") {
    m.rope.scaling = RopeScaling::kDeepseekYarn;
  } else if (type.empty() || type == "default") {
    m.rope.scaling = RopeScaling::kDefault;
  } else {
    PCPKV_FAIL("{}: rope type '{}' is not supported; supported: default, yarn (DeepSeek flavour)", origin, type);
  }
  rr.read("factor", m.rope.factor, rs);
  rr.read("original_max_position_embeddings", m.rope.original_max_position_embeddings, rs);
  rr.read("beta_fast", m.rope.beta_fast, rs);
  rr.read("beta_slow", m.rope.beta_slow, rs);
  rr.read("mscale", m.rope.mscale, rs);
  rr.read("mscale_all_dim", m.rope.mscale_all_dim, rs);
}

}  // namespace

std::vector<std::string> preset_names() { return {"deepseek-v3.2", "glm-5"}; }

std::string config_dir() {
  if (const char* env = std::getenv("PCPKV_CONFIG_DIR"); env && *env) return env;
#ifdef PCPKV_CONFIG_DIR
  return PCPKV_CONFIG_DIR;
#else
  return "configs";
#endif
}

ModelConfig preset(const std::string& name) {
  ModelConfig base = builtin(name);  // throws on an unknown name
  const std::string path = config_dir() + "/" + name + ".json";
  std::ifstream f(path);
  if (!f) return base;  // installed without the data files: the built-in values are the same
  std::stringstream ss;
  ss << f.rdbuf();
  ModelConfig m = parse_hf_config(ss.str(), name, nullptr, false, path);
  m.name = name;
  return m;
}

ModelConfig load_hf_config(const std::string& path, const std::string& base_preset, ConfigNotes* notes,
                           bool strict) {
  std::ifstream f(path);
  PCPKV_CHECK(f.good(), "--config: cannot open '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  ModelConfig m = parse_hf_config(ss.str(), base_preset, notes, strict, path);
  m.name = path;
  return m;
}

ModelConfig parse_hf_config(const std::string& json_text, const std::string& base_preset, ConfigNotes* notes,
                            bool strict, const std::string& origin) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    PCPKV_FAIL("{}: not valid JSON: {}", origin, e.what());
  }
  PCPKV_CHECK(j.is_object(), "{}: top level must be a JSON object", origin);

  std::string model_type;
  if (j.contains("model_type") && j["model_type"].is_string()) model_type = j["model_type"].get<std::string>();
  std::string base_name = base_preset;
  if (base_name.empty()) base_name = preset_for_model_type(model_type);
  PCPKV_CHECK(!base_name.empty(),
              "{}: model_type '{}' is not a known DSA model (known: deepseek_v32, glm_moe_dsa); name a base "
              "preset with --model",
              origin, model_type);
  ModelConfig m = builtin(base_name);
  if (!model_type.empty()) m.model_type = model_type;

  Reader r(j, origin);
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
  apply_rope(j, m, r, origin, used);

  for (const char* key : {"indexer_types", "index_topk_pattern"}) {
    used.insert(key);
    if (!j.contains(key) || j[key].is_null()) continue;
    const json& v = j[key];
    std::vector<std::string> types;
    if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        PCPKV_CHECK(v[i].is_string() && (v[i] == "full" || v[i] == "shared"),
                    "{}: {}[{}] must be \"full\" or \"shared\", got {}", origin, key, i, v[i].dump());
        types.push_back(v[i].get<std::string>());
      }
    } else if (v.is_string()) {  // index_topk_pattern: "F"/"S" per layer
      for (size_t i = 0; i < v.get<std::string>().size(); ++i) {
        const char c = v.get<std::string>()[i];
        PCPKV_CHECK(c == 'F' || c == 'S', "{}: {}[{}] must be 'F' or 'S', got '{}'", origin, key, i, c);
        types.push_back(c == 'F' ? "full" : "shared");
      }
    } else {
      PCPKV_FAIL("{}: '{}' must be a list or a string, got {}", origin, key, v.dump());
    }
    if (m.indexer_types.empty()) m.indexer_types = std::move(types);
  }

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (used.count(it.key()) || known_unused_keys().count(it.key())) continue;
    PCPKV_CHECK(!strict, "{}: unknown key '{}' (strict mode)", origin, it.key());
    n.ignored.push_back(it.key());
  }
  m.name = origin;  // messages of validate() name the file, not the base preset
  m.validate();
  return m;
}

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
  PCPKV_CHECK(q_lora_rank > 0 && q_lora_rank % 8 == 0 && q_lora_rank <= 8192,
              "{}: q_lora_rank = {}; must be a positive multiple of 8, at most 8192", o, q_lora_rank);
  PCPKV_CHECK(hidden_size > 0, "{}: hidden_size = {} must be positive", o, hidden_size);
  PCPKV_CHECK(num_attention_heads > 0, "{}: num_attention_heads = {} must be positive", o, num_attention_heads);
  PCPKV_CHECK(qk_nope_head_dim > 0, "{}: qk_nope_head_dim = {} must be positive", o, qk_nope_head_dim);
  PCPKV_CHECK(index_n_heads > 0, "{}: index_n_heads = {} must be positive", o, index_n_heads);
  PCPKV_CHECK(index_topk > 0, "{}: index_topk = {} must be positive", o, index_topk);
  PCPKV_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0 && rms_norm_eps < 1,
              "{}: rms_norm_eps = {} must be in (0, 1)", o, rms_norm_eps);
  PCPKV_CHECK(std::isfinite(index_norm_eps) && index_norm_eps > 0 && index_norm_eps < 1,
              "{}: index_norm_eps = {} must be in (0, 1)", o, index_norm_eps);
  PCPKV_CHECK(std::isfinite(rope.theta) && rope.theta > 1, "{}: rope_theta = {} must be > 1", o, rope.theta);
  if (rope.scaling == RopeScaling::kDeepseekYarn) {
    PCPKV_CHECK(std::isfinite(rope.factor) && rope.factor >= 1, "{}: rope factor = {} must be >= 1", o, rope.factor);
    PCPKV_CHECK(rope.original_max_position_embeddings > 0,
                "{}: original_max_position_embeddings = {} must be positive", o,
                rope.original_max_position_embeddings);
    PCPKV_CHECK(rope.beta_fast > 0 && rope.beta_slow > 0, "{}: beta_fast = {}, beta_slow = {} must be positive",
                o, rope.beta_fast, rope.beta_slow);
  }
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
