// `pcpkv launch` with CPU rank processes (CI): the launcher, mp-publish with 2, 4 and 8 processes byte for
// byte against the single-process CPU reference, TP2 x PCP2, a rank killed mid-run, the leak check,
// torchrun-style variables, bad rendezvous, and bench-fence.
#include <gtest/gtest.h>

#include <random>

#include "cli_runner.h"

namespace pcpkv {
namespace {

using test::clean_env;
using test::count_occurrences;
using test::describe;
using test::run_program;

class LaunchCpu : public ::testing::TestWithParam<int> {};

TEST_P(LaunchCpu, ThirteenTokensPerRankEveryTransportByteIdentical) {
  // 12 prefill tokens per rank + one decode replicated on every rank = 13 local tokens per rank (only rank
  // 0's decode copy writes), padded stride-free caches at a nonzero offset, top-k fill.
  const int n = GetParam();
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--timeout", "60", "--", "mp-publish",
                              "--backend", "cpu", "--tokens", std::to_string(12 * n), "--decodes", "1",
                              "--block-size", "16", "--base-offset", "48", "--topk-width", "64", "--seed", "5"},
                             240, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "guard bytes untouched: PASS"), 3) << r.output;
  EXPECT_NE(r.output.find(fmt::format("(max 13 per rank)")), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 0]   verdict: PASS"), std::string::npos) << r.output;
}
INSTANTIATE_TEST_SUITE_P(Procs, LaunchCpu, ::testing::Values(2, 4, 8));

