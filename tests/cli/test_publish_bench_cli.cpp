// pcpkv-test-labels: cuda
// `pcpkv bench --quick` end to end on the GPU: exits 0, prints the summary table last, and writes JSON with
// the copy bandwidth, the single-rank dispatch of every kernel variant, every transport's stages for every
// layer variant, graph replay times, the speedups over collect measured in the same run, PDL off / on, and the
// replica-check row (the --check-replicas debug check, apart from the runs). Skips with the reason when no GPU is visible.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pcpkv/publish/cuda.h"
#include "support/gpu.h"

namespace pcpkv {
namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(BenchCli, QuickRunWritesJsonAndSummary) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  ASSERT_TRUE(fs::exists(PCPKV_CLI_PATH)) << "build pcpkv_cli first: " << PCPKV_CLI_PATH;
  const fs::path dir = fs::temp_directory_path() / ("pcpkv_bench_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string json_path = (dir / "bench.json").string(), out_path = (dir / "out.txt").string();
  const std::string cmd = std::string("'") + PCPKV_CLI_PATH + "' bench --quick --json '" + json_path + "' >'" +
                          out_path + "' 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string out = slurp(out_path);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("## summary"), std::string::npos) << out;
  const nlohmann::json j = nlohmann::json::parse(slurp(json_path));
  EXPECT_GT(j["copy_bandwidth_gbps"].get<double>(), 100.0);
  ASSERT_FALSE(j["single_rank"].empty());
  for (const auto& s : j["single_rank"]) EXPECT_GT(s["ms"].get<double>(), 0.0);
  // glm-5, PCP 2, fp8_ds_mla: collect (its pinned baseline) + staging and direct x the 2 default variants
  ASSERT_EQ(j["runs"].size(), 5u);
  for (const auto& r : j["runs"]) {
    EXPECT_GT(r["total_ms"].get<double>(), 0.0) << r.dump();
    EXPECT_GT(r["bytes"].get<int64_t>(), 0) << r.dump();
    EXPECT_GT(r["graph_ms"].get<double>(), 0.0) << r.dump();
    EXPECT_TRUE(r.contains("speedup_vs_collect")) << r.dump();
    EXPECT_FALSE(r["stages"].empty());
    EXPECT_FALSE(r["variant"].get<std::string>().empty()) << r.dump();
    if (r["transport"] == "collect") {
      EXPECT_EQ(r["variant"], "prefetch:separate:1") << r.dump();
    }
  }
  // Single rank: 4 dispatch kernels (simple, prefetch, warp, warp_pf) x fused / separate top-k.
  EXPECT_EQ(j["single_rank"].size(), 8u);
  // PDL rows: staging and direct, off and on.
  ASSERT_EQ(j["pdl"].size(), 2u);
  for (const auto& p : j["pdl"]) {
    EXPECT_GT(p["us_off"].get<double>(), 0.0) << p.dump();
    EXPECT_GT(p["us_on"].get<double>(), 0.0) << p.dump();
  }
  EXPECT_NE(out.find("## PDL"), std::string::npos) << out;
  // The replica check (debug mode) of the PCP 2 publication: its own row, not one of the 5 runs above.
  ASSERT_EQ(j["replica_check"].size(), 1u);
  const auto& c = j["replica_check"][0];
  EXPECT_TRUE(c["pass"].get<bool>()) << c.dump();
  EXPECT_EQ(c["pcp"], 2);
  EXPECT_EQ(c["slots"], 2048);
  EXPECT_EQ(c["cache_bytes_read"].get<int64_t>(), 2 * 2048 * (656 + 132)) << c.dump();
  EXPECT_GT(c["ms"].get<double>(), 0.0) << c.dump();
  EXPECT_GT(c["direct_ms"].get<double>(), 0.0) << c.dump();
  EXPECT_NE(out.find("| glm-5 | 2 | fp8_ds_mla | replica-check | - | hashes of 2 replicas x 2048 slots + compare (pass)"),
            std::string::npos)
      << out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pcpkv
