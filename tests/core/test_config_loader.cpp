// pcpkv-test-labels: unit
// The HF config loader on configs a new user wrote: "rope_scaling": null (no scaling), numbers nlohmann
// refuses (1e999), RoPE parameters whose tables overflow, and values of the wrong JSON type or range.
// Every refusal is a pcpkv::Error naming the file, the key and the value as written.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pcpkv/publish/backend.h"
#include "pcpkv/core/error.h"
#include "pcpkv/core/inputs.h"
#include "pcpkv/core/model.h"
#include "pcpkv/core/plan.h"
#include "pcpkv/core/rope.h"
#include "support/error_of.h"

namespace pcpkv {
namespace {

// The message of the pcpkv::Error parse_hf_config throws ("no error" when it accepts the text). Any other
// exception type fails the test: the CLI would report it as an internal error (exit 3).
std::string error_of(const std::string& json_text, const std::string& base = {}) {
  return test::error_of([&] { parse_hf_config(json_text, base, nullptr, false, "user.json"); });
}

void expect_error(const std::string& json_text, const std::vector<std::string>& parts, const std::string& base = {}) {
  const std::string msg = error_of(json_text, base);
  EXPECT_EQ(msg.rfind("user.json: ", 0), 0u) << json_text << "\n" << msg;
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' missing in: " << msg;
}

// Rank 0's MLA cache after a direct publication of a small seeded batch (PCP 2, block 16).
std::vector<uint8_t> published_cache(const ModelConfig& model) {
  PlanConfig pc;
  pc.pcp_world = 2;
  pc.block_size = 16;
  pc.seed = 1;
  // Positions past original_max_position_embeddings (4096) and in the YaRN ramp: scaling shows there.
  pc.requests = {{RequestKind::kPrefill, 40, 5000}, {RequestKind::kDecode, 1, 300}};
  const PcpPlan plan = make_plan(pc);
  const GlobalInputs in = generate_inputs(model, plan, /*has_indexer=*/true, /*seed=*/11);
  PublishSetup s;
  s.model = &model;
  s.plan = &plan;
  s.fmt.kv_format = KvFormat::kBf16;  // k_pe bytes straight from the rotated values
  return make_cpu_backend(1)->publish(s, in, Transport::kDirect).mla_alloc[0];
}

// HF writes "rope_scaling": null for a model without RoPE scaling: the preset's YaRN must not survive it.
TEST(ConfigLoader, NullRopeScalingMeansDefaultRope) {
  ConfigNotes notes;
  const ModelConfig nulled =
      parse_hf_config(R"({"model_type": "deepseek_v32", "rope_scaling": null})", {}, &notes, false, "user.json");
  const ModelConfig yarn = preset("deepseek-v3.2");
  const ModelConfig plain = parse_hf_config(R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "default"}})",
                                            {}, nullptr, false, "plain.json");
  ASSERT_EQ(yarn.rope.scaling, RopeScaling::kDeepseekYarn);
  EXPECT_EQ(nulled.rope.scaling, RopeScaling::kDefault);
  EXPECT_EQ(nulled.rope.theta, yarn.rope.theta);
  ASSERT_EQ(notes.remarks.size(), 1u);
  EXPECT_NE(notes.remarks[0].find("user.json"), std::string::npos) << notes.remarks[0];
  EXPECT_NE(notes.remarks[0].find("'rope_scaling' is null"), std::string::npos) << notes.remarks[0];
  EXPECT_NE(notes.remarks[0].find("default RoPE"), std::string::npos) << notes.remarks[0];

  // The tables and the published cache bytes: equal to {"type": "default"}, different from the YaRN preset.
  const RopeTable t_null = make_rope_table(nulled.rope, 6000), t_plain = make_rope_table(plain.rope, 6000);
  const RopeTable t_yarn = make_rope_table(yarn.rope, 6000);
  EXPECT_EQ(t_null.cos_sin, t_plain.cos_sin);
  EXPECT_NE(t_null.cos_sin, t_yarn.cos_sin);
  const std::vector<uint8_t> c_null = published_cache(nulled), c_plain = published_cache(plain);
  const std::vector<uint8_t> c_yarn = published_cache(yarn);
  EXPECT_EQ(c_null, c_plain);
  int64_t num_diff = 0;
  for (size_t i = 0; i < c_null.size(); ++i) num_diff += c_null[i] != c_yarn[i];
  EXPECT_GT(num_diff, 1000) << "YaRN and default RoPE should give different k_pe bytes";

  // A preset that already has no scaling: still default, and the note does not claim a replacement.
  ConfigNotes glm_notes;
  const ModelConfig glm =
      parse_hf_config(R"({"model_type": "glm_moe_dsa", "rope_scaling": null})", {}, &glm_notes, false, "g.json");
  EXPECT_EQ(glm.rope.scaling, RopeScaling::kDefault);
  ASSERT_EQ(glm_notes.remarks.size(), 1u);
  EXPECT_EQ(glm_notes.remarks[0].find("replacing"), std::string::npos) << glm_notes.remarks[0];
}

