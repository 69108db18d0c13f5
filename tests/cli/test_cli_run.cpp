// pcpkv-test-labels: unit
// `pcpkv run` / `pcpkv info` on good input: exit codes, the printed plan, stage tables and verdict,
// --json on stdout, and --save files that load back through --inputs with byte-identical caches.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"

using nlohmann::json;
using pcpkv_test::CliResult;
using pcpkv_test::parse_json;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

std::vector<std::string> check_names(const json& j) {
  std::vector<std::string> out;
  for (const auto& c : j["checks"])
    out.push_back(c["transport"].get<std::string>() + " " + c["check"].get<std::string>());
  return out;
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST(CliRun, HelpListsEveryCommandAndTheDefaults) {
  ScratchDir dir;
  CliResult r = run_cli("--help", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* cmd : {"run", "info", "bench", "launch", "attention", "bench-serving"})
    EXPECT_NE(r.out.find(cmd), std::string::npos) << r.out;
  r = run_cli("run --help", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* s : {"--model", "glm-5", "--pcp", "32768", "--kv-format", "fp8_ds_mla", "--transport", "--inputs",
                        "--save", "--json", "--allow-nonfinite", "--ds-mla-scale", "--layer", "--block-size"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
  r = run_cli("", dir);
  EXPECT_EQ(r.exit_code, 2) << "a subcommand is required";
  EXPECT_NE(r.err.find("pcpkv: error:"), std::string::npos) << r.err;
}

TEST(CliRun, InfoListsPresetsLayoutsAndBackends) {
  ScratchDir dir;
  CliResult r = run_cli("info", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* s : {"glm-5", "deepseek-v3.2", "q_lora_rank 2048", "q_lora_rank 1536", "1152 B", "576 B", "656 B",
                        "800 B", "720 B", "132 B", "cpu   available", "cuda "}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
  r = run_cli("info --json", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = parse_json(r.out);
  EXPECT_EQ(j["presets"].size(), 2u);
  EXPECT_EQ(j["layouts"]["indexer_slot_bytes"], 132);
  EXPECT_EQ(j["backends"][0]["name"], "cpu");
  EXPECT_TRUE(j["backends"][0]["available"].get<bool>());
  // Without a usable CUDA backend the reason is given.
  if (!j["backends"][1]["available"].get<bool>()) {
    EXPECT_FALSE(j["backends"][1]["why_not"].get<std::string>().empty());
  }
}

TEST(CliRun, SmallRunPrintsPlanTablesAndVerdict) {
  ScratchDir dir;
  const CliResult r = run_cli("run --pcp 4 --tokens 200 --decodes 2 --backend cpu", dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* s :
       {"tokens per rank", "max_local_tokens", "transport 800 B", "MLA 656 B", "indexer slot 132 B", "stage", "GB/s",
        "dispatch", "collect", "staging", "direct", "replicas identical", "staging == direct",
        "== single-rank reference", "guard/untouched bytes intact", "within the FP8 bound", "verdict: PASS"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

TEST(CliRun, JsonGoesToStdoutAndEverythingElseToStderr) {
  ScratchDir dir;
  const CliResult r = run_cli("run --pcp 3 --tokens 77 --decodes 1 --backend cpu --json", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = parse_json(r.out);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_EQ(j["plan"]["pcp_world"], 3);
  EXPECT_EQ(j["plan"]["num_tokens"], 78);
  EXPECT_EQ(j["plan"]["transport_row_bytes"], 800);
  // DualChunkSwap of 77 over 3 ranks: chunk 13 (the last one 12), rank r owns chunks r and 5 - r.
  EXPECT_EQ(j["plan"]["prefill_tokens_per_rank"], json::parse("[25, 26, 26]"));
  EXPECT_EQ(j["plan"]["decode_tokens_per_rank"], json::parse("[1, 1, 1]"));
  EXPECT_EQ(j["transports"].size(), 3u);
  const auto names = check_names(j);
  for (const char* t : {"collect", "staging", "direct"}) {
    EXPECT_TRUE(has(names, std::string(t) + " replicas identical")) << t;
    EXPECT_TRUE(has(names, std::string(t) + " == single-rank reference")) << t;
    EXPECT_TRUE(has(names, std::string(t) + " guard/untouched bytes intact")) << t;
    EXPECT_TRUE(has(names, std::string(t) + " dequantized vs fp64 within the FP8 bound")) << t;
  }
  EXPECT_TRUE(has(names, " staging == direct"));
  for (const auto& c : j["checks"]) EXPECT_TRUE(c["pass"].get<bool>()) << c.dump();
  EXPECT_NE(r.err.find("verdict: PASS"), std::string::npos) << r.err;
}

TEST(CliRun, EveryFormatAndLayerKind) {
  ScratchDir dir;
  for (const char* flags : {"--kv-format fp8", "--kv-format bf16", "--kv-format fp8_ds_mla --ds-mla-scale raw",
                            "--layer shared", "--kv-format fp8 --layer shared --k-scale 0.5", "--topk-fill",
                            "--model deepseek-v3.2", "--pcp 1", "--pcp 8 --tokens 13 --decodes 3",
                            "--transport staging,direct", "--transport collect --repeats 2", "--block-size 4"}) {
    const CliResult r = run_cli(std::string("run --pcp 2 --tokens 100 --decodes 2 --backend cpu ") + flags, dir);
    EXPECT_EQ(r.exit_code, 0) << flags << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("verdict: PASS"), std::string::npos) << flags << "\n" << r.out;
  }
}

TEST(CliRun, SaveThenLoadGivesTheSameCaches) {
  ScratchDir dir;
  const std::string first = dir.file("first.safetensors"), second = dir.file("second.safetensors");
  CliResult r = run_cli(
      "run --pcp 4 --tokens 150 --decodes 2 --block-size 16 --seed 3 --backend cpu --save '" + first + "'", dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("saved"), std::string::npos);

  const pcpkv::SafetensorsReader a(first);
  for (const char* t :
       {"q_c", "kv", "k_pe", "index_k", "positions", "q_norm_w", "kv_norm_w", "index_ln_w", "index_ln_b", "requests",
        "slot_mapping", "block_tables", "gathered_slot_mapping", "mla_cache", "index_cache"}) {
    EXPECT_TRUE(a.has(t)) << t;
  }
  const int64_t num_blocks = std::stoll(a.metadata().at("num_blocks"));
  EXPECT_EQ(a.get("mla_cache").shape, (std::vector<int64_t>{num_blocks, 16, 656}));
  EXPECT_EQ(a.get("index_cache").shape, (std::vector<int64_t>{num_blocks, 16 * 132}));
  EXPECT_EQ(a.get("kv").shape, (std::vector<int64_t>{152, 512}));
  EXPECT_EQ(a.get("requests").shape, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(a.metadata().at("kv_format"), "fp8_ds_mla");
  EXPECT_EQ(a.metadata().at("block_size"), "16");
  const auto slots = a.read_as<int64_t>("slot_mapping", pcpkv::StDtype::kI64, {152});
  const auto mla = a.read_bytes("mla_cache");
  // Every written slot's row differs from the guard pattern; the null block keeps it.
  for (int64_t s : slots) {
    ASSERT_GE(s, 16);
    int64_t guard = 0;
    for (int64_t b = 0; b < 656; ++b) guard += mla[static_cast<size_t>(s * 656 + b)] == 0xA5;
    EXPECT_LT(guard, 656) << "slot " << s;
  }
  for (int64_t b = 0; b < 16 * 656; ++b) ASSERT_EQ(mla[static_cast<size_t>(b)], 0xA5) << "null block byte " << b;

  // The saved file is a valid --inputs file: same batch, same slots, same bytes (a different seed does not
  // matter: the file carries requests and slots).
  r = run_cli("run --pcp 4 --block-size 16 --seed 99 --backend cpu --inputs '" + first + "' --save '" + second + "'",
              dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const pcpkv::SafetensorsReader b(second);
  EXPECT_EQ(b.read_bytes("mla_cache"), mla);
  EXPECT_EQ(b.read_bytes("index_cache"), a.read_bytes("index_cache"));
  EXPECT_EQ(b.read_bytes("slot_mapping"), a.read_bytes("slot_mapping"));
  EXPECT_EQ(b.read_bytes("kv"), a.read_bytes("kv"));

  // Another PCP world over the same file gives the same caches too.
  r = run_cli("run --pcp 3 --block-size 16 --backend cpu --inputs '" + first + "' --save '" + second + "'", dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(pcpkv::SafetensorsReader(second).read_bytes("mla_cache"), mla);
}

TEST(CliRun, ACorruptedReplicaFailsTheVerdict) {
  ScratchDir dir;
  // One flipped byte inside a written row of the last rank: the replicas differ, the rest still passes.
  CliResult r = run_cli(
      "run --pcp 2 --tokens 64 --decodes 1 --backend cpu --transport staging,direct --inject-fault row --json", dir);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  json j = parse_json(r.out);
  EXPECT_FALSE(j["ok"].get<bool>());
  for (const auto& c : j["checks"]) {
    const bool replicas = c["check"] == "replicas identical";
    EXPECT_EQ(c["pass"].get<bool>(), !replicas) << c.dump();
    if (replicas) {
      EXPECT_EQ(c["num_diff"], 1) << c.dump();
      EXPECT_NE(c["detail"].get<std::string>().find("rank 1 MLA vs rank 0: 1 bytes differ"), std::string::npos);
      EXPECT_NE(c["detail"].get<std::string>().find("byte 7 of its row"), std::string::npos) << c.dump();
    }
  }
  EXPECT_NE(r.err.find("FAIL"), std::string::npos);
  EXPECT_NE(r.err.find("verdict: FAIL"), std::string::npos) << r.err;

  // A guard byte: the untouched-bytes check fails too. On PCP 1 the reference comparison catches it.
  r = run_cli("run --pcp 1 --tokens 64 --decodes 1 --backend cpu --transport direct --inject-fault guard --json", dir);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  j = parse_json(r.out);
  for (const auto& c : j["checks"]) {
    const std::string name = c["check"];
    const bool should_fail = name == "guard/untouched bytes intact" || name == "== single-rank reference";
    EXPECT_EQ(c["pass"].get<bool>(), !should_fail) << c.dump();
  }
}
