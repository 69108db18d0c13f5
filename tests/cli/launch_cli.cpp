// pcpkv-test-labels: multiproc
// `pcpkv launch` with CPU rank processes (CI): the launcher, mp-publish with 2, 4 and 8 processes byte for
// byte against the single-process CPU reference, TP2 x PCP2, a rank killed mid-run, the leak check,
// torchrun-style variables, bad rendezvous, and bench-fence.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "support/cli_runner.h"

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
INSTANTIATE_TEST_SUITE_P(Procs, LaunchCpu, ::testing::Values(2, 4, 8), ::testing::PrintToStringParamName());

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
    EXPECT_NE(r.output.find(fmt::format("[rank {}] pcpkv: error: mp-publish rank {}: ", rank, rank)), std::string::npos)
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
  const std::string port = test::random_port();
  std::vector<test::CliResult> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      auto env = test::torchrun_env(r, 2, port, dir.path);
      env.push_back({"LOCAL_RANK", std::to_string(r)});
      out[r] = run_program({"mp-publish", "--backend", "cpu", "--tokens", "20", "--transport", "staging"}, 120, env);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(out[0].exit_code, 0) << describe(out[0]) << describe(out[1]);
  EXPECT_EQ(out[1].exit_code, 0) << describe(out[1]);
  EXPECT_NE(out[0].output.find("verdict: PASS"), std::string::npos) << out[0].output;
}

// A switch with an odd value is bad input: exit 2 and one line naming it, inside a torchrun-style rank
// (PCPKV_ALLOW_NONLOCAL_MASTER, read with the rank's variables) as at the top level (PCPKV_CHECK_REPLICAS, read by
// every command), not the 4 of a failed rendezvous. Under `pcpkv launch` the ranks meet through PCPKV_BOOTSTRAP,
// never MASTER_ADDR, so nothing reads PCPKV_ALLOW_NONLOCAL_MASTER there.
TEST(LaunchCpuMisc, AnOddSwitchIsBadInputInsideARankAsAtTheTopLevel) {
  const std::string line = "must be 1 (on) or 0 / empty / unset (off), got 'yes'\n";
  auto env = clean_env();
  env.push_back({"PCPKV_CHECK_REPLICAS", "yes"});
  auto r = run_program({"run", "--tokens", "16", "--decodes", "0", "--pcp", "2"}, 60, env);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.output.find("pcpkv: error: PCPKV_CHECK_REPLICAS: " + line), std::string::npos) << r.output;
  env = clean_env();
  env.push_back({"RANK", "0"});
  env.push_back({"WORLD_SIZE", "1"});
  env.push_back({"MASTER_PORT", "29500"});
  env.push_back({"PCPKV_ALLOW_NONLOCAL_MASTER", "yes"});
  r = run_program({"mp-publish", "--backend", "cpu", "--tokens", "8"}, 60, env);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_EQ(r.output, "pcpkv: error: mp-publish rank 0: PCPKV_ALLOW_NONLOCAL_MASTER: " + line) << describe(r);
  env = clean_env();
  env.push_back({"PCPKV_ALLOW_NONLOCAL_MASTER", "yes"});
  r = run_program({"launch", "--nproc", "2", "--", "mp-publish", "--backend", "cpu", "--tokens", "8"}, 120, env);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
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

