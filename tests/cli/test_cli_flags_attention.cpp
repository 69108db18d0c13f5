// pcpkv-test-labels: unit
// `pcpkv attention` checks its flags before anything runs or is printed: exit code 2, a message naming the
// flag (not the library's internal field: "dcp_world", "fmt.k_scale") and the value, no header line on
// stdout, nothing written. A comma list with an empty entry is refused, not silently shortened.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

// Internal names that must not reach a user in place of the flag.
const std::vector<std::string> kInternalNames = {"attention check:", "dcp_world", "dcp_interleave", "fmt.k_scale",
                                                 "topk must", "pcp_world", "bench:"};

void expect_refused(const std::string& args, const std::vector<std::string>& expect) {
  ScratchDir dir;
  const CliResult r = run_cli("attention " + args, dir);
  pcpkv_test::expect_refusal(r, args, expect, dir);
  for (const auto& n : kInternalNames)
    EXPECT_EQ(r.err.find(n), std::string::npos) << args << ": internal name '" << n << "' in\n" << r.err;
}

TEST(CliFlagsAttention, EmptyListEntriesAreRefused) {
  expect_refused("--pcp 2,,3", {"--pcp", "'2,,3'", "empty entry"});
  expect_refused("--pcp 2,", {"--pcp", "'2,'", "empty entry"});
  expect_refused("--pcp ,2", {"--pcp", "',2'", "empty entry"});
  expect_refused("--pcp ''", {"--pcp", "empty"});
  expect_refused("--prefill 301,,77", {"--prefill", "'301,,77'", "empty entry"});
  expect_refused("--bench-indexers exact,,fp32_tree", {"--bench-indexers", "'exact,,fp32_tree'"});
  expect_refused("--bench-attentions mma,", {"--bench-attentions", "'mma,'"});
}

TEST(CliFlagsAttention, ListEntriesAreChecked) {
  expect_refused("--pcp 2,x", {"--pcp", "'x'", "not an integer"});
  expect_refused("--pcp 2,3x", {"--pcp", "'3x'", "not an integer"});
  // An out-of-range world size later in the list is refused before the first one runs.
  expect_refused("--pcp 2,100", {"--pcp", "100", "[1, 64]"});
  expect_refused("--pcp 0", {"--pcp", "0"});
  expect_refused("--prefill 0", {"--prefill", "0"});
  expect_refused("--prefill=-7", {"--prefill", "-7"});
  expect_refused("--bench-attentions mma,fast", {"--bench-attentions", "fast"});
}

TEST(CliFlagsAttention, MessagesNameTheFlag) {
  expect_refused("--topk 0", {"--topk", "0", "[1, 8192]"});
  expect_refused("--topk 9000", {"--topk", "9000"});
  expect_refused("--dcp 0", {"--dcp", "0"});
  expect_refused("--dcp 65", {"--dcp", "65"});
  expect_refused("--dcp-interleave 0", {"--dcp-interleave", "0"});
  expect_refused("--k-scale 0", {"--k-scale", "0"});
  expect_refused("--k-scale=-1", {"--k-scale", "-1"});
  expect_refused("--k-scale inf", {"--k-scale", "inf"});
  expect_refused("--k-scale 1e-60", {"--k-scale", "1e-60"});  // rounds to 0 as the fp32 the cache stores
  expect_refused("--k-scale 1e-40", {"--k-scale", "1e-40", "normal float32"});  // a subnormal float32
}

