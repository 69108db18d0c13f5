// pcpkv-test-labels: multigpu
// Rank processes on DISTINCT GPUs: `pcpkv launch --gpus 0,1,..` with one process per GPU, so every
// P2P store, fence signal and all-gather crosses NVLink. Byte oracle of every transport against the
// single-process CPU reference (collect through NCCL and through P2P reads), staging == direct, CUDA-graph
// replays, TP2 x PCP2, the fence (latency and a killed rank), and the all-reduce against its CPU oracle.
// Every test skips, saying why, with fewer than 2 GPUs (or fewer than it needs).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "support/cli_runner.h"
#include "pcpkv/publish/cuda.h"

namespace pcpkv {
namespace {

using test::clean_env;
using test::count_occurrences;
using test::describe;
using test::run_program;

// Visible GPUs (the test process itself only asks the runtime for the count; ranks are fresh processes).
int num_gpus(std::string* why) {
  static std::string reason;
  static const int n = cuda::device_count(&reason);
  *why = reason;
  return n;
}

// "0,1,...,n-1", the --gpus list of n GPUs. Appended piece by piece: prepending the separator to a temporary
// (`(d ? "," : "") + std::to_string(d)`, operator+(const char*, string&&)) made GCC 12 warn -Wrestrict inside
// basic_string::insert (a false positive of its inlined memcpy bounds, but a warning in every CUDA build).
std::string gpu_list(int n) {
  std::string s;
  for (int d = 0; d < n; ++d) {
    if (d > 0) s += ',';
    s += std::to_string(d);
  }
  return s;
}

#define SKIP_WITHOUT_GPUS(need)                                                                          \
  do {                                                                                                   \
    std::string why_;                                                                                    \
    const int have_ = num_gpus(&why_);                                                                   \
    if (have_ < (need))                                                                                  \
      GTEST_SKIP() << fmt::format("needs {} GPUs (one per rank process), {} visible{}", (need), have_,    \
                                  why_.empty() ? "" : ": " + why_);                                      \
  } while (0)

class PublishAcrossGpus : public ::testing::TestWithParam<int> {};

TEST_P(PublishAcrossGpus, EveryTransportMatchesTheCpuReferenceByteForByte) {
  const int p = GetParam();
  SKIP_WITHOUT_GPUS(p);
  // 12 p + 1 tokens (uneven: at most 13 per rank), a decode, guard bytes, a base offset, a top-k fill;
  // collect's all-gathers through NCCL (one GPU per rank).
  const auto r = run_program({"launch", "--nproc", std::to_string(p), "--gpus", gpu_list(p), "--output", "rank0", "--",
                              "mp-publish", "--backend", "cuda", "--tokens", std::to_string(12 * p), "--decodes",
                              "1", "--block-size", "16", "--base-offset", "48", "--topk-width", "64", "--collect-via",
                              "nccl", "--repeats", "3", "--warmup", "1", "--threads", "4"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "guard bytes untouched: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "rank 0 q_c_out / top-k == reference: PASS"), 3) << r.output;
  EXPECT_NE(r.output.find("staging == direct (every replica"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("staging == direct (every replica, FNV-64 0000000000000000)"), std::string::npos);
  EXPECT_NE(r.output.find("(max 13 per rank)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("verdict: PASS"), std::string::npos) << r.output;
}

// --transport auto across GPUs (SPEC section 5.1): direct when every pair of the GPUs has CUDA P2P access (NVLink),
// else collect over NCCL; either way the reason is printed and the bytes match the CPU reference. Round-robin
// decodes and vLLM's local order ride along (SPEC section 4.1).
TEST_P(PublishAcrossGpus, AutoTransportSaysWhatItChoseAndPasses) {
  const int p = GetParam();
  SKIP_WITHOUT_GPUS(p);
  const auto r = run_program({"launch", "--nproc", std::to_string(p), "--gpus", gpu_list(p), "--output", "rank0", "--",
                              "mp-publish", "--backend", "cuda", "--tokens", std::to_string(12 * p), "--decodes",
                              std::to_string(p + 1), "--block-size", "16", "--transport", "auto", "--local-order",
                              "local", "--decode-ownership", "round_robin"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::string want_direct = "--transport auto: direct: all " + std::to_string(p) + " ranks";
  const bool direct = r.output.find(want_direct) != std::string::npos;
  const bool collect = r.output.find("--transport auto: collect over NCCL: rank ") != std::string::npos;
  EXPECT_TRUE(direct != collect) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 1) << r.output;
  EXPECT_NE(r.output.find("verdict: PASS"), std::string::npos) << r.output;
}

TEST_P(PublishAcrossGpus, ASharedLayerAtThirtyTwoKTokens) {
  // A realistic size once per world (GLM-5 dims, fp8, IndexShare shared layer: MLA cache only).
  const int p = GetParam();
  SKIP_WITHOUT_GPUS(p);
  const auto r = run_program({"launch", "--nproc", std::to_string(p), "--gpus", gpu_list(p), "--output", "rank0", "--",
                              "mp-publish", "--backend", "cuda", "--tokens", "32768", "--decodes", "4", "--kv-format",
                              "fp8", "--layer", "shared", "--threads", "8"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
}
INSTANTIATE_TEST_SUITE_P(Ranks, PublishAcrossGpus, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return fmt::format("Pcp{}", info.param); });

TEST(MultiGpu, CollectWithP2pReadsAcrossGpus) {
  SKIP_WITHOUT_GPUS(2);
  std::string why;
  const int n = num_gpus(&why);
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--gpus", gpu_list(n), "--output", "rank0", "--",
                              "mp-publish", "--backend", "cuda", "--transport", "collect", "--collect-via", "p2p",
                              "--tokens", std::to_string(13 * n), "--decodes", "2", "--block-size", "16"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 1) << r.output;
}

TEST(MultiGpu, GraphReplaysAdvanceTheEpochsAcrossGpus) {
  SKIP_WITHOUT_GPUS(2);
  const auto r = run_program({"launch", "--nproc", "2", "--gpus", "0,1", "--output", "rank0", "--", "mp-publish",
                              "--backend", "cuda", "--tokens", "25", "--decodes", "1", "--block-size", "16",
                              "--collect-via", "nccl", "--graph-replays", "100"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replayed 100 times"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "epochs advanced every replay: PASS"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 3) << r.output;
}

TEST(MultiGpu, Tp2Pcp2StaysInsideEachPcpGroup) {
  SKIP_WITHOUT_GPUS(4);
  const auto r = run_program({"launch", "--nproc", "4", "--gpus", "0,1,2,3", "--", "mp-publish", "--backend", "cuda",
                              "--tp", "2", "--tokens", "30", "--decodes", "2", "--block-size", "16"},
                             300, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 6) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "verdict: PASS"), 2) << r.output;
}

TEST(MultiGpu, FenceLatencyAcrossGpusIsMicroseconds) {
  SKIP_WITHOUT_GPUS(2);
  std::string why;
  const int n = num_gpus(&why);
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--gpus", gpu_list(n), "--output", "rank0", "--",
                              "bench-fence", "--backend", "cuda", "--layers", "61", "--iters", "20"},
                             120, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.output.find("share one GPU"), std::string::npos) << r.output;
  const std::string key = "fence latency per layer (median over ranks of each rank's median): ";
  const auto pos = r.output.find(key);
  ASSERT_NE(pos, std::string::npos) << r.output;
  const double us = std::strtod(r.output.c_str() + pos + key.size(), nullptr);
  // A sanity bound, not a performance goal: NVLink fences take microseconds; time-slicing takes milliseconds.
  EXPECT_GT(us, 0.0) << r.output;
  EXPECT_LT(us, 500.0) << r.output;
}

TEST(MultiGpu, AKilledRankIsNamedAcrossGpus) {
  SKIP_WITHOUT_GPUS(2);
  std::string why;
  const int n = num_gpus(&why);
  const auto r = run_program({"launch", "--nproc", std::to_string(n), "--gpus", gpu_list(n), "--grace", "60", "--",
                              "mp-publish", "--backend", "cuda", "--transport", "direct", "--tokens", "64",
                              "--kill-rank", "1", "--fence-timeout-ms", "30000"},
                             300, clean_env());
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.output;
  EXPECT_GE(count_occurrences(r.output, "is gone (exited or killed)"), n - 1) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "exited with code 4"), n - 1) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
}

TEST(MultiGpu, AllReduceMatchesTheCpuOracleAcrossGpus) {
  SKIP_WITHOUT_GPUS(2);
  std::string why;
  const int n = std::min(num_gpus(&why), 8);
  std::vector<int> worlds = {2};
  if (n > 2) worlds.push_back(n);
  for (int w : worlds) {
    const auto r = run_program({"launch", "--nproc", std::to_string(w), "--gpus", gpu_list(w), "--output", "rank0",
                                "--", "bench-allreduce", "--bytes", "8192,65536,1048576,4194304", "--repeats", "2"},
                               180, clean_env());
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    EXPECT_NE(r.output.find("verdict: PASS"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("symmetric memory REFUSED"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("FAIL"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace pcpkv
