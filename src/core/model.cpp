// Model presets (SPEC section 1) and the HF config.json loader.
#include "pcpkv/core/model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/rope.h"

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
  PCPKV_FAIL("--model: unknown model '{}'; known: deepseek-v3.2, glm-5", clip(name));
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

// Where each number of a JSON text sits and how it was written: a second, DOM-free pass over the text
// (nlohmann's SAX interface) so messages can quote a value as the file spells it ("1e30", not "1e+30")
// and name the key at which parsing failed (number overflow, a syntax error).
class JsonPaths final : public nlohmann::json_sax<json> {
 public:
  std::map<std::string, std::string> raw_numbers;  // "rope_scaling.factor" -> "40"
  std::string error_path;                          // key path where the parse failed ("" = top level)
  std::string error_token;                         // the token at the failure

  bool null() override { return value_done(); }
  bool boolean(bool) override { return value_done(); }
  bool number_integer(number_integer_t v) override { return number(std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) override { return number(std::to_string(v)); }
  bool number_float(number_float_t, const string_t& s) override { return number(s); }
  bool string(string_t&) override { return value_done(); }
  bool binary(binary_t&) override { return value_done(); }
  bool start_object(std::size_t) override {
    stack_.push_back({true, {}, 0});
    return true;
  }
  bool key(string_t& k) override {
    stack_.back().key = k;
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return value_done();
  }
  bool start_array(std::size_t) override {
    stack_.push_back({false, {}, 0});
    return true;
  }
  bool end_array() override {
    stack_.pop_back();
    return value_done();
  }
  bool parse_error(std::size_t, const std::string& token, const nlohmann::detail::exception&) override {
    error_path = path();
    error_token = token;
    return false;
  }

  /// "rope_scaling.factor", "indexer_types[3]"; "" at the top level.
  std::string path() const {
    std::string p;
    for (const Level& l : stack_) {
      if (l.object) {
        if (!l.key.empty()) p += (p.empty() ? "" : ".") + l.key;
      } else {
        p += fmt::format("[{}]", l.index);
      }
    }
    return p;
  }

 private:
  struct Level {
    bool object;
    std::string key;
    size_t index;
  };
  bool number(const std::string& text) {
    raw_numbers[path()] = text;
    return value_done();
  }
  bool value_done() {
    if (!stack_.empty() && !stack_.back().object) ++stack_.back().index;
    return true;
  }
  std::vector<Level> stack_;
};

JsonPaths scan_json(const std::string& text) {
  JsonPaths paths;
  json::sax_parse(text, &paths, json::input_format_t::json, /*strict=*/true);  // reports through parse_error
  return paths;
}

// How a value is written in the file: numbers as the text spells them, the rest as JSON.
std::string as_written(const json& v, const JsonPaths* paths, const std::string& path) {
  if (v.is_number() && paths) {
    const auto it = paths->raw_numbers.find(path);
    if (it != paths->raw_numbers.end()) return clip(it->second);
  }
  return clip(v.dump());
}

// "5 (a number)", "null", "\"x\" (a string)".
std::string with_type(const std::string& written, const json& v) {
  if (v.is_null()) return "null";
  const std::string t = v.type_name();
  const bool vowel = t[0] == 'a' || t[0] == 'o';
  return fmt::format("{} ({} {})", written, vowel ? "an" : "a", t);  // callers clip `written`
}

class Reader {
 public:
  // prefix: the key path of the object read ("" top level, "rope_scaling"); origin names it in messages.
  Reader(const json& j, std::string origin, const JsonPaths* paths = nullptr, std::string prefix = {})
      : j_(j), origin_(std::move(origin)), paths_(paths), prefix_(std::move(prefix)) {}

