// pcpkv-test-labels: unit
// `pcpkv run` after a new user's reports: the memory pre-check covers the measured peak, --save after
// --inputs keeps block tables and slots consistent, a failed --save keeps the report (exit 3), float32
// limits of --k-scale, the saturation note, and messages that name the flag, file and value.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pcpkv/core/safetensors.h"
#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::InputsFile;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;
using pcpkv_test::slurp;
namespace fs = std::filesystem;

namespace {

struct SpawnResult {
  CliResult cli;
  long max_rss_kb = 0;  // peak resident memory of the child (wait4)
};

// Runs `pcpkv <args...>` directly (no shell) and reports its peak resident memory.
SpawnResult run_cli_rss(const std::vector<std::string>& args, const ScratchDir& dir) {
  const std::string out_path = dir.file(".stdout"), err_path = dir.file(".stderr");
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(PCPKV_CLI_PATH));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(PCPKV_CLI_PATH, argv.data());
    ::_exit(127);
  }
  SpawnResult r;
  int status = 0;
  rusage usage{};
  ::wait4(pid, &status, 0, &usage);
  r.cli.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.max_rss_kb = usage.ru_maxrss;
  r.cli.out = slurp(out_path);
  r.cli.err = slurp(err_path);
  fs::remove(out_path);
  fs::remove(err_path);
  return r;
}

std::vector<std::string> split(const std::string& flags) {
  std::vector<std::string> out;
  std::istringstream in(flags);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// "needs about 8.4 GB of host memory" -> 8.4e9 (-1 when absent).
double estimate_in(const std::string& err) {
  const std::regex re(R"(needs about ([0-9.]+) (MB|GB|TB) of host memory)");
  std::smatch m;
  if (!std::regex_search(err, m, re)) return -1;
  const double unit = m[2] == "MB" ? 1e6 : m[2] == "GB" ? 1e9 : 1e12;
  return std::stod(m[1]) * unit;
}

// slot == block_tables[r][pos / B] * B + pos % B for every token of a saved file; returns the failures.
int64_t table_mismatches(const std::string& path, int64_t block_size) {
  const pcpkv::SafetensorsReader f(path);
  const auto requests = f.read_as<int64_t>("requests", pcpkv::StDtype::kI64, {-1, 3});
  const int64_t n = f.get("slot_mapping").shape[0];
  const auto slots = f.read_as<int64_t>("slot_mapping", pcpkv::StDtype::kI64, {n});
  const auto positions = f.read_as<int64_t>("positions", pcpkv::StDtype::kI64, {n});
  const int64_t width = f.get("block_tables").shape[1];
  const auto tables = f.read_as<int32_t>("block_tables", pcpkv::StDtype::kI32, {-1, width});
  int64_t bad = 0, g = 0;
  for (size_t r = 0; r < requests.size() / 3; ++r) {
    for (int64_t t = 0; t < requests[3 * r + 1]; ++t, ++g) {
      const int64_t pos = positions[g];
      const int64_t want = int64_t{tables[r * width + pos / block_size]} * block_size + pos % block_size;
      bad += slots[g] != want;
    }
  }
  EXPECT_EQ(g, n);
  return bad;
}

}  // namespace