// nlohmann throws out_of_range (not parse_error) for a number that overflows a double; every nlohmann
// exception must come out as a pcpkv::Error naming the file and, when known, the key.
TEST(ConfigLoader, JsonExceptionsNameFileAndKey) {
  expect_error(R"({"rope_theta": 1e999, "model_type": "glm_moe_dsa"})", {"'rope_theta'", "1e999", "overflow"});
  expect_error(R"({"model_type": "deepseek_v32", "rope_scaling": {"factor": -1e400}})",
               {"'rope_scaling.factor'", "-1e400"});
  expect_error(R"({"model_type": "glm_moe_dsa", "indexer_types": ["full", 1e999]})", {"'indexer_types[1]'", "1e999"});
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 2048,})", {"not valid JSON"});
  expect_error("[1, 2]", {"top level must be a JSON object"});
}

// nlohmann keeps the last of two equal keys: {"q_lora_rank": 2048, "q_lora_rank": 1024} loaded 1024 without a word
// while --inputs headers refused theirs. Both go through first_duplicate_key now; the key path names nested ones.
TEST(ConfigLoader, DuplicateKeysAreRefusedNamingTheKey) {
  const std::string msg = "appears twice in one object; every key must be unique";
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 2048, "q_lora_rank": 1024})",
               {"the key 'q_lora_rank' " + msg});
  expect_error(R"({"q_lora_rank": 2048, "q_lora_rank": 2048})", {"'q_lora_rank' " + msg}, "glm-5");
  expect_error(R"({"model_type": "deepseek_v32", "rope_scaling": {"factor": 40, "type": "yarn", "factor": 4}})",
               {"the key 'rope_scaling.factor' " + msg});
  expect_error(R"({"model_type": "glm_moe_dsa", "x": [1, {"a": 1, "a": 2}]})", {"the key 'x[1].a' " + msg});
  // Equal keys in different objects are not duplicates; a syntax error is still named as one.
  EXPECT_EQ(error_of(R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 40,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1,
                         "mscale_all_dim": 1}, "factor": 1})"),
            "no error");
  expect_error(R"({"q_lora_rank": 1, "q_lora_rank": )", {"not valid JSON"});
}

// Values that would make cos/sin * mscale overflow, vanish or blow up are refused at load, naming the key.
TEST(ConfigLoader, UnusableRopeParametersAreRefused) {
  const std::string yarn = R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 40, )";
  expect_error(yarn + R"("mscale": 1e300}})", {"rope_scaling.mscale", "1e+300"});
  // 0.1 * m * ln(40) + 1 = 0 at m = -2.7109: the YaRN divisor vanishes.
  expect_error(yarn + R"("mscale_all_dim": -2.7109}})", {"rope_scaling.mscale_all_dim", "-2.7109"});
  expect_error(yarn + R"("beta_fast": 0}})", {"rope_scaling.beta_fast", "0"});
  expect_error(yarn + R"("original_max_position_embeddings": 0}})",
               {"rope_scaling.original_max_position_embeddings", "0"});
  expect_error(R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 1e9}})",
               {"rope_scaling.factor", "1000000000"});
  expect_error(R"({"model_type": "glm_moe_dsa", "rope_theta": 1e300})", {"rope_theta", "1e+300"});
  expect_error(R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_theta": 0.5}})", {"rope_theta", "0.5"});

  // The shipped configs and the largest sane values pass, and their tables stay bounded.
  for (const std::string& name : preset_names()) EXPECT_NO_THROW(preset(name)) << name;
  const ModelConfig big = parse_hf_config(
      R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 10000, "mscale": 1000,
          "mscale_all_dim": 0, "beta_fast": 10000, "beta_slow": 1}})",
      {}, nullptr, false, "big.json");
  const RopeTable t = make_rope_table(big.rope, 5000);
  for (float v : t.cos_sin) ASSERT_TRUE(std::isfinite(v) && std::fabs(v) <= 1e4f) << v;

  // A config built in code goes through the same checks (ModelConfig::validate).
  ModelConfig m = preset("deepseek-v3.2");
  m.rope.mscale = std::nan("");
  try {
    m.validate();
    ADD_FAILURE() << "NaN mscale accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mscale = nan"), std::string::npos) << e.what();
  }
}

