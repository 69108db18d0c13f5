// pcpkv-test-labels: multiproc
// Every rank agrees or every rank refuses, for the CLI's rank programs: ranks started with other flags are refused
// on every rank at once, naming the flag and both values, before anything is allocated or written (a break test
// found other --seed, --model, --local-order ranks publishing and passing, other --transport ranks timing out in an
// all-gather and other --block-size ranks refused only as a symmetric memory size); a rank that fails makes the
// launcher stop the others within seconds (rank 0 waited out its 60 s rendezvous); a torchrun-style rank 0 that
// refused this job's rank started with another command line names it within seconds (it waited 60 s).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "support/cli_runner.h"

namespace pcpkv {
namespace {

using test::clean_env;
using test::describe;
using test::run_program;

// Two torchrun-style ranks of one job (PCPKV_JOB_ID: one job token whatever the flags), rank r with extra[r].
std::vector<test::CliResult> two_ranks(const std::vector<std::string>& base, const std::vector<std::string> extra[2],
                                       bool job_id = true) {
  test::TempDir dir;
  const std::string port = test::random_port();
  std::vector<test::CliResult> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      auto env = test::torchrun_env(r, 2, port, dir.path);
      env.push_back({"PCPKV_BOOTSTRAP_TIMEOUT_S", "60"});
      if (job_id) env.push_back({"PCPKV_JOB_ID", "agree-" + port});
      std::vector<std::string> args = base;
      args.insert(args.end(), extra[r].begin(), extra[r].end());
      out[static_cast<size_t>(r)] = run_program(args, 120, env);
    });
  for (auto& t : threads) t.join();
  return out;
}

struct Differ {
  const char* flag;
  const char* rank0;  // the value rank 0 has (its default where empty is given)
  const char* rank1;
  bool give_rank0;    // rank 0 passes the flag too
};

class RanksDisagree : public ::testing::TestWithParam<Differ> {};

TEST_P(RanksDisagree, EveryRankRefusesNamingTheFlagAndBothValuesBeforeAnyWrite) {
  const Differ d = GetParam();
  std::vector<std::string> extra[2];
  if (d.give_rank0) extra[0] = {d.flag, d.rank0};
  extra[1] = {d.flag, d.rank1};
  // --no-check: without the check nothing else would have noticed (the seed's ranks passed before).
  const auto out = two_ranks({"mp-publish", "--backend", "cpu", "--tokens", "64", "--decodes", "1", "--no-check"},
                             extra);
  const std::string why = fmt::format(
      "ranks disagree on {}: rank 0 has {}, rank 1 has {}; every rank must run the same configuration (nothing was "
      "allocated or written)\n",
      d.flag, d.rank0, d.rank1);
  for (int r = 0; r < 2; ++r) {
    const test::CliResult& o = out[static_cast<size_t>(r)];
    EXPECT_EQ(o.exit_code, 2) << describe(o);
    // The refusal is all a rank printed: no plan, no stage table, no verdict; it comes before the plan and the
    // symmetric buffers (a differing --block-size was refused only by the caches' sizes, after the plan).
    EXPECT_EQ(o.output, fmt::format("pcpkv: error: mp-publish rank {}: {}", r, why)) << describe(o);
    EXPECT_LT(o.seconds, 20.0) << describe(o);  // promptly, not at the 60 s bootstrap timeout
  }
}

INSTANTIATE_TEST_SUITE_P(
    Flags, RanksDisagree,
    ::testing::Values(Differ{"--seed", "0", "7", false}, Differ{"--model", "glm-5", "deepseek-v3.2", false},
                      Differ{"--local-order", "request", "local", false},
                      Differ{"--transport", "all", "direct", false}, Differ{"--block-size", "64", "32", false},
                      Differ{"--tp", "1", "2", false}, Differ{"--kv-format", "fp8_ds_mla", "bf16", false}),
    [](const ::testing::TestParamInfo<Differ>& i) {
      std::string n = std::string(i.param.flag).substr(2);
      for (char& c : n)
        if (c == '-') c = '_';
      return n;
    });

