// The RoPE keys of an HF config.json (see hf_rope.h).
#include "core/hf_rope.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "pcpkv/core/rope.h"

namespace pcpkv::hf_json {
namespace {

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

}  // namespace

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

}  // namespace pcpkv::hf_json
