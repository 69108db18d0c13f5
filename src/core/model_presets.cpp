// Model presets (SPEC section 1): the built-in values, and the shipped configs/<name>.json that override them.
#include "core/model_presets.h"

#include <filesystem>

#include <fmt/format.h>

#include "pcpkv/core/env.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/input_limits.h"

namespace pcpkv {
namespace {

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

}  // namespace

ModelConfig builtin_preset(const std::string& name) {
  if (name == "glm-5") return builtin_glm5();
  if (name == "deepseek-v3.2") return builtin_deepseek_v32();
  PCPKV_FAIL("--model: unknown model '{}'; known: deepseek-v3.2, glm-5", clip(name));
}

std::string preset_for_model_type(const std::string& t) {
  if (t == "glm_moe_dsa") return "glm-5";
  if (t == "deepseek_v32" || t == "deepseek_v3") return "deepseek-v3.2";
  return {};
}

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
  ModelConfig base = builtin_preset(name);  // throws on an unknown name
  const std::string path = config_dir() + "/" + name + ".json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return base;  // installed without the data files: the same values
  ModelConfig m = parse_hf_config(read_input_file(fmt::format("preset '{}'", name), path, kMaxConfigFileBytes),
                                  name, nullptr, false, path);
  m.name = name;
  return m;
}

}  // namespace pcpkv
