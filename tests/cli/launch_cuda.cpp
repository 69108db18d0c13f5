// pcpkv-test-labels: multiproc serial gpu
// `pcpkv launch` with CUDA rank processes on ONE GPU (the device machine): 2, 4 and 8 processes, byte
// oracle against the single-process CPU reference with 13 tokens per rank, guard bytes, CUDA-graph capture
// and >= 100 replays (the fence epochs advance on every replay), TP2 x PCP2, a rank killed mid-run, the leak
// check, NCCL's refusal of ranks that share a GPU and NCCL with one rank, and bench-fence.
// Every test skips, saying why, when the CLI cannot use a GPU here.
#include <gtest/gtest.h>

#include <sstream>

#include <nlohmann/json.hpp>

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
INSTANTIATE_TEST_SUITE_P(Procs, LaunchCudaOneGpu, ::testing::Values(2, 4, 8), ::testing::PrintToStringParamName());

// Plan modes (SPEC section 4.1) and --transport auto (5.1) with CUDA ranks on one GPU: every rank reaches every
// replica (one device), so auto picks direct and says why; vLLM's local order and round-robin decodes (rank 2
// owns none of the 2 decodes) publish the single-process CPU reference's bytes.
TEST(LaunchCuda, PlanModesAndAutoTransportOnOneGpu) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "3", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--tokens", "61", "--decodes", "2", "--block-size", "16", "--transport", "auto",
                              "--local-order", "local", "--decode-ownership", "round_robin"},
                             600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.output.find("--transport auto: direct: all 3 ranks on host"), std::string::npos) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 1) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "guard bytes untouched: PASS"), 1) << r.output;
}

TEST(LaunchCuda, Tp2Pcp2OnOneGpu) {
  SKIP_WITHOUT_GPU();
  const auto r = run_program({"launch", "--nproc", "4", "--gpus", "0", "--", "mp-publish", "--backend", "cuda",
                              "--tp", "2", "--tokens", "30", "--decodes", "2", "--block-size", "16"},
                             600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replicas == single-process CPU reference: PASS"), 6) << r.output;
}

// The run-time replica check with CUDA ranks (the slot-hash kernel on each rank's own replica, one exchange): after
// every transport's run and after its graph replays it passes; a rank that corrupts one byte of its replica is
// named with the slot, and every rank exits 1 (--no-check: only the replica check can see it).
TEST(LaunchCuda, ReplicaCheckPassesAndNamesACorruptedRank) {
  SKIP_WITHOUT_GPU();
  auto r = run_program({"launch", "--nproc", "3", "--gpus", "0", "--", "mp-publish", "--backend", "cuda", "--tokens",
                        "200", "--decodes", "2", "--block-size", "16", "--graph-replays", "3", "--check-replicas"},
                       600, clean_env());
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(count_occurrences(r.output, "replica check: PASS (3 replicas x 202 written slots"), 6) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "after 3 graph replays)"), 3) << r.output;
  r = run_program({"launch", "--nproc", "3", "--gpus", "0", "--", "mp-publish", "--backend", "cuda", "--tokens", "200",
                   "--block-size", "16", "--transport", "direct", "--check-replicas", "--corrupt-rank", "1",
                   "--no-check"},
                  600, clean_env());
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_NE(r.output.find("replica check: FAIL (layer 0 (direct): rank 1 differs from rank 0 at slot "),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_occurrences(r.output, "exited with code 1"), 3) << r.output;
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

// The JSON object `mp-publish --json` printed (rank 0's stdout; the tables on stderr are dropped by the shell).
nlohmann::json mp_publish_json(const std::string& output) {
  const auto at = output.find("{\n  \"backend\"");
  if (at == std::string::npos) return {};
  std::istringstream in(output.substr(at));
  nlohmann::json j;
  in >> j;  // one value; anything after it is not JSON
  return j;
}

// The CUDA per-process publisher reports the transport tables' stages: the same names, in the same order, as
// the CPU per-process publisher, and bytes (each rank's share, summed) equal to them.
TEST(LaunchCuda, StageNamesAndBytesEqualTheCpuPublishers) {
  SKIP_WITHOUT_GPU();
  nlohmann::json runs[2];
  const char* backends[2] = {"cpu", "cuda"};
  for (int b = 0; b < 2; ++b) {
    // stdout only, through a shell: rank 0's JSON must not interleave with the tables on stderr.
    std::vector<std::string> args{"-c", "exec \"$0\" \"$@\" 2>/dev/null", PCPKV_CLI_PATH, "launch", "--nproc", "2",
                                  "--output", "rank0", "--gpus", "0", "--", "mp-publish", "--backend", backends[b],
                                  "--tokens", "40", "--decodes", "1", "--topk-width", "16", "--json"};
    if (b == 0) args.erase(args.begin() + 8, args.begin() + 10);  // the CPU run needs no GPU
    const auto r = run_program(args, 600, clean_env(), "/bin/sh");
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    runs[b] = mp_publish_json(r.output);
    ASSERT_TRUE(runs[b].contains("transports")) << r.output;
  }
  ASSERT_EQ(runs[1]["transports"].size(), 3u);
  ASSERT_EQ(runs[0]["transports"].size(), runs[1]["transports"].size());
  for (size_t t = 0; t < runs[0]["transports"].size(); ++t) {
    const auto& cpu = runs[0]["transports"][t];
    const auto& gpu = runs[1]["transports"][t];
    ASSERT_EQ(cpu["transport"], gpu["transport"]);
    ASSERT_EQ(cpu["stages"].size(), gpu["stages"].size()) << cpu.dump() << "\n" << gpu.dump();
    EXPECT_EQ(gpu["stages"][0]["name"], "topk-fill") << gpu.dump();
    for (size_t k = 0; k < cpu["stages"].size(); ++k) {
      EXPECT_EQ(gpu["stages"][k]["name"], cpu["stages"][k]["name"]) << gpu["transport"];
      EXPECT_EQ(gpu["stages"][k]["bytes"], cpu["stages"][k]["bytes"]) << gpu["transport"] << " "
                                                                      << gpu["stages"][k]["name"];
    }
  }
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
INSTANTIATE_TEST_SUITE_P(Procs, BenchFenceSharedGpu, ::testing::Values(2, 4, 8), ::testing::PrintToStringParamName());

}  // namespace
}  // namespace pcpkv