  template <typename T>
  bool read(const char* key, T& out, const json* obj = nullptr) {
    const json& o = obj ? *obj : j_;
    if (!o.contains(key) || o.at(key).is_null()) return false;
    const json& v = o.at(key);
    const std::string written = as_written(v, paths_, prefix_.empty() ? key : prefix_ + "." + key);
    try {
      if constexpr (std::is_same_v<T, bool>) {
        PCPKV_CHECK(v.is_boolean(), "{}: '{}' must be a boolean, got {}", origin_, key, with_type(written, v));
        out = v.get<bool>();
      } else if constexpr (std::is_integral_v<T>) {
        // The range is checked before any conversion: 1e30 or 2^64 - 2048 must not wrap into a small or
        // negative value that passes the later checks.
        constexpr auto lo = std::numeric_limits<T>::min();
        constexpr auto hi = std::numeric_limits<T>::max();
        PCPKV_CHECK(v.is_number(), "{}: '{}' must be an integer, got {}", origin_, key, with_type(written, v));
        // long double holds every int64 and uint64 exactly (64-bit mantissa), and any double.
        long double value = 0;
        if (v.is_number_unsigned()) {
          value = static_cast<long double>(v.get<uint64_t>());
        } else if (v.is_number_integer()) {
          value = static_cast<long double>(v.get<int64_t>());
        } else {
          const double d = v.get<double>();
          PCPKV_CHECK(std::isfinite(d) && std::floor(d) == d, "{}: '{}' must be an integer, got {}", origin_, key,
                      written);
          value = d;
        }
        const bool in_range = value >= static_cast<long double>(lo) && value <= static_cast<long double>(hi);
        PCPKV_CHECK(in_range, "{}: '{}' = {} is out of range [{}, {}]", origin_, key, written, lo, hi);
        out = static_cast<T>(value);
      } else if constexpr (std::is_floating_point_v<T>) {
        PCPKV_CHECK(v.is_number(), "{}: '{}' must be a number, got {}", origin_, key, with_type(written, v));
        out = v.get<double>();
      } else {
        PCPKV_CHECK(v.is_string(), "{}: '{}' must be a string, got {}", origin_, key, with_type(written, v));
        out = v.get<std::string>();
      }
    } catch (const json::exception& e) {
      PCPKV_FAIL("{}: '{}' has an unusable value {}: {}", origin_, key, written, clip(e.what()));
    }
    return true;
  }