TEST(ConfigLoader, WrongTypesAndRangesNameTheValueAsWritten) {
  // model_type of the wrong JSON type: say which type, not "model_type ''".
  expect_error(R"({"model_type": 5})", {"'model_type' must be a string", "5 (a number)"});
  expect_error(R"({"model_type": [1]})", {"'model_type' must be a string", "an array"});
  expect_error(R"({"model_type": null})", {"'model_type' is null", "--model"});
  expect_error(R"({"hidden_size": 5})", {"'model_type' is missing", "--model"});
  // null with --model: the preset settles it.
  EXPECT_EQ(error_of(R"({"model_type": null})", "glm-5"), "no error");

  // Integers are range-checked before conversion: no wrap to INT64_MIN or to a small negative number.
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 1e30})", {"'q_lora_rank' = 1e30", "out of range"});
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 18446744073709549568})",
               {"'q_lora_rank' = 18446744073709549568", "out of range"});
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 9.3e18})", {"'q_lora_rank' = 9.3e18", "out of range"});
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 2048.5})",
               {"'q_lora_rank' must be an integer", "2048.5"});
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": true})", {"'q_lora_rank'", "true (a boolean)"});
  // In range for int64 but not for the field: validate() names the key.
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 1e15})", {"q_lora_rank = 1000000000000000"});
  // nlohmann stops at a NUL: the text after it was ignored, the text before it taken as the whole config.
  expect_error(std::string(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 2048})") + std::string(1, '\0') + "x",
               {"a NUL byte at offset 50", "is text"});
  expect_error(std::string(R"({"model_type": "glm_moe_dsa")") + std::string(1, '\0') + R"(, "q_lora_rank": 8})",
               {"a NUL byte at offset 28"});
  // The loader's bound is the dispatch's (kMaxQLoraRank): 6144 was accepted here (<= 8192) and refused only
  // when the first dispatch ran ("[8, 4096]").
  expect_error(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 6144})", {"q_lora_rank = 6144", "in [8, 4096]"});
  EXPECT_EQ(parse_hf_config(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 4096})", {}, nullptr, false, "x")
                .q_lora_rank,
            4096);
  // An integral double converts exactly.
  EXPECT_EQ(parse_hf_config(R"({"model_type": "glm_moe_dsa", "q_lora_rank": 1.024e3})", {}, nullptr, false, "x")
                .q_lora_rank,
            1024);

  expect_error(R"({"model_type": "glm_moe_dsa", "num_hidden_layers": -1})", {"num_hidden_layers = -1", ">= 1"});
  expect_error(R"({"model_type": "glm_moe_dsa", "num_hidden_layers": 0})", {"num_hidden_layers = 0"});
  expect_error(R"({"model_type": "glm_moe_dsa", "rope_scaling": "yarn"})",
               {"'rope_scaling' must be an object", "(a string)"});
}


// Notes of a config the loader accepts (fails the test when it refuses).
ConfigNotes notes_of(const std::string& json_text, bool strict = false) {
  ConfigNotes notes;
  try {
    parse_hf_config(json_text, {}, &notes, strict, "user.json");
  } catch (const std::exception& e) {
    ADD_FAILURE() << "refused: " << e.what() << "\n" << json_text;
  }
  return notes;
}

// The one remark that names `key` (quoted, as the loader writes it); "" (and a failure) when none or several.
std::string remark_on(const ConfigNotes& notes, const std::string& key) {
  std::vector<std::string> hits;
  for (const std::string& r : notes.remarks) {
    if (r.find("'" + key + "'") != std::string::npos) hits.push_back(r);
  }
  EXPECT_EQ(hits.size(), 1u) << key;
  return hits.size() == 1 ? hits[0] : std::string();
}

void expect_parts(const std::string& text, const std::vector<std::string>& parts) {
  EXPECT_EQ(text.rfind("user.json: ", 0), 0u) << text;
  for (const std::string& p : parts) EXPECT_NE(text.find(p), std::string::npos) << "'" << p << "' missing in: " << text;
}

const std::string kFullYarn =
    R"("type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
       "mscale": 1.0, "mscale_all_dim": 1.0)";

