// pcpkv-test-labels: unit
// `--topk-fill full|tail|none` (pcpkv/publish/dispatch.h TopkFill) on run, bench and launch: run checks every row of
// every rank's buffer against the mode (-1 where it fills, the poison byte elsewhere); the flag alone keeps the
// old meaning (full); a bad value is refused naming the flag, before any work.
#include <nlohmann/json.hpp>

#include "support/cli_util.h"

namespace pcpkv_test {
namespace {

// Uneven ranks (PCP 3 over 42 tokens): every rank but one has padding rows, which only full and tail fill.
const std::string kRun = "run --tokens 40 --decodes 2 --pcp 3 --backend cpu --json ";

nlohmann::json topk_checks(const CliResult& r) {
  nlohmann::json out = nlohmann::json::array();
  const nlohmann::json doc = nlohmann::json::parse(r.out);  // a named document: the loop must not outlive it
  for (const auto& c : doc["checks"])
    if (c["check"].get<std::string>().find("top-k") != std::string::npos) out.push_back(c);
  return out;
}

TEST(CliTopkFill, RunChecksEachModeOnEveryRow) {
  ScratchDir dir;
  for (const auto& [flag, name] : std::vector<std::pair<std::string, std::string>>{
           {"--topk-fill", "(full)"}, {"--topk-fill full", "(full)"}, {"--topk-fill tail", "(tail)"},
           {"--topk-fill=none", "(none)"}}) {
    const CliResult r = run_cli(kRun + flag, dir);
    ASSERT_EQ(r.exit_code, 0) << flag << "\n" << r.err;
    const nlohmann::json checks = topk_checks(r);
    ASSERT_EQ(checks.size(), 3u) << flag << ": one per transport\n" << r.out;
    for (const auto& c : checks) {
      EXPECT_TRUE(c["pass"].get<bool>()) << flag << ": " << c.dump();
      EXPECT_NE(c["check"].get<std::string>().find(name), std::string::npos) << flag << ": " << c.dump();
      EXPECT_EQ(c["num_bytes"].get<int64_t>(), 3 * 16 * 2048 * 4) << "every row of every rank is checked";
    }
  }
}

TEST(CliTopkFill, BadValueNamesTheFlag) {
  ScratchDir dir;
  const std::string want = "--topk-fill: 'Tail' is not a top-k fill; known: full, tail, none";
  for (const std::string& cmd : {kRun + "--topk-fill Tail", std::string("bench --topk-fill Tail"),
                                 std::string("launch --nproc 2 -- mp-publish --backend cpu --topk-fill Tail")}) {
    const CliResult r = run_cli(cmd, dir);
    EXPECT_NE(r.exit_code, 0) << cmd;
    EXPECT_NE(r.err.find(want), std::string::npos) << cmd << "\n" << r.err;
  }
}

TEST(CliTopkFill, AnEmptyValueIsRefused) {
  // `--topk-fill ""` (an unset shell variable) ran with no top-k buffer at all and passed; the flag alone is full.
  ScratchDir dir;
  const CliResult r = run_cli(kRun + "--topk-fill ''", dir);
  pcpkv_test::expect_refusal(r, "empty", {"--topk-fill: '' is not a top-k fill; known: full, tail, none"}, dir);
}

}  // namespace
}  // namespace pcpkv_test
