// `pcpkv bench`'s verdict (bench_exit_code of pcpkv/publish/cuda.h): host code, built without CUDA too, so the
// decision is tested on the CPU (tests/cli/test_bench_exit_code.cpp).
#include <fmt/format.h>

#include "pcpkv/core/layout.h"
#include "pcpkv/publish/cuda.h"

namespace pcpkv::cuda {

int bench_exit_code(const BenchReport& report, std::string* why) {
  std::string failed;
  int num_failed = 0;
  for (const BenchReplicaCheck& c : report.replica_checks) {
    if (c.pass) continue;
    failed += fmt::format("{}{} PCP {} {}: {}", num_failed++ ? "; " : "", c.model, c.pcp, to_string(c.kv_format),
                          c.detail);
  }
  if (why != nullptr) *why = failed;
  return num_failed > 0 ? 1 : 0;
}

}  // namespace pcpkv::cuda
