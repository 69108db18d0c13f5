// pcpkv-test-labels: unit
// `pcpkv` with hostile files, as a user meets it: one bounded "pcpkv: error:" line and exit 2
// for a deeply nested or oversized config, a FIFO or device as --config; notes for what an inputs file
// holds that pcpkv does not read; `pcpkv info` that survives one broken preset file.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "pcpkv/core/input_limits.h"
#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::InputsFile;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

std::string quoted(const std::string& s) { return "'" + s + "'"; }

size_t longest_line(const std::string& s) {
  size_t best = 0, start = 0;
  for (size_t nl; (nl = s.find('\n', start)) != std::string::npos; start = nl + 1) best = std::max(best, nl - start);
  return std::max(best, s.size() - start);
}

TEST(CliHostileInput, DeepOrHugeConfigIsOneBoundedLine) {
  ScratchDir dir;
  std::ofstream(dir.file("deep.json")) << "{\"model_type\": \"glm_moe_dsa\", \"x\": " << std::string(100000, '[')
                                       << std::string(100000, ']') << "}";
  CliResult r = run_cli("run --tokens 8 --pcp 2 --config " + quoted(dir.file("deep.json")), dir);
  pcpkv_test::expect_refusal(r, "deep config", {"deep.json: the JSON nests 100001 levels deep"}, dir, {"deep.json"});
  EXPECT_LT(r.err.size(), 400u) << r.err.substr(0, 400);
  // 50,000 levels gave a 100 KB error line: values are quoted up to 200 characters.
  std::ofstream(dir.file("wide.json")) << "{\"model_type\": \"glm_moe_dsa\", \"q_lora_rank\": \""
                                       << std::string(100000, 'q') << "\"}";
  r = run_cli("run --tokens 8 --pcp 2 --config " + quoted(dir.file("wide.json")), dir);
  pcpkv_test::expect_refusal(r, "huge value", {"'q_lora_rank' must be an integer", "(100002 characters)"}, dir,
                             {"deep.json", "wide.json"});
  EXPECT_LT(r.err.size(), 600u) << r.err.substr(0, 600);
}

