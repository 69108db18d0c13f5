// pcpkv-test-labels: unit
// The CLI's plan modes (--local-order, --decode-ownership; SPEC section 4.1) and --transport auto (section 5.1)
// on `pcpkv run` and `pcpkv launch -- mp-publish` (CPU backend): accepted, reported in the text and --json,
// the verdict PASS; bad names refused with the flag and the value.
#include <nlohmann/json.hpp>

#include "support/cli_util.h"

namespace {

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

TEST(CliPlanModes, RunWithEveryModeAndAutoTransportPasses) {
  for (const char* order : {"request", "local"}) {
    for (const char* own : {"replicated", "round_robin"}) {
      ScratchDir dir;
      const std::string args = fmt::format(
          "run --backend cpu --threads 2 --pcp 3 --tokens 61 --decodes 4 --block-size 16 --transport auto "
          "--local-order {} --decode-ownership {} --json",
          order, own);
      const CliResult r = run_cli(args, dir);
      ASSERT_EQ(r.exit_code, 0) << args << "\nstderr: " << r.err;
      const auto j = nlohmann::json::parse(r.out);
      EXPECT_EQ(j["plan"]["local_order"], order);
      EXPECT_EQ(j["plan"]["decode_ownership"], own);
      // round robin: decodes 0..3 on ranks 0, 1, 2, 0
      const std::vector<int> dec = j["plan"]["decode_tokens_per_rank"];
      const std::vector<int> want =
          std::string(own) == "round_robin" ? std::vector<int>{2, 1, 1} : std::vector<int>{4, 4, 4};
      EXPECT_EQ(dec, want);
      EXPECT_EQ(j["transport_choice"]["transport"], "direct");
      EXPECT_NE(j["transport_choice"]["reason"].get<std::string>().find("direct: all 3 ranks on host"),
                std::string::npos);
      ASSERT_EQ(j["transports"].size(), 1u);
      EXPECT_EQ(j["transports"][0]["transport"], "direct");
      EXPECT_NE(r.err.find("pcpkv run: --transport auto: direct: all 3 ranks"), std::string::npos) << r.err;
    }
  }
}

TEST(CliPlanModes, RunTextShowsTheModes) {
  ScratchDir dir;
  const CliResult r = run_cli("run --backend cpu --threads 2 --pcp 2 --tokens 20 --decodes 3 --block-size 16 "
                              "--transport collect,direct --decode-ownership round_robin",
                              dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("local order request, decodes round_robin"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verdict"), std::string::npos);
}

TEST(CliPlanModes, BadNamesAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"--local-order fifo", {"--local-order", "'fifo'", "request or local"}},
      {"--decode-ownership rr", {"--decode-ownership", "'rr'", "replicated or round_robin"}},
      {"--transport auto,direct", {"--transport", "auto", "comma list"}},
  };
  for (const auto& [flag, expect] : cases) {
    ScratchDir dir;
    pcpkv_test::expect_refusal(run_cli("run --backend cpu --pcp 2 --tokens 20 " + flag, dir), "run " + flag, expect,
                               dir);
  }
}

TEST(CliPlanModes, LaunchedMpPublishWithModesAndAutoTransport) {
  ScratchDir dir;
  const std::string line = "launch --nproc 3 --max-time 240 --output rank0 --socket-dir '" + dir.file("") +
                           "' -- mp-publish --backend cpu --tokens 50 --decodes 2 --block-size 16 --transport auto "
                           "--local-order local --decode-ownership round_robin --json";
  const CliResult r = run_cli(line, dir);
  ASSERT_EQ(r.exit_code, 0) << line << "\nstderr: " << r.err << "\nstdout: " << r.out;
  EXPECT_NE(r.err.find("--transport auto: direct: all 3 ranks on host"), std::string::npos) << r.err;
  const size_t brace = r.out.find('{');
  ASSERT_NE(brace, std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(brace, r.out.rfind('}') - brace + 1));
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["local_order"], "local");
  EXPECT_EQ(j["decode_ownership"], "round_robin");
  EXPECT_EQ(j["transport_choice"]["transport"], "direct");
}

TEST(CliPlanModes, LaunchedMpPublishRefusesBadModes) {
  ScratchDir dir;
  const std::string line = "launch --nproc 2 --max-time 120 --socket-dir '" + dir.file("") +
                           "' -- mp-publish --backend cpu --decode-ownership owner";
  const CliResult r = run_cli(line, dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--decode-ownership: unknown decode ownership 'owner'"), std::string::npos) << r.err;
}

}  // namespace