 private:
  const json& j_;
  std::string origin_;
  const JsonPaths* paths_;
  std::string prefix_;
};

// Sub-keys of rope_scaling / rope_parameters pcpkv reads for DeepSeek YaRN (SPEC section 1).
constexpr const char* kYarnKeys[] = {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                     "original_max_position_embeddings"};

// Where a missing YaRN sub-key's value comes from, and what HF transformers' _compute_yarn_parameters
// would use instead when that differs: the user's engine may be HF, so the difference is worth a line.
std::string yarn_fallback(const std::string& key, const ModelConfig& m, bool preset_had_yarn,
                          const std::string& base_name, const std::set<std::string>& present) {
  const RopeConfig& r = m.rope;
  std::string value;
  if (key == "factor") value = fmt::format("{}", r.factor);
  if (key == "beta_fast") value = fmt::format("{}", r.beta_fast);
  if (key == "beta_slow") value = fmt::format("{}", r.beta_slow);
  if (key == "mscale") value = fmt::format("{}", r.mscale);
  if (key == "mscale_all_dim") value = fmt::format("{}", r.mscale_all_dim);
  if (key == "original_max_position_embeddings") value = fmt::format("{}", r.original_max_position_embeddings);
  std::string s = fmt::format("using {} from the {} preset{}", value, base_name,
                              preset_had_yarn ? "" : " (it has no YaRN: pcpkv's built-in default)");
  if (key == "original_max_position_embeddings" && r.original_max_position_embeddings != m.max_position_embeddings) {
    s += fmt::format("; HF transformers would use max_position_embeddings ({})", m.max_position_embeddings);
  } else if ((key == "mscale" || key == "mscale_all_dim") && r.factor > 1) {
    // HF: `if mscale and mscale_all_dim: ratio, else get_mscale(factor)`; say it once, on mscale.
    const bool other_present = present.count(key == "mscale" ? "mscale_all_dim" : "mscale") > 0;
    if (key == "mscale" || other_present) {
      s += fmt::format("; HF transformers, lacking mscale or mscale_all_dim, would scale cos/sin by "
                       "0.1 * ln(factor) + 1 = {}",
                       0.1 * std::log(r.factor) + 1.0);
    }
  } else if (key == "factor") {
    s += "; HF transformers requires factor for YaRN";
  }
  return s;
}

void apply_rope(const json& j, ModelConfig& m, Reader& r, const std::string& origin, std::set<std::string>& used,
                const JsonPaths& paths, const std::string& base_name, ConfigNotes& notes, bool strict) {
  // No theta at the top level nor in rope_scaling / rope_parameters: the preset's stays, said like any other missing
  // key (SPEC section 1 reads theta from the config; HF transformers would take its config class's default instead).
  const auto given = [](const json& o, const char* key) { return o.contains(key) && !o.at(key).is_null(); };
  const auto nested = [&](const char* key) {
    return given(j, key) && j.at(key).is_object() && given(j.at(key), "rope_theta");
  };
  if (!given(j, "rope_theta") && !nested("rope_scaling") && !nested("rope_parameters"))
    notes.missing.push_back(fmt::format("rope_theta (kept preset {} value {})", base_name, m.rope.theta));
  r.read("rope_theta", m.rope.theta);
  const json* rs = nullptr;
  const char* rs_key = nullptr;
  const char* null_key = nullptr;  // a scaling key present as null or {}: HF's "no scaling"
  const char* null_what = "null";
  // HF transformers 5 (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict): rope_parameters = rope_scaling or
  // rope_parameters, so a null or empty rope_scaling ({}) gives way to rope_parameters.
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    used.insert(key);
    if (!j.contains(key)) continue;
    if (j.at(key).is_null() || (j.at(key).is_object() && j.at(key).empty())) {
      if (!null_key) {
        null_key = key;
        null_what = j.at(key).is_null() ? "null" : "empty";
      }
      continue;
    }
    PCPKV_CHECK(j.at(key).is_object(), "{}: '{}' must be an object, got {}", origin, key,
                with_type(clip(j.at(key).dump()), j.at(key)));
    rs = &j.at(key);
    rs_key = key;
    break;
  }
  if (!rs) {
    if (null_key) {
      // HF configs write "rope_scaling": null for a model without RoPE scaling; keeping the preset's YaRN
      // would publish other k_pe bytes than the model computes.
      const bool was_yarn = m.rope.scaling == RopeScaling::kDeepseekYarn;
      m.rope.scaling = RopeScaling::kDefault;
      notes.remarks.push_back(fmt::format(
          "{}: '{}' is {}: default RoPE (no scaling){}", origin, null_key, null_what,
          was_yarn ? fmt::format(", replacing the {} preset's YaRN", base_name) : std::string()));
    }
    return;
  }
  const std::string pre = std::string(rs_key) + ".";  // "rope_scaling."
  const auto full = [&](const std::string& key) { return pre + clip(key); };
  // Present and not null: a null sub-key counts as absent, as HF's `.get(key) or default` does.
  std::set<std::string> present;
  for (auto it = rs->begin(); it != rs->end(); ++it) {
    if (!it.value().is_null()) present.insert(it.key());
  }