TEST(CliHostileInput, ConfigMustBeARegularFileOfBoundedSize) {
  ScratchDir dir;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  {
    std::ofstream big(dir.file("big.json"));
  }
  fs::resize_file(dir.file("big.json"), pcpkv::kMaxConfigFileBytes + 1);
  const auto t0 = std::chrono::steady_clock::now();
  pcpkv_test::expect_refusal(run_cli("run --config " + quoted(dir.file("fifo")), dir), "fifo",
                             {"--config", "is a FIFO (named pipe), not a regular file"}, dir, {"fifo", "big.json"});
  pcpkv_test::expect_refusal(run_cli("run --config /dev/zero", dir), "device",
                             {"--config: '/dev/zero' is a character device, not a regular file"}, dir,
                             {"fifo", "big.json"});
  pcpkv_test::expect_refusal(run_cli("run --config " + quoted(dir.file("big.json")), dir), "big",
                             {"--config", "more than the 16777216 bytes"}, dir, {"fifo", "big.json"});
  pcpkv_test::expect_refusal(run_cli("mp-publish --backend cpu --config /dev/zero", dir), "mp-publish device",
                             {"--config: '/dev/zero' is a character device"}, dir, {"fifo", "big.json"});
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

// A broken preset file made `pcpkv info` fail whole (and a FIFO hung it).
TEST(CliHostileInput, InfoReportsABrokenPresetAndPrintsTheRest) {
  ScratchDir dir;
  fs::create_directories(dir.file("cfg"));
  std::ofstream(dir.file("cfg/glm-5.json")) << std::string(100000, '[') << std::string(100000, ']');
  ASSERT_EQ(::mkfifo(dir.file("cfg/deepseek-v3.2.json").c_str(), 0600), 0);
  ::setenv("PCPKV_CONFIG_DIR", dir.file("cfg").c_str(), 1);
  const CliResult r = run_cli("info", dir);
  const CliResult j = run_cli("info --json", dir);
  ::unsetenv("PCPKV_CONFIG_DIR");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("glm-5          unusable: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("levels deep"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("deepseek-v3.2  unusable: preset 'deepseek-v3.2': "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("byte layouts"), std::string::npos) << r.out;  // the rest is still there
  EXPECT_LT(longest_line(r.out), 700u);
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_NE(doc["presets"][0]["error"].get<std::string>().find("FIFO"), std::string::npos) << j.out;
  EXPECT_EQ(doc["presets"].size(), 2u) << j.out;
}

// A misspelled optional tensor ('slot_maping') was skipped without a word: the plan's slots were used.
TEST(CliHostileInput, TensorsThatAreNotReadGetANote) {
  ScratchDir dir;
  const InputsFile f(pcpkv_test::small_plan_config());
  pcpkv::SafetensorsWriter w;
  f.add_to(w, {"slot_mapping"});
  w.add("slot_maping", pcpkv::StDtype::kI64, {f.in.num_tokens}, f.slots);
  const std::vector<int64_t> junk = {1, 2, 3};
  w.add("junk_tensor", pcpkv::StDtype::kI64, {3}, junk);
  w.write(dir.file("in.safetensors"));
  const CliResult r = run_cli(std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                                  " --inputs " + quoted(dir.file("in.safetensors")),
                              dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("note: --inputs " + dir.file("in.safetensors") +
                       ": tensor 'slot_maping' is not read (not a tensor pcpkv knows; did you mean 'slot_mapping'?)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("tensor 'junk_tensor' is not read (not a tensor pcpkv knows)"), std::string::npos) << r.out;
}

// A saved file of another kv_format was read without a word.
TEST(CliHostileInput, SavedFileOfAnotherKvFormatGetsANote) {
  ScratchDir dir;
  const std::string saved = dir.file("s.safetensors");
  const std::string base = std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                           " --tokens 96 --decodes 1";
  ASSERT_EQ(run_cli(base + " --kv-format fp8 --save " + quoted(saved), dir).exit_code, 0);
  const std::string run = std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                          " --inputs " + quoted(saved);
  CliResult r = run_cli(run, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("saved with kv_format fp8 (this run: fp8_ds_mla): the caches are computed anew"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("is not read"), std::string::npos) << r.out;  // a saved file's own tensors are known
  r = run_cli(run + " --kv-format fp8", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("saved with"), std::string::npos) << r.out;
  // The other format settings and the layer kind were read without a word too.
  r = run_cli(run + " --kv-format fp8 --k-scale 0.5", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("saved with k_scale 1 (this run: 0.5):"), std::string::npos) << r.out;
  const std::string ds = dir.file("ds.safetensors");
  ASSERT_EQ(run_cli(base + " --save " + quoted(ds), dir).exit_code, 0);
  const std::string run_ds = std::string("run --backend cpu --transport direct ") + pcpkv_test::kSmallRunFlags +
                             " --inputs " + quoted(ds);
  r = run_cli(run_ds + " --ds-mla-scale raw --layer shared", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("saved with ds_mla_scale pow2 (this run: raw), has_indexer true (this run: false):"),
            std::string::npos)
      << r.out;
  r = run_cli(run_ds, dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("saved with"), std::string::npos) << r.out;
}

// A header of 700k tensors gave a 6 MB error line ("present: ..." listed every name).
TEST(CliHostileInput, ErrorLinesAreBounded) {
  ScratchDir dir;
  pcpkv::SafetensorsWriter w;
  std::vector<std::string> names;
  for (int i = 0; i < 20000; ++i) names.push_back(fmt::format("tensor_with_a_long_name_{:06d}", i));
  for (const auto& n : names) w.add(n, pcpkv::StDtype::kU8, {0}, nullptr, 0);
  w.write(dir.file("many.safetensors"));
  const CliResult r = run_cli("run --tokens 8 --pcp 2 --inputs " + quoted(dir.file("many.safetensors")), dir);
  pcpkv_test::expect_refusal(r, "many tensors", {"tensor 'kv' is missing", "and 19980 more"}, dir,
                             {"many.safetensors"});
  EXPECT_LT(r.err.size(), pcpkv::kMaxErrorChars + 100) << r.err.size();
}

// A huge flag value was quoted whole (then cut to kMaxErrorChars by the error line): every flag the CLI checks
// itself quotes it through clip (input_limits.h), so the line stays short and still names the flag.
TEST(CliHostileInput, HugeFlagValuesAreQuotedClipped) {
  const std::string huge(100000, 'h');
  const struct {
    std::string args, head, tail;
  } cases[] = {
      {"run --backend H", "--backend: unknown backend 'hhh", "known: auto, cpu, cuda"},
      {"run --inject-fault H", "--inject-fault: must be row or guard, got 'hhh", "(100000 characters)"},
      {"run --layer H", "--layer: must be indexer or shared, got 'hhh", "(100000 characters)"},
      {"run --transport H", "--transport: unknown transport 'hhh", "comma list of collect, staging, direct"},
      {"bench --transports H", "--transports: unknown transport 'hhh", "known: collect, staging, direct"},
      {"bench --pcp H", "--pcp: 'hhh", "is not an integer (in 'hhh"},
      {"attention --consumers H", "--consumers: unknown 'hhh", "known: cpu, cuda"},
      {"attention --prefill H", "--prefill: 'hhh", "is not an integer (in 'hhh"},
      {"mp-publish --backend cpu --collect-via H", "--collect-via: 'hhh", "is not auto, nccl or p2p"},
      {"bench-fence --backend H", "--backend: unknown backend 'hhh", "known: auto, cpu, cuda"},
      {"launch --nproc 1 -- H", "launch --nproc 1 -- hhh", "is not a rank program"},
      {"launch --nproc 1 --gpus H -- mp-publish", "--gpus: 'hhh", "is not a device index"},
  };
  for (const auto& c : cases) {
    ScratchDir dir;
    std::string args = c.args;
    args.replace(args.find('H'), 1, huge);
    const CliResult r = run_cli(args, dir);
    pcpkv_test::expect_refusal(r, c.args, {"pcpkv: error: " + c.head, c.tail, "(100000 characters)"}, dir);
    EXPECT_LT(r.err.size(), 1000u) << c.args << ": " << r.err.substr(0, 300);
  }
}

}  // namespace
