// pcpkv-test-labels: unit
// `pcpkv bench` checks every flag before it looks for a GPU: on a machine without one a typo is named
// (exit code 2, the flag and the value), not reported as "needs a CUDA GPU"; nothing is printed on stdout
// and neither --json nor --markdown is written. Safe on a GPU machine too: a refused flag starts no GPU work.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

void expect_refused(const std::string& args, const std::vector<std::string>& expect) {
  ScratchDir dir;
  const std::string line =
      "bench " + args + " --json '" + dir.file("out.json") + "' --markdown '" + dir.file("out.md") + "'";
  const CliResult r = run_cli(line, dir);
  pcpkv_test::expect_refusal(r, line, expect, dir);
  EXPECT_EQ(r.err.find("needs a CUDA"), std::string::npos) << line << ": the GPU check came first:\n" << r.err;
}

TEST(CliFlagsBench, PcpAndTokensBeforeTheGpuCheck) {
  expect_refused("--pcp 0", {"--pcp", "0", "[1, 8]"});
  expect_refused("--pcp 2,16", {"--pcp", "16"});
  expect_refused("--pcp 2,,4", {"--pcp", "'2,,4'", "empty entry"});
  expect_refused("--pcp two", {"--pcp", "'two'", "not an integer"});
  expect_refused("--tokens=-5", {"--tokens", "-5"});
  expect_refused("--tokens 0", {"--tokens", "0"});
}

TEST(CliFlagsBench, ListsAreChecked) {
  expect_refused("--models glm-5,llama-3", {"--models", "llama-3"});
  expect_refused("--models ''", {"--models", "empty"});
  expect_refused("--kv-formats fp8,fp4", {"kv-formats", "fp4"});
  expect_refused("--transports collect,nvls", {"--transports", "nvls"});
  expect_refused("--single-rank-tokens 4096,0", {"--single-rank-tokens", "0"});
  expect_refused("--pdl-tokens 1,,8", {"--pdl-tokens", "'1,,8'"});
  expect_refused("--layer-variants ''", {"--layer-variants", "empty"});
}

TEST(CliFlagsBench, NumbersAreChecked) {
  expect_refused("--block-size 48", {"--block-size", "48", "power of two"});
  expect_refused("--block-size 2", {"--block-size", "2"});
  expect_refused("--topk-width=-1", {"--topk-width", "-1"});
  expect_refused("--iters 0", {"--iters", "0"});
  expect_refused("--warmup=-1", {"--warmup", "-1"});
  expect_refused("--pdl-pcp 9", {"--pdl-pcp", "9"});
  expect_refused("--pdl-layers 0", {"--pdl-layers", "0"});
  expect_refused("--per-gpu-pcp 9", {"--per-gpu-pcp", "9"});
  expect_refused("--per-gpu-pcp=-1", {"--per-gpu-pcp", "-1"});
  expect_refused("--per-gpu-tokens 100", {"--per-gpu-tokens", "100", "multiple of 2 x --per-gpu-pcp = 16"});
  expect_refused("--pcp 2,4 --replica-check-pcp 8", {"--replica-check-pcp", "one of --pcp '2,4'", "got 8"});
  expect_refused("--replica-check-pcp=-2", {"--replica-check-pcp", "got -2"});
  expect_refused("--copy-gib 0", {"--copy-gib", "0"});
  expect_refused("--device=-1", {"--device", "-1"});
  expect_refused("--layer dense", {"--layer", "dense"});
}

TEST(CliFlagsBench, OutputTargetsAreCheckedBeforeTheRun) {
  ScratchDir dir;
  // --json into a missing directory: refused before the bench (not after minutes of measurement).
  const std::string missing = dir.file("missing/out.json");
  CliResult r = run_cli("bench --json '" + missing + "'", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--json"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("needs a CUDA"), std::string::npos) << r.err;
  r = run_cli("bench --markdown '" + dir.file("") + "'", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--markdown"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is a directory"), std::string::npos) << r.err;
  r = run_cli("bench --json ''", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--json: the path is empty"), std::string::npos) << r.err;
  EXPECT_TRUE(dir.files().empty()) << dir.files().front();
}

}  // namespace
