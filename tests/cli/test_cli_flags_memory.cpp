// pcpkv-test-labels: unit
// `attention` and `mp-publish` estimate their memory from the flags and refuse a batch that cannot fit
// before anything is allocated: exit code 2, a message naming the sizing flags and their values, the
// estimate and the memory available, nothing on stdout, and (the point) no multi-gigabyte climb first: each
// test bounds the peak RSS of the processes it started (getrusage(RUSAGE_CHILDREN); ctest runs every test
// in its own process) and the wall time. Launched, every rank refuses before the rendezvous, so none waits.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <string>
#include <vector>

#include "support/cli_util.h"

using pcpkv_test::CliResult;
using pcpkv_test::run_cli;
using pcpkv_test::ScratchDir;

namespace {

// Largest resident set of any child process so far, in bytes (ru_maxrss is in KiB on Linux).
long children_peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_CHILDREN, &u);
  return u.ru_maxrss * 1024L;
}

// A refusal is a quick look at the flags: far below the gigabytes the bad runs used to reach. The bound is
// over what the binary holds after `--help` (a CUDA build maps cuBLASLt at start-up, ~220 MB).
constexpr long kMaxRefusalExtraRss = 200L << 20;
long startup_rss_bytes() {
  static const long rss = [] {
    ScratchDir dir;
    run_cli("--help", dir);
    return children_peak_rss_bytes();
  }();
  return rss;
}
constexpr double kMaxRefusalSeconds = 20.0;

void expect_memory_refusal(const std::string& args, const std::vector<std::string>& expect) {
  const long max_rss = startup_rss_bytes() + kMaxRefusalExtraRss;
  ScratchDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const CliResult r = run_cli(args, dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pcpkv_test::expect_refusal(r, args, expect, dir, {}, /*error_first=*/false);
  EXPECT_NE(r.err.find("memory"), std::string::npos) << args << "\n" << r.err;
  EXPECT_NE(r.err.find("available"), std::string::npos) << args << "\n" << r.err;
  EXPECT_LT(s, kMaxRefusalSeconds) << args;
  EXPECT_LT(children_peak_rss_bytes(), max_rss) << args << ": allocated before refusing";
}

TEST(CliFlagsMemory, AttentionHugePrefill) {
  expect_memory_refusal("attention --prefill 99999999999", {"--prefill '99999999999'", "host memory"});
  // Fits the int32 block tables (312500 blocks), not the memory: the indexer scores alone are [N, N].
  expect_memory_refusal("attention --prefill 20000000 --pcp 2", {"--prefill '20000000'", "--pcp 2", "indexer scores"});
}

TEST(CliFlagsMemory, AttentionHugeDecodeBatch) {
  // Used to store 2e9 requests first ("out of memory", exit 3).
  expect_memory_refusal("attention --decodes 2000000000 --pcp 1 --prefill ''",
                        {"--decodes 2000000000", "--decode-context 3000", "--pcp 1"});
  expect_memory_refusal("attention --prefill 64 --decodes 3 --decode-context 999999999999",
                        {"--decode-context 999999999999", "cache replicas"});
}

TEST(CliFlagsMemory, AttentionBenchTokens) {
  expect_memory_refusal("attention --bench --tokens 2147483647", {"--bench --tokens 2147483647", "host memory"});
}

TEST(CliFlagsMemory, MpPublishAlone) {
  // Used to climb past 6 GB (99999999999) or die with "internal: std::bad_alloc", exit 3 (20000000).
  expect_memory_refusal("mp-publish --backend cpu --tokens 99999999999",
                        {"--tokens 99999999999", "--decodes 2", "1 rank", "or --no-check"});
  expect_memory_refusal("mp-publish --backend cpu --tokens 20000000", {"--tokens 20000000", "host memory"});
  expect_memory_refusal("mp-publish --backend cpu --tokens 1 --decodes 2000000000", {"--decodes 2000000000"});
  // --no-check drops the reference's share, and the hint no longer suggests it.
  ScratchDir dir;
  const CliResult r = run_cli("mp-publish --backend cpu --tokens 99999999999 --no-check", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--no-check"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("or --no-check"), std::string::npos) << r.err;
}

// Every rank computes the job's sum over this host's ranks before the rendezvous and carries its verdict into it:
// both report both ranks' refusals right after it, both exit 2, and nobody waits for the launcher's timeout.
TEST(CliFlagsMemory, MpPublishLaunchedEveryRankRefuses) {
  ScratchDir dir;
  const std::string line = "launch --nproc 2 --timeout 60 --max-time 120 --socket-dir '" + dir.file("") +
                           "' -- mp-publish --backend cpu --tokens 20000000";
  const auto t0 = std::chrono::steady_clock::now();
  const CliResult r = run_cli(line, dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.err;
  for (const char* rank : {"[rank 0] pcpkv: error: mp-publish rank 0: the argument check failed on 2 of 2 ranks",
                           "[rank 1] pcpkv: error: mp-publish rank 1: the argument check failed on 2 of 2 ranks",
                           "): rank 0: --tokens 20000000", "; rank 1: --tokens 20000000"})
    EXPECT_NE(r.err.find(rank), std::string::npos) << "missing '" << rank << "' in\n" << r.err;
  EXPECT_NE(r.err.find("2 ranks, 2 on this host"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("1 checking rank"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("1 other rank"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_TRUE(dir.files().empty()) << "left " << dir.files().front();
  EXPECT_LT(s, kMaxRefusalSeconds) << "a rank waited for its peer";
  EXPECT_LT(children_peak_rss_bytes(), startup_rss_bytes() + kMaxRefusalExtraRss);
}

// Batches that fit still run (a small one of each).
TEST(CliFlagsMemory, SmallBatchesStillRun) {
  ScratchDir dir;
  CliResult r = run_cli("attention --pcp 1,2 --prefill 24 --decodes 1 --decode-context 40 --topk 16 --dcp 2", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  r = run_cli("mp-publish --backend cpu --tokens 96 --decodes 1", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("verdict: PASS"), std::string::npos) << r.out;
}

}  // namespace
