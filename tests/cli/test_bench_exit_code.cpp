// pcpkv-test-labels: unit
// `pcpkv bench`'s exit code from its report (bench_exit_code of pcpkv/publish/cuda.h): 1 when a replica-check row
// failed, naming the case and the check's detail; 0 when every row passed or there were none. The bench itself
// needs a GPU (tests/cli/test_publish_bench_cli.cpp); a failing row used to print FAIL and exit 0.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "pcpkv/publish/cuda.h"
#include "pcpkv_bench/publish.h"

namespace pcpkv::cuda {
namespace {

// A replica-check row as run_bench reports it (the fields bench_exit_code reads).
BenchReplicaCheck row(std::string model, int32_t pcp, KvFormat kv_format, bool pass, std::string detail) {
  return {.model = std::move(model), .pcp = pcp, .kv_format = kv_format, .pass = pass, .detail = std::move(detail)};
}

TEST(BenchExitCode, ZeroWithoutReplicaCheckRowsOrWhenEveryRowPassed) {
  BenchReport rep;
  std::string why = "stale";
  EXPECT_EQ(bench_exit_code(rep, &why), 0);
  EXPECT_EQ(why, "");
  rep.replica_checks.push_back(row("glm-5", 8, KvFormat::kFp8DsMla, true, "8 replicas agree"));
  rep.replica_checks.push_back(row("deepseek-v3.2", 8, KvFormat::kFp8, true, "8 replicas agree"));
  EXPECT_EQ(bench_exit_code(rep, &why), 0);
  EXPECT_EQ(why, "");
  EXPECT_EQ(bench_exit_code(rep), 0);
}

TEST(BenchExitCode, OneWhenAReplicaCheckRowFailedNamingEveryFailedRow) {
  BenchReport rep;
  rep.replica_checks.push_back(row("glm-5", 8, KvFormat::kFp8DsMla, false, "layer 0 (direct): rank 7 differs"));
  rep.replica_checks.push_back(row("glm-5", 8, KvFormat::kFp8, true, "8 replicas agree"));
  rep.replica_checks.push_back(row("deepseek-v3.2", 4, KvFormat::kFp8, false, "layer 0 (direct): rank 2 differs"));
  std::string why;
  EXPECT_EQ(bench_exit_code(rep, &why), 1);
  EXPECT_EQ(why, "glm-5 PCP 8 fp8_ds_mla: layer 0 (direct): rank 7 differs; deepseek-v3.2 PCP 4 fp8: layer 0 "
                 "(direct): rank 2 differs");
  EXPECT_EQ(bench_exit_code(rep), 1);
}

}  // namespace
}  // namespace pcpkv::cuda