TEST(LaunchCpuMisc, UnevenRanksSharedLayerStaticFp8) {
  const auto r = run_program({"launch", "--nproc", "3", "--", "mp-publish", "--backend", "cpu", "--model",
                              "deepseek-v3.2", "--tokens", "43", "--decodes", "2", "--block-size", "8", "--kv-format",
                              "fp8", "--k-scale", "0.05", "--layer", "shared"},
                             240, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
}

TEST(LaunchCpuMisc, Tp2Pcp2GroupsPublishIndependently) {
  const auto r = run_program({"launch", "--nproc", "4", "--", "mp-publish", "--backend", "cpu", "--tp", "2",
                              "--tokens", "30", "--decodes", "2", "--block-size", "16"},
                             240, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  // Two group leaders (global ranks 0 and 2), each checking its own group of two.
  EXPECT_NE(r.output.find("[rank 0] pcpkv mp-publish: 4 processes, TP 2 x PCP 2; PCP group 0 = global ranks 0..1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 2] pcpkv mp-publish: 4 processes, TP 2 x PCP 2; PCP group 1 = global ranks 2..3"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 6) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "verdict: PASS"), 2) << r.output;
}

TEST(LaunchCpuMisc, KilledRankIsReportedAndEveryoneExitsNonzeroWithinTheTimeout) {
  constexpr double kFenceTimeoutS = 20.0;
  const auto r = run_program({"launch", "--nproc", "4", "--grace", "40", "--", "mp-publish", "--backend", "cpu",
                              "--transport", "direct", "--tokens", "64", "--kill-rank", "2", "--fence-timeout-ms",
                              "20000"},
                             120, clean_env());
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_NE(r.output.find("pcpkv launch: rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  for (int rank : {0, 1, 3}) {
    EXPECT_NE(r.output.find(fmt::format("[rank {}] pcpkv mp-publish: rank {}: error:", rank, rank)), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(fmt::format("pcpkv launch: rank {} (pid", rank)), std::string::npos) << r.output;
  }
  EXPECT_GE(count_occurrences(r.output, "is gone (exited or killed)"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "exited with code 4"), 3) << r.output;
  EXPECT_LT(r.seconds, kFenceTimeoutS) << r.output;
}

TEST(LaunchCpuMisc, LeakCheckPasses) {
  const auto r = run_program({"launch", "--nproc", "4", "--", "mp-publish", "--backend", "cpu", "--tokens", "40",
                              "--leak-check"},
                             240, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("leak check (rank 0): PASS"), std::string::npos) << r.output;
}

TEST(LaunchCpuMisc, TorchrunStyleVariables) {
  // Two processes started by hand the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT).
  test::TempDir dir;
  std::mt19937 rng(std::random_device{}());
  const std::string port = std::to_string(20000 + rng() % 40000);
  std::vector<test::CliResult> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      auto env = clean_env();
      env.push_back({"RANK", std::to_string(r)});
      env.push_back({"WORLD_SIZE", "2"});
      env.push_back({"LOCAL_RANK", std::to_string(r)});
      env.push_back({"MASTER_ADDR", "127.0.0.1"});
      env.push_back({"MASTER_PORT", port});
      env.push_back({"PCPKV_BOOTSTRAP_DIR", dir.path});
      out[r] = run_program({"mp-publish", "--backend", "cpu", "--tokens", "20", "--transport", "staging"}, 120, env);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(out[0].exit_code, 0) << describe(out[0]) << describe(out[1]);
  EXPECT_EQ(out[1].exit_code, 0) << describe(out[1]);
  EXPECT_NE(out[0].output.find("verdict: PASS"), std::string::npos) << out[0].output;
}

TEST(LaunchCpuMisc, WrongTokenAndWorldSizeMismatchGiveClearErrors) {
  test::TempDir dir;
  const std::string sock = dir.path + "/rv.sock";
  auto start = [&](int rank, int world, const std::string& token) {
    auto env = clean_env();
    env.push_back({"PCPKV_RANK", std::to_string(rank)});
    env.push_back({"PCPKV_WORLD_SIZE", std::to_string(world)});
    env.push_back({"PCPKV_BOOTSTRAP", sock});
    env.push_back({"PCPKV_JOB_TOKEN", token});
    env.push_back({"PCPKV_BOOTSTRAP_TIMEOUT_S", "3"});
    return run_program({"mp-publish", "--backend", "cpu", "--tokens", "8"}, 60, env);
  };
  {
    std::vector<test::CliResult> out(2);
    std::thread a([&] { out[0] = start(0, 2, "job-a"); });
    std::thread b([&] { out[1] = start(1, 2, "job-b"); });
    a.join();
    b.join();
    EXPECT_EQ(out[1].exit_code, 4) << describe(out[1]);
    EXPECT_NE(out[1].output.find("job token mismatch"), std::string::npos) << out[1].output;
    EXPECT_EQ(out[0].exit_code, 4) << describe(out[0]);
    EXPECT_NE(out[0].output.find("never connected; refused 1 connection(s)"), std::string::npos) << out[0].output;
  }
  {
    std::vector<test::CliResult> out(2);
    std::thread a([&] { out[0] = start(0, 2, "job"); });
    std::thread b([&] { out[1] = start(1, 3, "job"); });
    a.join();
    b.join();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(out[r].exit_code, 4) << describe(out[r]);
      EXPECT_NE(out[r].output.find("world size mismatch: rank 1"), std::string::npos) << out[r].output;
    }
  }
}

TEST(LaunchCpuMisc, LauncherRelaysOutputAndExitCodes) {
  auto r = run_program({"launch", "--nproc", "3", "--program", "/bin/sh", "--", "-c",
                        "echo hello from $PCPKV_RANK of $PCPKV_WORLD_SIZE; test $PCPKV_RANK != 1"},
                       60, clean_env());
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  for (int k = 0; k < 3; ++k)
    EXPECT_NE(r.output.find(fmt::format("[rank {}] hello from {} of 3", k, k)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pcpkv launch: rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 of 3 rank(s) failed"), std::string::npos) << r.output;
  // GPUs round-robin: with --gpus 0,1 the ranks see 0, 1, 0.
  r = run_program({"launch", "--nproc", "3", "--gpus", "0,1", "--program", "/bin/sh", "--", "-c",
                   "echo device $PCPKV_DEVICE"},
                  60, clean_env());
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("[rank 2] device 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] device 1"), std::string::npos) << r.output;
}

TEST(LaunchCpuMisc, BadUsage) {
  auto r = run_program({"launch", "--nproc", "0", "--", "mp-publish"}, 30, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.output.find("--nproc must be in [1, 1024], got 0"), std::string::npos) << r.output;
  r = run_program({"launch", "--nproc", "2"}, 30, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.output.find("launch: no command"), std::string::npos) << r.output;
  r = run_program({"launch", "--nproc", "2", "--", "mp-publish", "--tp", "3"}, 60, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.output.find("--tp 3 does not divide the world size 2"), std::string::npos) << r.output;
}

TEST(LaunchCpuMisc, BenchFenceCpu) {
  const auto r = run_program({"launch", "--nproc", "2", "--output", "rank0", "--", "bench-fence", "--backend", "cpu",
                              "--layers", "8", "--iters", "5", "--warmup", "1"},
                             120, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("fence latency per layer"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace pcpkv
