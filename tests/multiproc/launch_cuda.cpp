// pcpkv-test-labels: serial gpu
// `pcpkv launch` with CUDA rank processes on ONE GPU (the device machine): 2, 4 and 8 processes, byte
// oracle against the single-process CPU reference with 13 tokens per rank, guard bytes, CUDA-graph capture
// and >= 100 replays (the fence epochs advance on every replay), TP2 x PCP2, a rank killed mid-run, the leak
// check, NCCL's refusal of ranks that share a GPU and NCCL with one rank, and bench-fence.
// Every test skips, saying why, when the CLI cannot use a GPU here.
#include <gtest/gtest.h>

#include "support/cli_runner.h"

namespace pcpkv {
namespace {

using test::clean_env;
using test::count_occurrences;
using test::describe;
using test::run_program;

// Asks the CLI itself (a fresh process: this test process never touches CUDA) whether it can use a GPU.
const std::string& cuda_unavailable_reason() {
  static const std::string reason = [] {
    const auto r = run_program({"mp-publish", "--backend", "cuda", "--tokens", "4", "--decodes", "0", "--transport",
                                "direct", "--no-check"},
                               120, clean_env());
    if (r.exit_code == 0) return std::string();
    const auto pos = r.output.find("--backend cuda: unavailable:");
    if (pos != std::string::npos) return r.output.substr(pos, r.output.find('\n', pos) - pos);
    return "the CUDA probe run failed: " + r.output;
  }();
  return reason;
}

#define SKIP_WITHOUT_GPU()                                                          \
  do {                                                                              \
    if (!cuda_unavailable_reason().empty()) GTEST_SKIP() << cuda_unavailable_reason(); \
  } while (0)

class LaunchCudaOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(LaunchCudaOneGpu, ThirteenTokensPerRankByteIdenticalWithGraphReplays) {
  SKIP_WITHOUT_GPU();
  const int n = GetParam();
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--gpus", "0", "--", "mp-publish", "--backend",
                              "cuda", "--tokens", std::to_string(12 * n), "--decodes", "1", "--block-size", "16",
                              "--base-offset", "48", "--topk-width", "64", "--graph-replays", "100",
                              "--fence-timeout-ms", "60000"},
                             600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "guard bytes untouched: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "replayed 100 times"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "epochs advanced every replay: PASS"), 3) << r.output;
  EXPECT_NE(r.output.find("(max 13 per rank)"), std::string::npos) << r.output;
}
INSTANTIATE_TEST_SUITE_P(Procs, LaunchCudaOneGpu, ::testing::Values(2, 4, 8));

TEST(LaunchCuda, Tp2Pcp2OnOneGpu) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "4", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--tp", "2", "--tokens", "30", "--decodes", "2", "--block-size", "16"},
                             600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 6) << r.output;
}

TEST(LaunchCuda, KilledRankIsReportedWithinTheTimeout) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "4", "--gpus", "0", "--grace", "60", "--", "mp-publish",
                              "--backend", "cuda", "--transport", "direct", "--tokens", "64", "--kill-rank", "1",
                              "--fence-timeout-ms", "30000"},
                             300, clean_env());
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  EXPECT_GE(count_occurrences(r.output, "rank 1 (pid"), 3 + 1) << r.output;  // 3 survivors + the launcher
  EXPECT_GE(count_occurrences(r.output, "is gone (exited or killed)"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "exited with code 4"), 3) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
}

TEST(LaunchCuda, LeakCheck) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "2", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--tokens", "40", "--leak-check"},
                             600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("leak check (rank 0): PASS"), std::string::npos) << r.output;
}

TEST(LaunchCuda, NcclRefusesRanksSharingAGpu) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "2", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--transport", "collect", "--collect-via", "nccl", "--tokens", "16"},
                             300, clean_env());
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "collect over NCCL needs one GPU per rank: ranks 0, 1 all use GPU-"), 2)
      << r.output;
  EXPECT_NE(r.output.find("use the staging or direct transport"), std::string::npos) << r.output;
}

TEST(LaunchCuda, NcclCollectWithOneRank) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"mp-publish", "--backend", "cuda", "--transport", "collect", "--collect-via", "nccl",
                              "--tokens", "40", "--decodes", "2"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 1) << r.output;
}

TEST(LaunchCuda, CollectWithP2pAllGathersOnOneGpu) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "4", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--transport", "collect", "--tokens", "50", "--decodes", "1", "--layer", "shared"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 1) << r.output;
}

TEST(LaunchCuda, BenchFence) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "2", "--gpus", "0", "--output", "rank0", "--", "bench-fence",
                              "--backend", "cuda", "--layers", "8", "--iters", "5", "--warmup", "1"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("fence latency per layer"), std::string::npos) << r.output;
}

// Processes sharing one GPU time-slice it (no MPS): a fence costs milliseconds. bench-fence scales its
// iterations to its time budget, finishes, and says that the number measures context switches.
class BenchFenceSharedGpu : public ::testing::TestWithParam<int> {};
TEST_P(BenchFenceSharedGpu, FinishesWithinItsTimeBudgetAndSaysWhy) {
  SKIP_WITHOUT_GPU();
  const int n = GetParam();
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--gpus", "0", "--output", "rank0", "--",
                              "bench-fence", "--backend", "cuda", "--layers", "61", "--iters", "50", "--time-budget",
                              "10"},
                             120, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("fence latency per layer"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(fmt::format("up to {} processes share one GPU", n)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("context switches, not the fence"), std::string::npos) << r.output;
  // The budget bounds the measurement; process start-up, CUDA contexts and the probe come on top.
  EXPECT_LT(r.seconds, 45.0) << r.output;
}
INSTANTIATE_TEST_SUITE_P(Procs, BenchFenceSharedGpu, ::testing::Values(2, 4, 8));

}  // namespace
}  // namespace pcpkv