TEST(LaunchCpuMisc, KilledRankIsTheFirstFailureWhenAPeerExitsInTheSameSweep) {
  // Rank 1 kills itself; rank 0 exits 4 the moment rank 1 is a zombie (as a rank that notices a dead peer does),
  // so the launcher almost always reaps both in one sweep, rank 0 first by index. The exit code must still be
  // rank 1's 128 + SIGKILL: within a sweep the ranks a signal ended are the cause (this failed ~3% of runs before).
  test::TempDir dir;
  const std::string script = fmt::format(
      "if [ $PCPKV_RANK = 1 ]; then echo $$ > {0}/pid.tmp && mv {0}/pid.tmp {0}/pid && kill -9 $$; fi; "
      "while [ ! -e {0}/pid ]; do sleep 0.001; done; p=$(cat {0}/pid); "
      "while [ -e /proc/$p ] && [ \"$(cut -d' ' -f3 /proc/$p/stat 2>/dev/null)\" != Z ]; do sleep 0.001; done; exit 4",
      dir.path);
  const auto r = run_program({"launch", "--nproc", "2", "--grace", "20", "--program", "/bin/sh", "--", "-c", script},
                             60, clean_env());
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_NE(r.output.find("the first was rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 4"), std::string::npos) << r.output;
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

// Two torchrun-style jobs (other seeds) on one MASTER_PORT met: one rank 0 reported corrupted guard bytes,
// the other hung. Now: job A runs untouched; job B's rank 1, arriving at job A's rank 0, is refused with a
// message naming both jobs; job B's rank 0 is refused at once because the port is in use.
TEST(LaunchCpuMisc, TwoTorchrunJobsOnOnePortNeverMeet) {
  test::TempDir dir;
  const std::string port = test::random_port();
  auto start = [&](int rank, const char* seed) {
    auto env = test::torchrun_env(rank, 2, port, dir.path);
    env.push_back({"PCPKV_BOOTSTRAP_TIMEOUT_S", "20"});
    return run_program({"mp-publish", "--backend", "cpu", "--tokens", "20", "--transport", "direct", "--seed", seed},
                       120, env);
  };
  test::CliResult a0, a1, b0, b1;
  std::thread ta0([&] { a0 = start(0, "1"); });
  // In this order, each step done before the next: job A's rank 0 listens, job B's rank 1 meets it, job
  // B's rank 0 tries the port, job A's rank 1 joins its own rank 0.
  const std::string sock = fmt::format("{}/pcpkv-{}/port{}.sock", dir.path, ::geteuid(), port);
  for (int i = 0; i < 3000 && !std::filesystem::exists(sock); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!std::filesystem::exists(sock)) {
    ta0.join();
    FAIL() << "job A's rank 0 never listened: " << describe(a0);
  }
  b1 = start(1, "2");
  b0 = start(0, "2");
  a1 = start(1, "1");
  ta0.join();
  EXPECT_EQ(a0.exit_code, 0) << describe(a0) << describe(a1);
  EXPECT_EQ(a1.exit_code, 0) << describe(a1);
  EXPECT_NE(a0.output.find("verdict: PASS"), std::string::npos) << a0.output;
  EXPECT_EQ(b1.exit_code, 4) << describe(b1);
  EXPECT_NE(b1.output.find("pcpkv: error: mp-publish rank 1: bootstrap: rank 0 (pid"), std::string::npos)
      << b1.output;
  EXPECT_NE(b1.output.find("job token mismatch"), std::string::npos) << b1.output;
  EXPECT_NE(b1.output.find("--seed 2'"), std::string::npos) << b1.output;  // this job
  EXPECT_NE(b1.output.find("--seed 1'"), std::string::npos) << b1.output;  // the job it met
  EXPECT_EQ(b0.exit_code, 4) << describe(b0);
  EXPECT_NE(b0.output.find("in use by the rank 0 of another job"), std::string::npos) << b0.output;
  EXPECT_NE(b0.output.find(fmt::format("MASTER_PORT {}", port)), std::string::npos) << b0.output;
  EXPECT_LT(b0.seconds, 15.0) << b0.output;  // at once, not after the 20 s timeout
  for (const test::CliResult* r : {&a0, &a1, &b0, &b1}) {
    EXPECT_EQ(r->output.find("FAIL"), std::string::npos) << r->output;  // no corrupted replica or guard byte
  }
}

// A --socket-dir too long for a Unix socket path was caught only inside each rank.
TEST(LaunchCpuMisc, TooLongSocketDirIsRefusedBeforeAnyRankStarts) {
  const std::string dir = "/tmp/" + std::string(90, 'd');
  const auto r = run_program({"launch", "--nproc", "2", "--socket-dir", dir, "--program", "/bin/sh", "--", "-c",
                              "echo started"},
                             30, clean_env());
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_EQ(r.output.rfind("pcpkv: error: --socket-dir: '", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("is too long (95 bytes)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("started"), std::string::npos) << r.output;
}

// `--gpus` with `--backend cpu` was accepted silently.
TEST(LaunchCpuMisc, GpusWithTheCpuBackendGetANote) {
  const auto r = run_program({"launch", "--nproc", "2", "--gpus", "0", "--", "mp-publish", "--backend", "cpu",
                              "--tokens", "8", "--transport", "direct"},
                             120, clean_env());
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("pcpkv launch: note: --gpus 0 is not used: the ranks run --backend cpu"),
            std::string::npos)
      << r.output;
}

// `kill -9` of launch left its private rendezvous directory: the next launch removes this user's
// directories whose launcher is gone, and keeps those of a live one.
TEST(LaunchCpuMisc, StaleLaunchDirectoriesAreRemoved) {
  test::TempDir parent;
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  for (const auto& [name, pid] : {std::pair<std::string, long>{"pcpkv-launch-dead01", dead},
                                  {"pcpkv-launch-live01", static_cast<long>(::getpid())}}) {
    std::filesystem::create_directories(parent.path + "/" + name);
    std::ofstream(parent.path + "/" + name + "/launcher.pid") << pid << "\n";
  }
  std::filesystem::create_directories(parent.path + "/pcpkv-launch-nopid1");  // being set up: kept
  const auto r = run_program({"launch", "--nproc", "1", "--socket-dir", parent.path, "--program", "/bin/sh", "--",
                              "-c", "true"},
                             30, clean_env());
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_FALSE(std::filesystem::exists(parent.path + "/pcpkv-launch-dead01"));
  EXPECT_TRUE(std::filesystem::exists(parent.path + "/pcpkv-launch-live01"));
  EXPECT_TRUE(std::filesystem::exists(parent.path + "/pcpkv-launch-nopid1"));
  int left = 0;  // the launch's own directory is gone too
  for (const auto& e : std::filesystem::directory_iterator(parent.path)) left += e.is_directory();
  EXPECT_EQ(left, 2);
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