TEST(CliFlagsAttention, OtherFlagsBeforeTheHeader) {
  expect_refused("--block-size 48", {"--block-size", "48"});
  expect_refused("--block-size 2", {"--block-size", "2"});
  expect_refused("--decodes=-1", {"--decodes", "-1"});
  expect_refused("--decode-context 0", {"--decode-context", "0"});
  expect_refused("--prefill-context=-1", {"--prefill-context", "-1"});
  expect_refused("--kv-format fp4", {"kv-format", "fp4"});
  expect_refused("--transport nvls", {"--transport", "nvls"});
  expect_refused("--backend tpu", {"--backend", "tpu"});
  expect_refused("--consumers gpu", {"--consumers", "gpu"});
  expect_refused("--attention-kernel wgmma", {"--attention-kernel", "wgmma"});
  expect_refused("--model llama-3", {"--model", "llama-3"});
  expect_refused("--prefill '' --decodes 0", {"empty"});
  expect_refused("--bench --tokens 0", {"--tokens", "0"});
  expect_refused("--bench --repeats 0", {"--repeats", "0"});
  expect_refused("--bench --topk 0", {"--topk", "0"});
  // Positions past GLM-5's max_position_embeddings (202752): refused by the publication, after the header on stdout.
  expect_refused("--prefill 3 --prefill-context 202750 --decodes 0",
                 {"--prefill-context 202750", "prefill of 3 tokens from position 202750", "reaches position 202752"});
  expect_refused("--prefill 3 --decodes 1 --decode-context 202752",
                 {"--decode-context 202752", "decode at position 202752", "max_position_embeddings is 202752"});
}

// The same rule as `pcpkv run`: a decimal outside the flag's range is refused, not wrapped (-1 as a uint64
// seed) or clamped.
TEST(CliFlagsAttention, OutOfRangeIntegersAreRefused) {
  expect_refused("--seed -1", {"--seed", "-1", "out of range"});
  expect_refused("--seed 18446744073709551616", {"--seed", "18446744073709551616", "out of range"});
  expect_refused("--decode-context 99999999999999999999", {"--decode-context", "99999999999999999999"});
  expect_refused("--prefill-context=-99999999999999999999", {"--prefill-context", "-99999999999999999999"});
  expect_refused("--bench --tokens 99999999999999999999", {"--tokens", "99999999999999999999"});
}

// Flags the format or the mode does not use are named in a note (as `pcpkv run` does), and the run goes on.
TEST(CliFlagsAttention, UnusedFlagsGetANote) {
  ScratchDir dir;
  const std::string small = "--pcp 1 --prefill 8 --decodes 0 --topk 8 --dcp 1";
  CliResult r = run_cli("attention --kv-format bf16 --ds-mla-scale raw --k-scale 2 " + small, dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("note: --ds-mla-scale: not used: it applies to --kv-format fp8_ds_mla, not bf16"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("note: --k-scale: not used: it applies to --kv-format fp8, not bf16"), std::string::npos)
      << r.out;
  // --k-scale applies to fp8, --ds-mla-scale does not; bench-only flags without --bench.
  r = run_cli("attention --kv-format fp8 --k-scale 0.5 --ds-mla-scale raw --tokens 64 --repeats 2 " + small, dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("note: --k-scale"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: --ds-mla-scale: not used"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: --tokens: not used: it applies to --bench"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: --repeats: not used: it applies to --bench"), std::string::npos) << r.out;
  // Defaults are not notes: a flag left alone is not "given".
  r = run_cli("attention --kv-format bf16 " + small, dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("note:"), std::string::npos) << r.out;
}

// The checked flags still run the check (a small batch: two PCP worlds and the DCP merge).
TEST(CliFlagsAttention, ValidFlagsStillRun) {
  ScratchDir dir;
  const CliResult r = run_cli("attention --pcp 1,2 --prefill 40 --decodes 2 --decode-context 100 --topk 64 --dcp 2",
                              dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.rfind("pcpkv attention: ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("PCP 2 vs 1 rank"), std::string::npos) << r.out;
}

}  // namespace

// A flag given twice takes its last value, as in `pcpkv run` (README), and progress goes to stderr.
TEST(CliFlagsAttention, RepeatedFlagTakesTheLastValue) {
  ScratchDir dir;
  const CliResult r = run_cli("attention --pcp 1 --prefill 8 --topk 8 --dcp 1 --decodes 1 --decodes 0", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("pcpkv attention: PCP 1 (1 of 1)"), std::string::npos) << r.err;
}