// Sub-keys pcpkv does not read are named (file and full key), never dropped silently; strict refuses them.
TEST(ConfigLoader, UnknownRopeSubKeysAreNoted) {
  const std::string text = R"({"model_type": "deepseek_v32", "rope_scaling": {)" + kFullYarn + R"(, "bogus": 1}})";
  const ConfigNotes notes = notes_of(text);
  ASSERT_EQ(notes.remarks.size(), 1u);
  expect_parts(remark_on(notes, "rope_scaling.bogus"), {"not a RoPE key pcpkv knows"});
  EXPECT_TRUE(notes.ignored.empty());
  const std::string msg = test::error_of([&] { parse_hf_config(text, {}, nullptr, /*strict=*/true, "user.json"); });
  expect_parts(msg, {"unknown key 'rope_scaling.bogus'", "strict"});

  // GLM-5's rope_parameters: the same, and YaRN keys under the default type are named as unused.
  const ConfigNotes glm = notes_of(
      R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "factor": 4,
          "extra": true}})");
  ASSERT_EQ(glm.remarks.size(), 2u);
  expect_parts(remark_on(glm, "rope_parameters.factor"), {"not used", "default"});
  expect_parts(remark_on(glm, "rope_parameters.extra"), {"not a RoPE key"});
  // The shipped configs carry no such key: no remark at all.
  for (const std::string& name : preset_names()) {
    ConfigNotes n;
    load_hf_config(config_dir() + "/" + name + ".json", {}, &n, /*strict=*/true);
    EXPECT_TRUE(n.remarks.empty()) << name << ": " << n.remarks.front();
  }
}

// {"type": "yarn", "factor": 40} alone: every other YaRN key takes the preset value, and each says so.
TEST(ConfigLoader, MissingYarnSubKeysAreNotedWithTheirSource) {
  const ConfigNotes ds =
      notes_of(R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 40}})");
  EXPECT_EQ(ds.remarks.size(), 5u);
  expect_parts(remark_on(ds, "rope_scaling.mscale"), {"missing", "using 1 from the deepseek-v3.2 preset",
                                                       "0.1 * ln(factor) + 1 = 1.3688"});
  expect_parts(remark_on(ds, "rope_scaling.mscale_all_dim"), {"missing", "using 1 from the deepseek-v3.2 preset"});
  expect_parts(remark_on(ds, "rope_scaling.original_max_position_embeddings"),
               {"missing", "using 4096 from the deepseek-v3.2 preset", "max_position_embeddings (163840)"});
  expect_parts(remark_on(ds, "rope_scaling.beta_fast"), {"missing", "using 32 from the deepseek-v3.2 preset"});
  expect_parts(remark_on(ds, "rope_scaling.beta_slow"), {"missing", "using 1 from the deepseek-v3.2 preset"});

  // GLM-5 has no YaRN in its preset: the values are pcpkv's built-in defaults, and the note says so.
  ConfigNotes glm_notes;
  const ModelConfig glm = parse_hf_config(
      R"({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 1e6,
          "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1}})",
      {}, &glm_notes, false, "user.json");
  EXPECT_EQ(glm.rope.scaling, RopeScaling::kDeepseekYarn);
  EXPECT_EQ(glm.rope.original_max_position_embeddings, 4096);
  ASSERT_EQ(glm_notes.remarks.size(), 1u);
  expect_parts(remark_on(glm_notes, "rope_parameters.original_max_position_embeddings"),
               {"missing", "using 4096 from the glm-5 preset", "no YaRN", "max_position_embeddings (202752)"});
  // A complete YaRN block: no remark.
  EXPECT_TRUE(notes_of(R"({"model_type": "deepseek_v32", "rope_scaling": {)" + kFullYarn + "}}").remarks.empty());
}

// HF's attention_factor replaces the mscale ratio as the cos/sin multiplier; pcpkv's tables use the ratio,
// so a different value is refused (not dropped), and a value equal to the ratio is accepted.
TEST(ConfigLoader, AttentionFactorIsRefusedUnlessItEqualsTheMscaleRatio) {
  const std::string head = R"({"model_type": "deepseek_v32", "rope_scaling": {)" + kFullYarn;
  expect_error(head + R"(, "attention_factor": 2.0}})",
               {"'rope_scaling.attention_factor' = 2.0", "not supported", "mscale_all_dim) = 1"});
  expect_error(head + R"(, "attention_factor": "x"}})", {"attention_factor", "\"x\" (a string)"});
  const ConfigNotes ok = notes_of(head + R"(, "attention_factor": 1}})");
  EXPECT_TRUE(ok.remarks.empty()) << ok.remarks.front();
  // Under the default type it is one more unused key.
  const ConfigNotes plain =
      notes_of(R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "default", "attention_factor": 2}})");
  ASSERT_EQ(plain.remarks.size(), 1u);
  expect_parts(remark_on(plain, "rope_scaling.attention_factor"), {"not used"});
  // truncate: true is what pcpkv computes; false (fractional ramp ends) is refused.
  EXPECT_TRUE(notes_of(head + R"(, "truncate": true}})").remarks.empty());
  expect_error(head + R"(, "truncate": false}})", {"'rope_scaling.truncate' = false", "not supported"});
  // rope_type and type must agree when both are given.
  expect_error(R"({"model_type": "deepseek_v32", "rope_scaling": {"rope_type": "yarn", "type": "default"}})",
               {"'rope_scaling.rope_type' = \"yarn\"", "'rope_scaling.type' = \"default\"", "disagree"});
}