  Reader rr(*rs, fmt::format("{}: {}", origin, rs_key), &paths, rs_key);
  const double top_theta = m.rope.theta;
  if (rr.read("rope_theta", m.rope.theta, rs) && given(j, "rope_theta") && m.rope.theta != top_theta) {
    // HF transformers 5 reads the theta of rope_parameters too; the top-level key is then dead text.
    notes.remarks.push_back(fmt::format("{}: top-level 'rope_theta' = {} is shadowed by '{}' = {}: using {}", origin,
                                        as_written(j.at("rope_theta"), &paths, "rope_theta"), full("rope_theta"),
                                        as_written(rs->at("rope_theta"), &paths, full("rope_theta")),
                                        as_written(rs->at("rope_theta"), &paths, full("rope_theta"))));
  }
  std::string type, type_alias;
  rr.read("rope_type", type, rs);
  rr.read("type", type_alias, rs);
  // HF writes both for older configs (it copies type into rope_type); two different ones are a broken file.
  PCPKV_CHECK(type.empty() || type_alias.empty() || type == type_alias,
              "{}: '{}' = \"{}\" and '{}' = \"{}\" disagree", origin, full("rope_type"), clip(type),
              full("type"), clip(type_alias));
  if (type.empty()) type = type_alias;
  const bool preset_had_yarn = m.rope.scaling == RopeScaling::kDeepseekYarn;
  if (type == "yarn" || type == "deepseek_yarn") {
    m.rope.scaling = RopeScaling::kDeepseekYarn;
  } else if (type.empty() || type == "default") {
    m.rope.scaling = RopeScaling::kDefault;
  } else {
    PCPKV_FAIL("{}: {}: rope type '{}' is not supported; supported: default, yarn (DeepSeek flavour)", origin,
               rs_key, clip(type));
  }
  const bool yarn = m.rope.scaling == RopeScaling::kDeepseekYarn;

  std::set<std::string> known = {"rope_type", "type", "rope_theta"};
  if (yarn) {
    known.insert(std::begin(kYarnKeys), std::end(kYarnKeys));
    known.insert({"attention_factor", "truncate"});
    rr.read("factor", m.rope.factor, rs);
    rr.read("original_max_position_embeddings", m.rope.original_max_position_embeddings, rs);
    rr.read("beta_fast", m.rope.beta_fast, rs);
    rr.read("beta_slow", m.rope.beta_slow, rs);
    rr.read("mscale", m.rope.mscale, rs);
    rr.read("mscale_all_dim", m.rope.mscale_all_dim, rs);
    // After the reads: the HF comparison needs the file's factor; a missing key kept the preset value.
    for (const char* key : kYarnKeys) {
      if (!present.count(key)) {
        notes.remarks.push_back(fmt::format("{}: '{}' is missing: {}", origin, full(key),
                                            yarn_fallback(key, m, preset_had_yarn, base_name, present)));
      }
    }
    // HF's truncate (default true) floors/ceils the ramp ends as DeepSeek's reference and pcpkv do;
    // false keeps fractional ends, other inverse frequencies than pcpkv's tables.
    bool truncate = true;
    rr.read("truncate", truncate, rs);
    PCPKV_CHECK(truncate,
                "{}: '{}' = false is not supported: pcpkv builds the YaRN ramp with floor/ceil ends (DeepSeek's "
                "reference, HF's default truncate = true); remove the key or set it to true",
                origin, full("truncate"));
  }
  validate_rope(m.rope, origin, pre);
  if (yarn && present.count("attention_factor")) {
    // HF's _compute_yarn_parameters multiplies cos/sin by attention_factor in place of
    // mscale(factor, mscale) / mscale(factor, mscale_all_dim); vLLM's DeepSeek YaRN ignores the key.
    // pcpkv's tables (rope.cpp) use the mscale ratio, so only a value equal to it gives HF's bytes.
    double attention_factor = 0;
    rr.read("attention_factor", attention_factor, rs);
    const long double ratio = rope_mscale(m.rope);
    PCPKV_CHECK(static_cast<long double>(attention_factor) == ratio,
                "{}: '{}' = {} is not supported: HF transformers multiplies cos/sin by it instead of "
                "mscale(factor, mscale) / mscale(factor, mscale_all_dim) = {} (pcpkv's value; vLLM's DeepSeek "
                "YaRN ignores the key), so k_pe bytes would depend on the engine; remove the key or set mscale "
                "and mscale_all_dim for the magnitude you want",
                origin, full("attention_factor"), as_written(rs->at("attention_factor"), &paths,
                                                             full("attention_factor")),
                static_cast<double>(ratio));
  }
  for (auto it = rs->begin(); it != rs->end(); ++it) {
    const std::string& key = it.key();
    if (known.count(key)) continue;
    const bool yarn_only = std::find(std::begin(kYarnKeys), std::end(kYarnKeys), key) != std::end(kYarnKeys) ||
                           key == "attention_factor" || key == "truncate";
    if (yarn_only) {  // a key of another scaling type than the one chosen: harmless, but worth a line
      notes.remarks.push_back(fmt::format("{}: '{}' is not used: the rope type is default (no scaling)", origin,
                                          full(key)));
      continue;
    }
    PCPKV_CHECK(!strict, "{}: unknown key '{}' (strict mode)", origin, full(key));
    notes.remarks.push_back(fmt::format("{}: '{}' is not a RoPE key pcpkv knows: ignored", origin, full(key)));
  }
}

