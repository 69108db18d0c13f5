// pcpkv-test-labels: unit
// `pcpkv run --check-replicas` and PCPKV_CHECK_REPLICAS (the run-time replica check, pcpkv/publish/replica_hash.h):
// off by default, one "replica hashes agree" check per transport when on, a corrupted replica (--inject-fault row)
// fails it naming the layer, the rank and the slot with exit code 1, a bad PCPKV_CHECK_REPLICAS is refused (exit 2).
// mp-publish with the flag: tests/publish/replica_check.cpp.
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pcpkv/core/plan.h"
#include "support/cli_util.h"

using nlohmann::json;
using pcpkv_test::CliResult;
using pcpkv_test::parse_json;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

constexpr const char* kRun = "run --pcp 4 --tokens 300 --decodes 2 --backend cpu --json";

std::vector<json> replica_checks(const json& j) {
  std::vector<json> out;
  for (const auto& c : j["checks"])
    if (c["check"] == "replica hashes agree") out.push_back(c);
  return out;
}

// The environment of this process reaches the CLI (run_cli uses the shell): set, run, restore.
CliResult run_with_env(const std::string& args, const ScratchDir& dir, const char* value) {
  ::setenv("PCPKV_CHECK_REPLICAS", value, 1);
  CliResult r = run_cli(args, dir);
  ::unsetenv("PCPKV_CHECK_REPLICAS");
  return r;
}

TEST(CliReplicaCheck, OffByDefaultOnePassingCheckPerTransportWhenOn) {
  ScratchDir dir;
  ::unsetenv("PCPKV_CHECK_REPLICAS");
  CliResult r = run_cli(kRun, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(replica_checks(parse_json(r.out)).empty());

  r = run_cli(std::string(kRun) + " --check-replicas", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<json> checks = replica_checks(parse_json(r.out));
  ASSERT_EQ(checks.size(), 3u) << r.out;
  const std::vector<std::string> transports = {"collect", "staging", "direct"};
  for (size_t k = 0; k < checks.size(); ++k) {
    const json& c = checks[k];
    EXPECT_TRUE(c["pass"].get<bool>()) << c.dump();
    EXPECT_EQ(c["transport"], transports[k]);
    EXPECT_EQ(c["num_diff"], 0);
    EXPECT_EQ(c["num_bytes"], 4 * 302 * (656 + 132)) << c.dump();  // 4 replicas x 302 slots x 788 B
    EXPECT_NE(c["detail"].get<std::string>().find(fmt::format("4 replicas x 302 written slots (788 B hashed per "
                                                              "slot) equal rank 0's hashes, layer 0 ({})",
                                                              transports[k])),
              std::string::npos)
        << c.dump();
  }
  EXPECT_NE(r.err.find("PASS  direct   replica hashes agree"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("verdict: PASS (16 of 16 checks passed)"), std::string::npos) << r.err;

  // The variable does the same, and says so in a note; "0" and "" leave it off.
  r = run_with_env(std::string(kRun) + " --transport direct", dir, "1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  json j = parse_json(r.out);
  EXPECT_EQ(replica_checks(j).size(), 1u);
  EXPECT_NE(j["notes"].dump().find("replica check: on (PCPKV_CHECK_REPLICAS=1)"), std::string::npos) << j["notes"];
  for (const char* off : {"0", ""}) {
    r = run_with_env(std::string(kRun) + " --transport direct", dir, off);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(replica_checks(parse_json(r.out)).empty()) << "'" << off << "'";
  }
}

TEST(CliReplicaCheck, ACorruptedReplicaIsNamedAndFailsTheVerdict) {
  ScratchDir dir;
  const CliResult r = run_cli(std::string(kRun) + " --transport staging,direct --check-replicas --inject-fault row", dir);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  // --inject-fault row flips byte 7 of the first global token's row in the last rank's replica.
  pcpkv::PlanConfig pc;
  pc.pcp_world = 4;
  pc.block_size = 64;
  pc.requests = {{pcpkv::RequestKind::kPrefill, 300, 0},
                 {pcpkv::RequestKind::kDecode, 1, 1000},
                 {pcpkv::RequestKind::kDecode, 1, 2007}};
  const int64_t slot = pcpkv::make_plan(pc).global_slots[0];
  const std::vector<json> checks = replica_checks(parse_json(r.out));
  ASSERT_EQ(checks.size(), 2u) << r.out;
  for (const json& c : checks) {
    EXPECT_FALSE(c["pass"].get<bool>()) << c.dump();
    EXPECT_EQ(c["num_diff"], 1) << c.dump();
    EXPECT_NE(c["detail"].get<std::string>().find(fmt::format(
                  "layer 0 ({}): rank 3 differs from rank 0 at slot {} (the first differing slot of the 302 written in "
                  "this layer; differing slots per rank: 3: 1); replicas diverged",
                  c["transport"].get<std::string>(), slot)),
              std::string::npos)
        << c.dump();
  }
  EXPECT_NE(r.err.find("FAIL  staging  replica hashes agree"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("verdict: FAIL"), std::string::npos) << r.err;
}

TEST(CliReplicaCheck, ABadVariableIsRefused) {
  ScratchDir dir;
  for (const char* args : {"run --pcp 2 --tokens 16 --backend cpu", "run --pcp 2 --tokens 16 --backend cpu --check-replicas"}) {
    const CliResult r = run_with_env(args, dir, "yes");
    pcpkv_test::expect_refusal(r, args, {"PCPKV_CHECK_REPLICAS: must be 1 (on) or 0 / empty / unset (off), got 'yes'"},
                               dir);
  }
}

TEST(CliReplicaCheck, ABadVariableIsQuotedOnOneBoundedLine) {
  // A 3000-character value was quoted whole (the README's rule: 200 characters), a newline or an escape
  // sequence raw (the error is one line, and must not drive the terminal).
  ScratchDir dir;
  const std::string run = "run --pcp 2 --tokens 16 --backend cpu";
  CliResult r = run_with_env(run, dir, std::string(3000, 'x').c_str());
  pcpkv_test::expect_refusal(r, "long", {"got '" + std::string(200, 'x') + "... (3000 characters)'"}, dir);
  EXPECT_LT(r.err.size(), 500u) << r.err;
  r = run_with_env(run, dir, "1\n\x1b[31m");
  pcpkv_test::expect_refusal(r, "control characters", {"got '1\\n\\x1b[31m'"}, dir);
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("\n"), r.err.size() - 1) << r.err;  // one line: the only newline ends it
}

TEST(CliReplicaCheck, TheHelpAndInfoNameIt) {
  ScratchDir dir;
  CliResult r = run_cli("run --help", dir);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--check-replicas"), std::string::npos) << r.out;
  r = run_cli("mp-publish --help", dir);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--check-replicas"), std::string::npos) << r.out;
  r = run_cli("info --json", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json info = parse_json(r.out);
  bool found = false;
  for (const auto& e : info["environment"]) found = found || e["name"] == "PCPKV_CHECK_REPLICAS";
  EXPECT_TRUE(found) << r.out;
}

}  // namespace