// beta_fast < beta_slow inverts the ramp (finite, but not YaRN): refused naming both keys and values.
TEST(ConfigLoader, SwappedYarnBetasAreRefused) {
  const std::string yarn = R"({"model_type": "deepseek_v32", "rope_scaling": {"type": "yarn", "factor": 40, )";
  expect_error(yarn + R"("beta_fast": 1, "beta_slow": 32}})",
               {"rope_scaling.beta_fast = 1", "rope_scaling.beta_slow = 32", "beta_fast >= beta_slow"});
  // The preset's beta_slow (1) against a file's beta_fast 0.5: the same check.
  expect_error(yarn + R"("beta_fast": 0.5}})", {"rope_scaling.beta_fast = 0.5", "rope_scaling.beta_slow = 1"});
  // Equal betas: a one-step ramp the reference handles; accepted.
  EXPECT_EQ(error_of(yarn + R"("beta_fast": 8, "beta_slow": 8}})"), "no error");
  // A config built in code: validate() refuses the same way.
  ModelConfig m = preset("deepseek-v3.2");
  std::swap(m.rope.beta_fast, m.rope.beta_slow);
  try {
    m.validate();
    ADD_FAILURE() << "swapped betas accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rope.beta_fast = 1 is less than rope.beta_slow = 32"), std::string::npos)
        << e.what();
  }
}

TEST(ConfigLoader, MaxPositionEmbeddingsBelowOneIsRefused) {
  expect_error(R"({"model_type": "deepseek_v32", "max_position_embeddings": 0})",
               {"'max_position_embeddings' = 0", ">= 1"});
  expect_error(R"({"model_type": "glm_moe_dsa", "max_position_embeddings": -5})",
               {"'max_position_embeddings' = -5", ">= 1"});
  EXPECT_EQ(error_of(R"({"model_type": "glm_moe_dsa", "max_position_embeddings": 1})"), "no error");
}

// HF transformers 5 keeps `rope_scaling or rope_parameters`: a file with both reads rope_scaling, an empty
// rope_scaling ({}) gives way to rope_parameters (pcpkv used the empty one: default RoPE instead of the YaRN given).
TEST(ConfigLoader, RopeScalingOrRopeParametersAsTransformersChooses) {
  const std::string yarn = R"({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1, "rope_theta": 1e4})";
  const std::string plain = R"({"rope_type": "default", "rope_theta": 5e4})";
  const auto load = [](const std::string& scaling, const std::string& parameters) {
    return parse_hf_config(R"({"model_type": "deepseek_v32", "rope_scaling": )" + scaling +
                               R"(, "rope_parameters": )" + parameters + "}",
                           {}, nullptr, false, "both.json");
  };
  EXPECT_EQ(load(yarn, plain).rope.scaling, RopeScaling::kDeepseekYarn);
  EXPECT_EQ(load(plain, yarn).rope.scaling, RopeScaling::kDefault);
  EXPECT_EQ(load(plain, yarn).rope.theta, 5e4);
  EXPECT_EQ(load("{}", yarn).rope.scaling, RopeScaling::kDeepseekYarn);
  EXPECT_EQ(load("{}", yarn).rope.theta, 1e4);
  EXPECT_EQ(load("null", plain).rope.theta, 5e4);
  // {} alone: no scaling, said as for null.
  ConfigNotes notes;
  const ModelConfig m = parse_hf_config(R"({"model_type": "deepseek_v32", "rope_scaling": {}})", {}, &notes, false,
                                        "empty.json");
  EXPECT_EQ(m.rope.scaling, RopeScaling::kDefault);
  ASSERT_FALSE(notes.remarks.empty());
  EXPECT_NE(notes.remarks[0].find("'rope_scaling' is empty: default RoPE"), std::string::npos) << notes.remarks[0];
}

}  // namespace
}  // namespace pcpkv
