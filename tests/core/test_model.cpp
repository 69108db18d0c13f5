// pcpkv-test-labels: unit
// Model presets (SPEC section 1) and the HF config loader: values, overrides, and bad configs.
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "pcpkv/core/error.h"
#include "pcpkv/core/model.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

std::string error_of(const std::string& json_text, const std::string& base = {}, bool strict = false) {
  return test::error_of([&] { parse_hf_config(json_text, base, nullptr, strict, "test.json"); });
}

TEST(Model, PresetsMatchSpec) {
  const ModelConfig ds = preset("deepseek-v3.2");
  EXPECT_EQ(ds.hidden_size, 7168);
  EXPECT_EQ(ds.num_attention_heads, 128);
  EXPECT_EQ(ds.q_lora_rank, 1536);
  EXPECT_EQ(ds.qk_nope_head_dim, 128);
  EXPECT_EQ(ds.v_head_dim, 128);
  EXPECT_EQ(ds.index_n_heads, 64);
  EXPECT_EQ(ds.rms_norm_eps, 1e-6);
  EXPECT_EQ(ds.rope.scaling, RopeScaling::kDeepseekYarn);
  EXPECT_EQ(ds.rope.factor, 40.0);
  EXPECT_TRUE(ds.mla_rope_interleave);
  EXPECT_FALSE(ds.indexer_rope_interleave);
  EXPECT_EQ(ds.n_group, 8);
  EXPECT_EQ(ds.topk_group, 4);
  EXPECT_NEAR(ds.softmax_scale(), 0.135234, 1e-6);
  EXPECT_TRUE(ds.layer_has_indexer(0));
  EXPECT_TRUE(ds.layer_has_indexer(60));

  const ModelConfig glm = preset("glm-5");
  EXPECT_EQ(glm.hidden_size, 6144);
  EXPECT_EQ(glm.num_attention_heads, 64);
  EXPECT_EQ(glm.q_lora_rank, 2048);
  EXPECT_EQ(glm.qk_nope_head_dim, 192);
  EXPECT_EQ(glm.v_head_dim, 256);
  EXPECT_EQ(glm.index_n_heads, 32);
  EXPECT_EQ(glm.rms_norm_eps, 1e-5);
  EXPECT_EQ(glm.rope.scaling, RopeScaling::kDefault);
  EXPECT_TRUE(glm.indexer_rope_interleave);
  EXPECT_TRUE(glm.router_logits_fp32);
  EXPECT_DOUBLE_EQ(glm.softmax_scale(), 0.0625);
}

TEST(Model, UnknownPresetNamesKnownOnes) {
  try {
    preset("llama");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model 'llama'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("glm-5"), std::string::npos);
  }
  // A huge name is clipped (input_limits.h clip), not quoted whole (100 KB in, a 100 KB message out).
  test::expect_clipped_error(test::error_of([] { preset(std::string(100000, 'm')); }), "--model: unknown model 'mmm",
                             "known: deepseek-v3.2, glm-5");
}

TEST(Model, ConfigOverridesPreset) {
  ConfigNotes notes;
  const ModelConfig m = parse_hf_config(
      R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
          "q_lora_rank": 1024, "vocab_size": 5, "some_new_key": 1, "index_topk_freq": 4,
          "index_skip_topk_offset": 3, "num_hidden_layers": 78})",
      {}, &notes, false, "test.json");
  EXPECT_EQ(m.rope.theta, 8e6);
  EXPECT_EQ(m.q_lora_rank, 1024);
  EXPECT_EQ(m.hidden_size, 6144);  // kept from the preset
  ASSERT_EQ(notes.ignored.size(), 1u);
  EXPECT_EQ(notes.ignored[0], "some_new_key");
  EXPECT_FALSE(notes.missing.empty());
  // vLLM IndexShare schedule: 21 of 78 layers (0, 1, 2, 6, 10, ..., 74) have an indexer.
  int n = 0;
  for (int l = 0; l < 78; ++l) n += m.layer_has_indexer(l);
  EXPECT_EQ(n, 21);
  EXPECT_TRUE(m.layer_has_indexer(2));
  EXPECT_FALSE(m.layer_has_indexer(3));
  EXPECT_TRUE(m.layer_has_indexer(6));
  EXPECT_THROW(m.layer_has_indexer(78), Error);
}