// A pcpkv::Error for a JSON text nlohmann refused, naming the key where parsing stopped when there is one
// (a number too large for a double throws out_of_range 406, not parse_error).
[[noreturn]] void fail_unparsable(const std::string& text, const std::string& origin, const json::exception& e) {
  const JsonPaths paths = scan_json(text);
  const std::string at = paths.error_path.empty() ? std::string() : fmt::format(" at '{}'", paths.error_path);
  if (e.id == 406) {
    PCPKV_FAIL("{}: '{}' = {} is out of range for a JSON number (it overflows a double)", origin,
               paths.error_path.empty() ? "(top level)" : clip(paths.error_path), clip(paths.error_token));
  }
  PCPKV_FAIL("{}: not valid JSON{}: {}", origin, clip(at), clip(e.what()));
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
  ModelConfig m = builtin(base_name);
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

std::vector<std::string> preset_names() { return {"deepseek-v3.2", "glm-5"}; }

std::string config_dir() {
  if (const char* env = read_env("PCPKV_CONFIG_DIR"); env && *env) return env;
#ifdef PCPKV_CONFIG_DIR
#ifdef PCPKV_INSTALL_CONFIG_DIR
  // An installed library whose source tree is gone reads the copy `cmake --install` made.
  std::error_code ec;
  if (!std::filesystem::is_directory(PCPKV_CONFIG_DIR, ec) &&
      std::filesystem::is_directory(PCPKV_INSTALL_CONFIG_DIR, ec))
    return PCPKV_INSTALL_CONFIG_DIR;
#endif
  return PCPKV_CONFIG_DIR;
#else
  return "configs";
#endif
}

ModelConfig preset(const std::string& name) {
  ModelConfig base = builtin(name);  // throws on an unknown name
  const std::string path = config_dir() + "/" + name + ".json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return base;  // installed without the data files: the same values
  ModelConfig m = parse_hf_config(read_input_file(fmt::format("preset '{}'", name), path, kMaxConfigFileBytes),
                                  name, nullptr, false, path);
  m.name = name;
  return m;
}

ModelConfig load_hf_config(const std::string& path, const std::string& base_preset, ConfigNotes* notes,
                           bool strict) {
  ModelConfig m =
      parse_hf_config(read_input_file("--config", path, kMaxConfigFileBytes), base_preset, notes, strict, clip(path));
  m.name = path;
  return m;
}

ModelConfig parse_hf_config(const std::string& json_text, const std::string& base_preset, ConfigNotes* notes,
                            bool strict, const std::string& origin) {
  // nlohmann reads a std::string only up to its first NUL: '{...}\0garbage' passed as '{...}'.
  if (const size_t nul = json_text.find('\0'); nul != std::string::npos)
    PCPKV_FAIL("{}: a NUL byte at offset {}; a config.json is text (a binary or truncated file?)", origin, nul);
  check_json_depth(json_text, origin);  // before any parse: no walk below may recurse past it
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail_unparsable(json_text, origin, e);
  }
  // Any other nlohmann exception below (a type or range error this code did not foresee) still names the
  // file and reaches the user as bad input, not as an internal error.
  try {
    return parse_hf_json(j, json_text, base_preset, notes, strict, origin);
  } catch (const json::exception& e) {
    PCPKV_FAIL("{}: unusable value: {}", origin, clip(e.what()));
  }
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
  // One entry per layer (HF's GlmMoeDsa reads indexer_types[layer_idx]): a shorter list failed only when a layer past
  // its end was looked up, a longer one never (pcpkv_torch.ModelSpec refuses both).
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