// Through `pcpkv launch` (one job token per launch), with rank-dependent flags, and for bench-fence.
TEST(RanksDisagreeUnderLaunch, MpPublishAndBenchFenceAreRefusedOnEveryRank) {
  const std::string self = PCPKV_CLI_PATH;
  const std::string seed_is_rank = "mp-publish --backend cpu --tokens 64 --no-check --seed $PCPKV_RANK";
  auto r = run_program({"launch", "--nproc", "2", "--program", "/bin/sh", "--", "-c",
                        fmt::format("exec {} {}", self, seed_is_rank)},
                       120, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  for (int k = 0; k < 2; ++k)
    EXPECT_NE(r.output.find(fmt::format("[rank {}] pcpkv: error: mp-publish rank {}: ranks disagree on --seed: rank 0 "
                                        "has 0, rank 1 has 1;",
                                        k, k)),
              std::string::npos)
        << r.output;
  EXPECT_EQ(r.output.find("verdict"), std::string::npos) << r.output;
  r = run_program({"launch", "--nproc", "2", "--program", "/bin/sh", "--", "-c",
                   fmt::format("exec {} bench-fence --backend cpu --iters 3 --layers $((PCPKV_RANK + 2))", self)},
                  120, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  for (int k = 0; k < 2; ++k)
    EXPECT_NE(r.output.find(fmt::format("[rank {}] pcpkv: error: bench-fence rank {}: ranks disagree on --layers: "
                                        "rank 0 has 2, rank 1 has 3;",
                                        k, k)),
              std::string::npos)
        << r.output;
}

// A rank that fails before it ever connects (here a bad rendezvous variable: it cannot reach the others to tell
// them) made rank 0 wait out its 60 s rendezvous although the launcher had seen rank 1 exit: now the launcher stops
// the others (SIGTERM after --grace, 2 s by default) and names rank 1 as the cause. (A bad flag no longer fails
// alone: every rank names it after the rendezvous, BadArgumentOnOneRank below.)
TEST(LaunchStopsTheOthers, ARankThatFailsFirstEndsTheJobWithinSeconds) {
  const std::string self = PCPKV_CLI_PATH;
  const auto r = run_program(
      {"launch", "--nproc", "2", "--timeout", "60", "--program", "/bin/sh", "--", "-c",
       fmt::format("if [ $PCPKV_RANK = 1 ]; then PCPKV_BOOTSTRAP_TIMEOUT_S=soon exec {0} mp-publish --backend cpu "
                   "--tokens 64; else exec {0} mp-publish --backend cpu --tokens 64; fi",
                   self)},
      120, clean_env());
  EXPECT_EQ(r.exit_code, 4) << describe(r);  // rank 1's, the first failure (a rendezvous that failed)
  EXPECT_LT(r.seconds, 10.0) << describe(r);
  EXPECT_NE(r.output.find("[rank 1] pcpkv: error: mp-publish rank 1: bootstrap: PCPKV_BOOTSTRAP_TIMEOUT_S='soon' is "
                          "not a positive number of seconds"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("pcpkv launch: rank 1 failed first (exit code 4)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(terminated by the launcher because rank 1 failed first)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("2 of 2 rank(s) failed; the first was rank 1"), std::string::npos) << r.output;
}

// A bad flag on one torchrun-style rank (no launcher to stop the others): that rank joins the rendezvous carrying
// its verdict and every rank refuses at once naming it. Rank 1 exited 2 before the rendezvous, so rank 0 waited out
// its 60 s timeout and then said only "rank(s) 1 ... never connected".
struct BadFlag {
  std::vector<std::string> base;   // both ranks
  std::vector<std::string> rank1;  // rank 1's extra flags
  const char* cmd;
  const char* why;  // rank 1's own refusal
};

class BadArgumentOnOneRank : public ::testing::TestWithParam<BadFlag> {};

TEST_P(BadArgumentOnOneRank, EveryRankNamesItWithinSeconds) {
  const BadFlag b = GetParam();
  const std::vector<std::string> extra[2] = {{}, b.rank1};
  const auto out = two_ranks(b.base, extra);
  for (int r = 0; r < 2; ++r) {
    const test::CliResult& o = out[static_cast<size_t>(r)];
    EXPECT_EQ(o.exit_code, 2) << describe(o);
    EXPECT_EQ(o.output, fmt::format("pcpkv: error: {} rank {}: the argument check failed on 1 of 2 ranks (every rank "
                                    "refuses; nothing was allocated or written): rank 1: {}\n",
                                    b.cmd, r, b.why))
        << describe(o);
    EXPECT_LT(o.seconds, 20.0) << describe(o);  // promptly, not at the 60 s bootstrap timeout
  }
}

INSTANTIATE_TEST_SUITE_P(
    Commands, BadArgumentOnOneRank,
    ::testing::Values(BadFlag{{"mp-publish", "--backend", "cpu", "--tokens", "256"}, {"--block-size", "48"},
                              "mp-publish",
                              "--block-size: 48 must be a power of two >= 4 (slot = block_id * block_size + offset; "
                              "an indexer-K cache block holds block_size * 132 bytes, which must be a multiple of 16)"},
                      BadFlag{{"bench-fence", "--backend", "cpu", "--iters", "3"}, {"--layers", "0"}, "bench-fence",
                              "--layers: must be >= 1, got 0"}),
    [](const ::testing::TestParamInfo<BadFlag>& i) { return std::string(i.param.cmd[0] == 'm' ? "mp_publish"
                                                                                                : "bench_fence"); });

// A CLI11 parse error (an unknown flag) on one rank is carried the same way: the rank knows its rank variables.
TEST(BadArgumentOnOneRank, AParseErrorIsNamedOnEveryRankWithinSeconds) {
  const std::vector<std::string> extra[2] = {{}, {"--no-such-flag"}};
  const auto out = two_ranks({"bench-fence", "--backend", "cpu", "--iters", "3"}, extra);
  for (int r = 0; r < 2; ++r) {
    const test::CliResult& o = out[static_cast<size_t>(r)];
    EXPECT_EQ(o.exit_code, 2) << describe(o);
    EXPECT_NE(o.output.find(fmt::format("pcpkv: error: bench-fence rank {}: the argument check failed on 1 of 2 ranks "
                                        "(every rank refuses; nothing was allocated or written): rank 1: The following "
                                        "argument was not expected: --no-such-flag\n",
                                        r)),
              std::string::npos)
        << describe(o);
    EXPECT_LT(o.seconds, 20.0) << describe(o);
  }
}

// torchrun-style without PCPKV_JOB_ID: rank 1's other --seed gives it another job token (the command line's hash),
// so rank 0 refuses it; it claims rank 1 of this world and no other rank 1 follows, so rank 0 names it within its
// grace (5 s) instead of waiting out the 60 s timeout. (Another job's rank 1 followed by this job's own:
// launch_cli.cpp's TwoTorchrunJobsOnOnePortNeverMeet.)
TEST(RefusedPeer, ThisJobsRankWithAnotherCommandLineIsNamedWithinSeconds) {
  const std::vector<std::string> extra[2] = {{"--seed", "0"}, {"--seed", "7"}};
  const auto out = two_ranks({"mp-publish", "--backend", "cpu", "--tokens", "64", "--no-check"}, extra, false);
  EXPECT_EQ(out[1].exit_code, 4) << describe(out[1]);
  EXPECT_NE(out[1].output.find("job token mismatch"), std::string::npos) << out[1].output;
  EXPECT_EQ(out[0].exit_code, 4) << describe(out[0]);
  EXPECT_LT(out[0].seconds, 20.0) << describe(out[0]);
  EXPECT_NE(out[0].output.find("rank 1 of world size 2 never connected, but pid "), std::string::npos) << out[0].output;
  EXPECT_NE(out[0].output.find("claiming rank 1 was refused 5 s ago for a wrong job token"), std::string::npos)
      << out[0].output;
  // Both jobs, by their command lines.
  EXPECT_NE(out[0].output.find("--seed 7'', this rank 0 to job 'MASTER_PORT"), std::string::npos) << out[0].output;
  EXPECT_NE(out[0].output.find("--seed 0''"), std::string::npos) << out[0].output;
}

}  // namespace
}  // namespace pcpkv