TEST(Model, IndexerTypesWin) {
  const ModelConfig m = parse_hf_config(
      R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]})", {},
      nullptr, false, "t");
  EXPECT_TRUE(m.layer_has_indexer(0));
  EXPECT_FALSE(m.layer_has_indexer(1));
  EXPECT_TRUE(m.layer_has_indexer(2));
}

TEST(Model, BadConfigsNameFieldAndValue) {
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "kv_lora_rank": 256})").find("kv_lora_rank = 256"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "q_lora_rank": "big"})").find("'q_lora_rank' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 1001})").find("q_lora_rank = 1001"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "rms_norm_eps": -1})").find("rms_norm_eps"), std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "llama"})").find("model_type 'llama'"), std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "rope_scaling": {"type": "linear"}})").find("'linear'"),
            std::string::npos);
  EXPECT_NE(error_of("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "extra": 1})", {}, true).find("unknown key 'extra'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "indexer_types": ["full", "half"]})").find("indexer_types[1]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "n_group": 3})").find("n_group = 3"), std::string::npos);
  // One indexer_types entry per layer: 2 for 3 layers, 4 for 3 layers (the loader kept both).
  for (const char* types : {R"(["full", "shared"])", R"(["full", "shared", "full", "full"])"})
    EXPECT_NE(error_of(std::string(R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "indexer_types": )") +
                       types + "}")
                  .find("but num_hidden_layers = 3"),
              std::string::npos)
        << types;
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "index_topk_pattern": "FSF"})")
                .find("indexer_types has 3 entries but num_hidden_layers = 2"),
            std::string::npos);
  // Messages name the file, not the base preset; a needed key may not be null.
  EXPECT_EQ(error_of(R"({"model_type": "glm_moe_dsa", "q_lora_rank": -8})").rfind("test.json: q_lora_rank = -8", 0), 0u);
  EXPECT_NE(error_of(R"({"model_type": "glm_moe_dsa", "q_lora_rank": null})").find("'q_lora_rank' is null"),
            std::string::npos);
}

TEST(Model, AConfigWithoutRopeThetaSaysThePresetValueIsKept) {
  const auto missing_of = [](const std::string& text) {
    ConfigNotes notes;
    parse_hf_config(text, {}, &notes, false, "test.json");
    std::string all;
    for (const std::string& s : notes.missing) all += s + ";";
    return all;
  };
  EXPECT_NE(missing_of(R"({"model_type": "glm_moe_dsa"})").find("rope_theta (kept preset glm-5 value 1000000)"),
            std::string::npos);
  EXPECT_NE(missing_of(R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_type": "default"}})")
                .find("rope_theta (kept preset"),
            std::string::npos);
  // Given at the top level, or inside rope_parameters / rope_scaling: not missing.
  for (const char* text :
       {R"({"model_type": "glm_moe_dsa", "rope_theta": 5e5})",
        R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})",
        R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "rope_theta": 5e5}})"})
    EXPECT_EQ(missing_of(text).find("rope_theta"), std::string::npos) << text;
}

TEST(Model, ShippedConfigsLoad) {
  for (const std::string& name : preset_names()) {
    ConfigNotes notes;
    const ModelConfig m = load_hf_config(config_dir() + "/" + name + ".json", {}, &notes);
    EXPECT_TRUE(notes.missing.empty()) << name << ": " << notes.missing.front();
    EXPECT_TRUE(notes.ignored.empty()) << name << ": " << notes.ignored.front();
    EXPECT_EQ(m.q_lora_rank, preset(name).q_lora_rank);
  }
  EXPECT_THROW(load_hf_config("/nonexistent/config.json"), Error);
}

}  // namespace
}  // namespace pcpkv