// Peaks measured on the CPU backend (2 threads) with `/usr/bin/time -f %M pcpkv run --backend cpu <flags>`
// (glm-5, --pcp 8, 4 decodes unless given). The estimate must cover each; it is printed by the refusal
// that --memory-limit-gb 0.001 forces, so nothing runs. The message rounds to 0.1 GB: hence the 0.05.
TEST(CliRunFixes, MemoryEstimateCoversMeasuredPeaks) {
  ScratchDir dir;
  const std::vector<std::pair<std::string, double>> measured = {
      {"--tokens 131072", 7.42e9},
      {"--tokens 65536", 3.84e9},
      {"--tokens 131072 --transport collect", 6.37e9},
      {"--tokens 131072 --transport staging", 5.38e9},
      {"--tokens 131072 --transport direct", 4.52e9},
      {"--tokens 65536 --transport direct", 2.38e9},
      {"--tokens 65536 --pcp 1", 2.47e9},
      {"--tokens 65536 --topk-fill", 4.44e9},
      {"--tokens 65536 --model deepseek-v3.2 --pcp 16", 5.12e9},
      {"--tokens 0 --decodes 32 --decode-context 16000 --pcp 4", 3.01e9},
      {"--tokens 65536 --topk-fill --pcp 2 --kv-format bf16", 3.69e9},
  };
  for (const auto& [flags, peak] : measured) {
    const SpawnResult r = run_cli_rss(split("run --backend cpu --memory-limit-gb 0.001 " + flags), dir);
    EXPECT_EQ(r.cli.exit_code, 2) << flags << "\n" << r.cli.err;
    const double estimate = estimate_in(r.cli.err);
    EXPECT_GE(estimate + 0.05e9, peak) << flags << "\n" << r.cli.err;
    // ... and not absurdly above (a pre-check that refuses runs that fit is a bug too).
    EXPECT_LE(estimate, 1.5 * peak) << flags << "\n" << r.cli.err;
    EXPECT_NE(r.cli.err.find("--memory-limit-gb 0.001"), std::string::npos) << r.cli.err;
  }
}

// The report: 850000 tokens (measured trend: ~47 GB) passed the old check (estimate 24.4 GB < 25.3 GB).
// Refused now, with exit 2, before any allocation (the process stays near its baseline) and nothing saved.
TEST(CliRunFixes, OversizedRunIsRefusedBeforeAllocating) {
  ScratchDir dir;
  const SpawnResult r = run_cli_rss(
      {"run", "--tokens", "850000", "--memory-limit-gb", "25.3", "--save", dir.file("out.safetensors")}, dir);
  EXPECT_EQ(r.cli.exit_code, 2) << r.cli.err;
  EXPECT_EQ(r.cli.err.rfind("pcpkv: error: --tokens 850000", 0), 0u) << r.cli.err;
  EXPECT_GE(estimate_in(r.cli.err), 47e9) << r.cli.err;
  EXPECT_TRUE(r.cli.out.empty()) << r.cli.out;
  EXPECT_LT(r.max_rss_kb, 600 * 1024) << "the refused run allocated " << r.max_rss_kb << " kB";
  EXPECT_TRUE(dir.files().empty()) << dir.files().front();
  // The estimate is also in the report of a run that fits.
  const CliResult ok = run_cli("run --pcp 2 --tokens 64 --decodes 1 --backend cpu --transport direct --json", dir);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  const auto j = nlohmann::json::parse(ok.out);
  EXPECT_GT(j["memory"]["estimate_bytes"].get<double>(), 1e6);
  EXPECT_NE(ok.err.find("host memory"), std::string::npos) << ok.err;
}

