// src/cpu/router_dispatch.cpp: THE dispatch table of the router GEMM (pcpkv/router.h), small-T kernel
// versus cuBLASLt. One table for every preset and both weight dtypes: the kernel is bound by reading W once
// (3 MB for GLM-5, 3.5 MB for DeepSeek-V3.2), so the crossover depends on the token count, not the preset.
//
// MEASURED: NVIDIA H200 (one GPU, CUDA 13.0, sm_90), 2026-11-29, `pcpkv bench-serving` (defaults: presets
// glm-5 and deepseek-v3.2, T = 1, 2, 4, 8, 16, 32, cold L2, median of 50 CUDA-graph replays), its
// "suggested dispatch" table (fastest variant per T, summed over both presets); microseconds per call,
// glm-5 / deepseek-v3.2:
//   T    small/e1 (v1)   cuBLASLt      fastest
//   1    3.34 / 3.62     6.29 / 6.43   small/e1
//   2    4.18 / 4.51     6.29 / 6.33   small/e1
//   4    6.04 / 6.42     6.32 / 6.52   small/e1 (by 4% / 1.5%)
//   8    9.61 / 10.37    6.35 / 6.54   cublaslt
//   16   10.00 / 11.03   6.52 / 6.73   cublaslt
//   32   24.38 / 26.12   6.49 / 6.69   cublaslt
// (small/e2, e4, e8 were slower than small/e1 at every T.) The staged kernel (small2, v2) was not in that
// run: replace the rows below with the next run's "suggested dispatch" and update this comment.
#include <climits>
#include <vector>

#include "pcpkv/error.h"
#include "pcpkv/router.h"

namespace pcpkv {

const std::vector<RouterDispatchEntry>& router_dispatch_table() {
  static const std::vector<RouterDispatchEntry> table = {
      {4, RouterPath::kSmallT, 1, RouterSmallKernel::kRowLoop},  // T = 1..4 (T = 3 runs the bucket-4 kernel)
      {INT32_MAX, RouterPath::kCublasLt, 0, RouterSmallKernel::kRowLoop},  // T >= 5: x re-reads dominate
  };
  return table;
}

RouterDispatchEntry router_dispatch(int64_t num_tokens) {
  PCPKV_CHECK(num_tokens >= 1, "router: num_tokens = {} must be >= 1 to dispatch", num_tokens);
  for (const RouterDispatchEntry& e : router_dispatch_table())
    if (num_tokens <= e.max_tokens) return e;
  return router_dispatch_table().back();
}

int32_t router_token_bucket(int64_t num_tokens) {
  PCPKV_CHECK(num_tokens >= 1 && num_tokens <= kRouterSmallMaxTokens,
              "router: num_tokens = {} is outside the small-T kernel's range [1, {}]", num_tokens,
              kRouterSmallMaxTokens);
  int32_t b = 1;
  while (b < num_tokens) b *= 2;
  return b;
}

}  // namespace pcpkv