// The exact repro: a run re-saved from --inputs wrote the fresh plan's block tables next to the file's
// slots (all 303 tokens contradicted them).
TEST(CliRunFixes, ResavedRunKeepsBlockTablesConsistentWithSlots) {
  ScratchDir dir;
  const std::string s1 = dir.file("s1.safetensors"), s2 = dir.file("s2.safetensors"), s3 = dir.file("s3.safetensors");
  CliResult r = run_cli("run --pcp 4 --tokens 300 --decodes 3 --block-size 16 --seed 5 --backend cpu --save '" + s1 +
                            "'",
                        dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_cli("run --pcp 4 --block-size 16 --backend cpu --inputs '" + s1 + "' --save '" + s2 + "'", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(table_mismatches(s1, 16), 0);
  EXPECT_EQ(table_mismatches(s2, 16), 0);
  const pcpkv::SafetensorsReader a(s1), b(s2);
  EXPECT_EQ(a.read_bytes("block_tables"), b.read_bytes("block_tables"));
  EXPECT_EQ(a.read_bytes("mla_cache"), b.read_bytes("mla_cache"));

  // A file with an engine's slot mapping but no block tables: the saved tables follow those slots.
  InputsFile f(pcpkv_test::small_plan_config());
  std::vector<int64_t> ids(static_cast<size_t>(f.plan.num_blocks - 1));
  std::iota(ids.begin(), ids.end(), int64_t{1});
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(3));
  for (int64_t& s : f.slots) s = ids[static_cast<size_t>(s / 16 - 1)] * 16 + s % 16;
  f.write(dir.file("in.safetensors"));
  r = run_cli(std::string("run ") + pcpkv_test::kSmallRunFlags + " --backend cpu --inputs '" +
                  dir.file("in.safetensors") + "' --save '" + s3 + "'",
              dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(table_mismatches(s3, 16), 0);
  EXPECT_EQ(pcpkv::SafetensorsReader(s3).read_as<int64_t>("slot_mapping", pcpkv::StDtype::kI64, {97}), f.slots);

  // Tables and slots that disagree in a file are refused, naming both.
  pcpkv::SafetensorsWriter w;
  f.add_to(w);
  std::vector<int32_t> tables(2 * 7, -1);  // request 0: 6 blocks, request 1: 7 blocks of 16
  for (int k = 0; k < 6; ++k) tables[k] = 1 + k;
  for (int k = 0; k < 7; ++k) tables[7 + k] = 7 + k;
  w.add("block_tables", pcpkv::StDtype::kI32, {2, 7}, tables);
  w.write(dir.file("both.safetensors"));
  r = run_cli(std::string("run ") + pcpkv_test::kSmallRunFlags + " --backend cpu --inputs '" +
                  dir.file("both.safetensors") + "'",
              dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("contradicts block_tables"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("both.safetensors"), std::string::npos) << r.err;
}

// A --save that fails after a complete run (a 100-block file-size limit here) keeps the printed report,
// exits 3 (I/O error, not bad input) with the reason, and leaves no partial file.
TEST(CliRunFixes, SaveFailureAfterTheRunKeepsTheReport) {
  ScratchDir dir;
  const std::string save = dir.file("out.safetensors");
  const std::string run = std::string("'") + PCPKV_CLI_PATH + "' run " + pcpkv_test::kSmallRunFlags +
                          " --tokens 96 --decodes 1 --backend cpu --transport direct";
  for (const bool json : {false, true}) {
    const std::string cmd = "ulimit -f 100; exec " + run + (json ? " --json" : "") + " --save '" + save + "' >'" +
                            dir.file("o.txt") + "' 2>'" + dir.file("e.txt") + "'";
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status));
    const std::string out = slurp(dir.file("o.txt")), err = slurp(dir.file("e.txt"));
    EXPECT_EQ(WEXITSTATUS(status), 3) << out << err;
    const std::string& report = json ? err : out;
    EXPECT_NE(report.find("verdict: PASS"), std::string::npos) << report;
    EXPECT_NE(err.find("pcpkv: error: --save:"), std::string::npos) << err;
    EXPECT_NE(err.find("File too large"), std::string::npos) << err;
    EXPECT_NE(err.find("the run completed, verdict PASS"), std::string::npos) << err;
    if (json) {
      const auto j = nlohmann::json::parse(out);
      // The command failed (exit 3): "ok" says so; the verdict alone is "checks_ok".
      EXPECT_FALSE(j["ok"].get<bool>()) << out;
      EXPECT_TRUE(j["checks_ok"].get<bool>()) << out;
      EXPECT_TRUE(j["saved"].is_null());
      EXPECT_NE(j["save_error"].get<std::string>().find("File too large"), std::string::npos) << out;
    }
    fs::remove(dir.file("o.txt"));
    fs::remove(dir.file("e.txt"));
    EXPECT_TRUE(dir.files().empty()) << "left behind: " << dir.files().front();
  }
}

// Subnormal float32 scales (1e-40, 1e-45) were accepted: x / k_scale was then inf for every |x| > 2^-21.
TEST(CliRunFixes, KScaleIsCheckedAsFloat32) {
  ScratchDir dir;
  for (const char* v : {"1e-300", "1e39", "1e-46", "1e-40", "1e-45"}) {
    const CliResult r = run_cli(std::string("run --kv-format fp8 --k-scale ") + v, dir);
    EXPECT_EQ(r.exit_code, 2) << v << r.err;
    EXPECT_EQ(r.err.rfind("pcpkv: error: --k-scale: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(v), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("fmt.k_scale"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("must be a finite, positive, normal float32"), std::string::npos) << r.err;
    EXPECT_TRUE(dir.files().empty());
  }
}

// --k-scale 1e-6 saturates most values; a PASS there checks little, and the report says so.
TEST(CliRunFixes, ManySaturatedValuesGiveANote) {
  ScratchDir dir;
  const std::string base = "run --pcp 2 --tokens 64 --decodes 1 --backend cpu --transport direct --kv-format fp8 ";
  CliResult r = run_cli(base + "--k-scale 1e-6", dir);
  ASSERT_NE(r.exit_code, 2) << r.err;
  EXPECT_NE(r.out.find("note: fp8 bound: up to"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the bound check is weak"), std::string::npos) << r.out;
  r = run_cli(base + "--k-scale 1e-6 --json", dir);
  const auto j = nlohmann::json::parse(r.out);
  bool found = false;
  for (const auto& n : j["notes"]) {
    found = found || n.get<std::string>().find("bound check is weak") != std::string::npos;
  }
  EXPECT_TRUE(found) << j["notes"].dump();
  r = run_cli(base + "--k-scale 1", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("saturate"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("encode as 0"), std::string::npos) << r.out;
  // The other end: a huge scale flushes the values to 0, and the bound's absolute term lets them pass.
  r = run_cli(base + "--k-scale 1e30", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("encode as 0"), std::string::npos) << r.out;
}

TEST(CliRunFixes, MessagesNameFlagFileAndValue) {
  ScratchDir dir;
  // --decode-context: -1 is a meaning, so the bound says -1.
  CliResult r = run_cli("run --decode-context -2", dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--decode-context: must be >= -1 (-1: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("got -2"), std::string::npos) << r.err;

  // A requests row [1, 3, 1000]: the file, the row, and what a decode needs.
  InputsFile f(pcpkv_test::small_plan_config());
  f.requests[3] = 1;
  f.requests[4] = 3;
  f.requests[5] = 1000;
  f.write(dir.file("in.safetensors"));
  r = run_cli(std::string("run ") + pcpkv_test::kSmallRunFlags + " --inputs '" + dir.file("in.safetensors") + "'",
              dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("in.safetensors: requests[1] = [1, 3, 1000]: a decode request (kind 1) must have "
                       "num_new_tokens = 1, got 3"),
            std::string::npos)
      << r.err;

  // Config values nlohmann refuses are bad input (2), not internal errors (3); the note of a null scaling.
  const std::string config = dir.file("c.json");
  std::ofstream(config) << R"({"rope_theta": 1e999, "model_type": "glm_moe_dsa"})";
  r = run_cli("run --config '" + config + "'", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("c.json: 'rope_theta' = 1e999"), std::string::npos) << r.err;
  std::ofstream(config) << R"({"model_type": "deepseek_v32", "rope_scaling": null})";
  r = run_cli("run --pcp 2 --tokens 64 --decodes 1 --backend cpu --transport direct --config '" + config + "'", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("note: config: " + config + ": 'rope_scaling' is null: default RoPE"), std::string::npos)
      << r.out;
}

// A saved file's slots and block tables belong to the block size it was saved with (its metadata): another
// --block-size is refused naming both, instead of an out-of-range block id deep in the tables.
TEST(CliRunFixes, SavedFileNeedsItsBlockSize) {
  ScratchDir dir;
  const std::string s = dir.file("bs16.safetensors");
  CliResult r = run_cli("run --pcp 2 --tokens 64 --decodes 1 --block-size 16 --backend cpu --save '" + s + "'", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_cli("run --pcp 2 --backend cpu --inputs '" + s + "'", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("saved with block_size 16"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--block-size is 64"), std::string::npos) << r.err;
  r = run_cli("run --pcp 2 --block-size 16 --backend cpu --inputs '" + s + "'", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// A run whose memory is mostly the process itself says so instead of asking for fewer tokens.
TEST(CliRunFixes, BaselineDominatedRefusalSaysSo) {
  ScratchDir dir;
  const CliResult r = run_cli("run --tokens 1 --decodes 0 --pcp 1 --backend cpu --memory-limit-gb 0.001", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("most of it is the process itself"), std::string::npos) << r.err;
}
